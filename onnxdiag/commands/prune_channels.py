"""The ``prune-channels`` verb: remove channels physically and emit a smaller ONNX model
(docs/METHODS.md §B6)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, rows_to_csv
from ..runtime.latency import LATENCY_BUDGET_S, check_latency_budget
from ..structured.choice import DEFAULT_ALPHA, DEFAULT_BETA, STAT_SCORES, layer_scores, stat_scores
from .base import (
    CommandResult,
    DataRequest,
    HeadChoice,
    ReportTarget,
    Runtime,
    describe_sources,
    example_input,
    find_structure,
    finish,
    render_header,
    safe_ratio,
)
from .channel_pruning import (
    Recovery,
    check_labels,
    finetune_pruned,
    needs_moments,
    open_request,
    pruned_structure,
    recalibrate_pruned,
    reconstruct_pruned,
    removal_reason,
    resolve_round_to,
)
from .plan_transfer import stamp_plan
from .prune_channels_text import render_prune, width_notes

COMMAND = "prune-channels"


@dataclass(frozen=True)
class ChannelPruneOptions:
    """The options of ``prune-channels`` (defaults: the CLI's).

    ``ratio``: fraction of each group's channels to remove, in (0, 1) (unused when a
    ``plan`` is replayed or a ``reference`` plan gives the counts). ``score``: channel
    score, higher = keep (:data:`~onnxdiag.structured.choice.SCORES`; ix, relevance,
    two_axis and peer need calibration data). ``budget``: uniform, global, or reference
    (per-group counts of the plan JSON ``reference``, by default of a global-threshold
    magnitude plan at ``ratio``). ``alpha``/``beta``: two_axis weights. ``plan``: a plan
    JSON to replay (hash-checked) instead of scoring; ``plan_out``: also write the plan.
    ``round_to``: keep a multiple of N channels per narrowed group (an int, "auto" or
    None). ``targets``: target of the channel statistics (auto, labels, pseudo).
    ``seed``: ties, the random score and the statistics' spatial samples. ``fold_bn``:
    the emitted model has every Conv+BatchNormalization pair folded and redundant
    Reshape/Transpose/identity nodes removed (False: emitted as pruned).
    ``latency_budget``: seconds of timed latency rounds per batch size
    (:func:`~onnxdiag.runtime.latency.compare_latency`).
    """

    ratio: float = 0.5
    score: str = "two_axis"
    budget: str = "uniform"
    alpha: float = DEFAULT_ALPHA
    beta: float = DEFAULT_BETA
    plan: str | None = None
    plan_out: str | None = None
    reference: str | None = None
    round_to: int | str | None = None
    targets: str = "auto"
    seed: int = 0
    fold_bn: bool = True
    latency_budget: float = LATENCY_BUDGET_S


def prune_channels_report(model, *, output, data=None, eval_data=None, train_data=None,
                          options: ChannelPruneOptions = ChannelPruneOptions(),
                          recovery: Recovery = Recovery(),  # noqa: B008 - frozen records
                          head: HeadChoice = HeadChoice(),  # noqa: B008
                          runtime: Runtime = Runtime(),  # noqa: B008
                          report: ReportTarget = ReportTarget()) -> CommandResult:  # noqa: B008
    """Remove channels physically and emit a smaller ONNX model (``onnxdiag prune-channels``).

    ``output``: the model file to write; a sidecar ``<output>.json`` goes beside it with
    the report section: ``source`` and ``emitted`` (path, hash, size, params, FLOPs),
    ``checks``, ``comparison`` with the source, ``latency_ms`` (CPU, batch 1 and 32),
    ``accuracy`` (on ``eval_data``: source, emitted, before recovery), the plan,
    ``optimization`` (``options.fold_bn``: the Conv+BN pairs folded, the nodes removed,
    the check against the unfolded model) and ``nothing_removed`` (why, when no channel
    could be removed). ``data``: calibration data (scores from channel statistics,
    ``recovery.recalibrate_bn``); ``eval_data``: labelled evaluation data; ``train_data``:
    for ``recovery.finetune``. Data arguments are DataRequests or plain paths / arrays.
    Never overwrites an input; an existing output is replaced only with ``report.overwrite``.
    """
    data, eval_data, train_data = map(DataRequest.of, (data, eval_data, train_data))
    protect = _inputs(model, options, (data, eval_data, train_data))
    folder = _check_before_work(output, data, train_data, options, recovery, report, protect)
    from ..model.io import get_input_specs, load_model

    m = load_model(model)
    specs = get_input_specs(m)
    calib, evaluation = open_request(data, specs), open_request(eval_data, specs)
    train = open_request(train_data, specs) if recovery.finetune else None
    if options.plan is not None:  # the plan names its head (and features)
        the_plan, structure, head, notes = replay_plan_file(m, options.plan)
    else:
        structure = find_structure(m, head, data or eval_data, providers=runtime.providers)
    check_labels(structure, calib, evaluation, train)  # before the statistics pass
    resolved, auto, moments = _consumer_inputs(m, structure, calib, options, recovery, runtime)
    if options.plan is None:
        the_plan, notes = new_plan(m, structure, calib, options, head, runtime, moments)
    notes = notes + ([auto] if auto else [])
    pruned, p_struct, record, steps = prune_and_recover(
        m, structure, the_plan, (calib, evaluation, train), resolved,
        (options.seed, head, runtime, moments))
    feeds = dict(example_input(specs, evaluation or calib)[:8])
    emitted, e_struct, optimization = _optimize(pruned, (structure, p_struct), head,
                                                options.fold_bn, _check_feeds(specs, feeds))
    section = _measure(model, (m, structure), (emitted, e_struct), record, the_plan,
                       (calib, evaluation), runtime, options.latency_budget)
    section["accuracy"]["before_recovery"] = steps.pop("before_recovery")
    section.update(steps, optimization=optimization, notes=notes + section["notes"]
                   + width_notes(record, p_struct, the_plan.settings.get("round_to")))
    info = _emit(emitted, output, model, section, protect, feeds)
    _save_plan(the_plan, options.plan_out)
    meta = build_metadata(providers=runtime.providers,
                          command=COMMAND, model_path=model, model_hash=info["source"]["sha256"],
                          data=describe_sources(calibration=calib, evaluation=evaluation,
                                                training=train),
                          parameters=_parameters(output, options, recovery, head, runtime,
                                                 data=data, eval_data=eval_data,
                                                 train_data=train_data))
    text = render_header(meta) + render_prune(info)
    return finish(COMMAND, {"schema": SCHEMA_VERSION, "metadata": meta, "prune_channels": info},
                  text, folder, report.overwrite, csv=_widths_csv(info), csv_name="layers.csv")


def _consumer_inputs(m, structure, calib, options, recovery: Recovery, runtime) -> tuple:
    """(the Recovery with ``reconstruct`` decided, the note of auto's choice or None, the
    dense consumers' input moments when the reconstruction or the score needs them)."""
    recovery, auto = recovery.resolve(m, calib is not None)
    moments = None
    if needs_moments(recovery, [] if options.plan is not None else [options.score]):
        from ..structured.choice import consumer_moments

        moments = consumer_moments(m, structure, calib, runtime.providers)
    return recovery, auto, moments


def _save_plan(plan, path) -> None:
    """Write ``plan`` as JSON to ``path`` (``--plan-out``; nothing when None)."""
    if path:
        from ..structured import save_plan

        save_plan(plan, path)


def _widths_csv(info: dict) -> str:
    """layers.csv: each narrowed layer's channels before and after."""
    return rows_to_csv([{"layer": name, "channels_before": w[0], "channels_after": w[1]}
                        for name, w in (info["record"].get("widths") or {}).items()])


def _inputs(model, options, requests) -> list:
    """The input files an output must never replace."""
    return [model, options.plan, options.reference,
            *(p for r in requests if r is not None for p in (r.source, r.labels))]


# -- before any work --------------------------------------------------------------------------
def _check_before_work(output, data, train_data, options, recovery, report, protect):
    """Every refusal that needs no model: outputs, recovery inputs, the options."""
    folder = report.folder(COMMAND)
    _check_outputs(output, options.plan_out, protect, report.overwrite)
    recovery.check(data, train_data)
    if options.plan is not None and options.round_to not in (None, 1):
        raise OnnxDiagError("--round-to shapes a new plan; a replayed --plan keeps its "
                            "channels: drop --round-to, or make the plan again with it.")
    resolve_round_to(options.round_to)  # a bad value refused here, before any work
    check_latency_budget(options.latency_budget)
    ratio_used = options.plan is None and not (options.budget == "reference"
                                               and options.reference is not None)
    if ratio_used and not 0 < options.ratio < 1:
        raise OnnxDiagError(f"--ratio {options.ratio:g} " + (
            "removes no channel and would write the model unchanged" if options.ratio == 0
            else "is not a fraction of channels") + "; give the fraction of each group's "
            "channels to remove, in (0, 1), e.g. --ratio 0.5.")
    return folder


def _check_outputs(output, plan_out, protect, overwrite: bool) -> None:
    """Refuse before any work: an output that is an input, or that exists (no --overwrite)."""
    from ..errors import OutputError
    from ..model.io import check_output_path

    if output is None:
        raise OnnxDiagError("prune-channels needs an output model path; pass -o smaller.onnx.")
    out = check_output_path(output, protect=protect)
    targets = [out, out.with_name(out.name + ".json")]
    if plan_out:
        targets.append(check_output_path(plan_out, protect=protect + [output]))
        if Path(plan_out).resolve() in {t.resolve() for t in targets[:2]}:
            raise OutputError(f"--plan-out '{plan_out}' collides with the output model or its "
                              "sidecar; choose another plan file name.")
    for path in targets:
        if Path(path).exists() and not overwrite:
            raise OutputError(f"'{path}' already exists; pass --overwrite to replace it or "
                              "choose another name.")


# -- the plan ---------------------------------------------------------------------------------
def replay_plan_file(m, path):
    """(the plan of ``path``; the structure of ``m`` it applies to: the model it was made
    on, or another checkpoint of its architecture (docs/METHODS.md §A5); its HeadChoice;
    notes)."""
    from ..structured import load_plan
    from .plan_transfer import plan_target, transfer_note

    plan = load_plan(path)
    structure, transfer = plan_target(m, plan)
    return plan, structure, HeadChoice(plan.head, plan.features), transfer_note(transfer)


def new_plan(m, structure, calib, options: ChannelPruneOptions, head: HeadChoice,
             runtime: Runtime, moments=None):
    """(a new Plan of ``options``, notes); the statistics pass is skipped when nothing
    can be removed whatever the scores."""
    from ..structured import load_plan, plan_pruning, random_scores

    if removal_reason(structure, budget=options.budget, ratio=options.ratio):
        scores, notes = random_scores(structure, seed=options.seed), []
    else:
        cs = None
        if options.score in STAT_SCORES:
            if calib is None:
                raise OnnxDiagError(f"Score {options.score!r} needs calibration data; pass "
                                    "--data FILE.")
            cs = stat_scores(m, structure, calib, targets=options.targets, seed=options.seed,
                             providers=runtime.providers, progress=runtime.progress)
        scores, notes = layer_scores(options.score, m, structure, cs, alpha=options.alpha,
                                     beta=options.beta, seed=options.seed, moments=moments)
    ref = None
    if options.budget == "reference":  # a fixed allocation: another plan's, or global magnitude
        ref = load_plan(options.reference) if options.reference is not None else plan_pruning(
            m, structure, layer_scores("magnitude", m, structure, None)[0], options.ratio,
            budget="global", seed=options.seed)
        if ref.n_channels != the_groups(structure, ref):
            raise OnnxDiagError(f"The reference plan '{options.reference}' was made for a "
                                "model with other channel groups; use a plan of this model.")
    plan = plan_pruning(m, structure, scores, options.ratio, budget=options.budget,
                        reference=ref, seed=options.seed, score_name=options.score,
                        round_to=resolve_round_to(options.round_to), features=head.features)
    return stamp_plan(plan, m), notes


def the_groups(structure, plan) -> dict:
    """{group id: channels} of ``structure`` for the groups ``plan`` names (-1: absent)."""
    n = len(structure.groups)
    return {g: structure.groups[g].n_channels if g < n else -1 for g in plan.n_channels}


# -- prune, recover, measure ------------------------------------------------------------------
def prune_and_recover(m, structure, plan, sources, recovery: Recovery, how):
    """(the pruned and recovered model, its structure, the PruneRecord, {accuracy before
    recovery, recalibration, finetune}); ``sources`` = (calib, evaluation, train), ``how``
    = (seed, head choice, runtime)."""
    from ..evaluate import evaluate
    from ..model.finalize import finalize_model
    from ..structured.plan import prune_planned

    calib, evaluation, train = sources
    seed, head, runtime, moments = how
    pruned, record = prune_planned(m, structure, plan.removed)
    pruned = finalize_model(pruned)
    p_struct = pruned_structure(pruned, structure, head)
    p_head = p_struct.head
    steps = {"before_recovery": None if recovery.steps is None else _dict(evaluate(
        pruned, p_head, evaluation, providers=runtime.providers)), "recalibration": None,
        "finetune": None, "reconstruction": None}
    if recovery.reconstruct and plan.n_removed:
        pruned, steps["reconstruction"] = reconstruct_pruned(
            m, structure, plan.removed, moments, recovery, features=head.features)
    if recovery.recalibrate_bn:
        pruned, steps["recalibration"] = recalibrate_pruned(
            pruned, calib, runtime.providers, m, structure, plan.removed,
            features=head.features)
    if recovery.finetune:
        pruned, ft = finetune_pruned(pruned, train, recovery, seed=seed,
                                     head=HeadChoice(p_head.node_name, head.features),
                                     evaluation=evaluation)
        pruned, steps["finetune"] = finalize_model(pruned), ft.to_dict()
    if steps["reconstruction"] or steps["finetune"]:  # the head's weights may have moved
        p_struct = pruned_structure(pruned, structure, head)
    return pruned, p_struct, record, steps


def _optimize(pruned, structures, head: HeadChoice, fold_bn: bool, feeds: dict):
    """(the model to emit, its structure, the section's ``optimization`` record): with
    ``fold_bn``, Conv+BN folded and redundant nodes removed, the head's tensors kept, and
    the result checked against ``pruned`` on ``feeds`` (float rounding only)."""
    from ..model.optimize import check_equivalent, optimize_for_inference

    structure, p_struct = structures
    info = {"fold_bn": fold_bn, "folded": [], "removed": [], "max_abs_output_diff": None,
            "max_rel_output_diff": None}
    if not fold_bn:
        return pruned, p_struct, info
    h = p_struct.head
    keep = () if h is None else [t for t in (h.features, h.logits, h.scores, h.output) if t]
    emitted, record = optimize_for_inference(pruned, keep=keep)
    if not record.changed:
        return pruned, p_struct, info
    info.update(record.to_dict(), **check_equivalent(pruned, emitted, feeds))
    return emitted, pruned_structure(emitted, structure, head), info


def _check_feeds(specs, feeds: dict) -> dict:
    """``feeds`` when they hold data, else seeded standard-normal ones (zeros would not
    exercise the folded weights)."""
    import numpy as np

    if any(np.any(v) for v in feeds.values()):
        return feeds
    rng = np.random.default_rng(0)
    return {s.name: rng.standard_normal(feeds[s.name].shape).astype(feeds[s.name].dtype)
            if np.issubdtype(feeds[s.name].dtype, np.floating) else feeds[s.name]
            for s in specs}


def _measure(path, source, emitted, record, plan, sources, runtime, latency_budget) -> dict:
    """The section's measurements: source, comparison, latency (``latency_budget``
    seconds per batch size), accuracy, notes; ``source`` / ``emitted``: (model,
    structure)."""
    from ..evaluate import compare_models, evaluate, make_head_runner
    from ..model.io import get_input_specs, model_hash
    from ..runtime.latency import compare_latency

    (m, structure), (pruned, p_struct) = source, emitted
    calib, evaluation = sources
    verify = evaluation or calib
    comparison = None if verify is None else {**compare_models(
        make_head_runner(m, structure.head, providers=runtime.providers),
        make_head_runner(pruned, p_struct.head, providers=runtime.providers), verify,
        structure.head), "data": "evaluation" if evaluation is not None else "calibration"}
    x = example_input(get_input_specs(m), verify)
    # one intra-op thread: two sessions' spinning thread pools interleaved on a shared
    # machine measure each other (benchmarks/bench_prune.py)
    latency = compare_latency(m, pruned, {1: x[:1], 32: x}, threads=1,
                              budget_s=latency_budget)
    is_file = isinstance(path, (str, os.PathLike)) and Path(path).is_file()
    reason = removal_reason(structure, budget=plan.budget, ratio=plan.ratio, plan=plan)
    return {
        "tool": "onnxdiag prune-channels",
        "source": {"path": str(path) if is_file else None, "sha256": model_hash(m),
                   "file_bytes": os.path.getsize(path) if is_file else None,
                   "params": record.params_before, "flops": record.flops_before},
        "emitted": {"params": p_struct.n_params, "flops": p_struct.flops},
        "comparison": comparison,
        "latency_ms": {**latency, "providers": "cpu"},
        "accuracy": {"source": _dict(evaluate(m, structure.head, evaluation,
                                              providers=runtime.providers)),
                     "emitted": _dict(evaluate(pruned, p_struct.head, evaluation,
                                               providers=runtime.providers))},
        "notes": [] if reason is None else [f"nothing removed: {reason}"],
        "plan": plan.to_dict(), "record": record.to_dict(), "nothing_removed": reason,
        "flops_ratio": safe_ratio(p_struct.flops, record.flops_before),
        "params_ratio": safe_ratio(p_struct.n_params, record.params_before)}


def _dict(evaluation):
    return None if evaluation is None else evaluation.to_dict()


# -- emit -------------------------------------------------------------------------------------
def _emit(pruned, output, model, section, protect, feeds) -> dict:
    """Write the model (checked by emit_model on ``feeds``) and its sidecar; return the
    section as the sidecar has it (``emitted`` with the params and FLOPs)."""
    from ..model.finalize import emit_model

    order = ("tool", "source", "emitted", "checks", "comparison", "latency_ms", "accuracy",
             "notes", "nothing_removed", "plan", "record", "optimization", "reconstruction",
             "recalibration", "finetune", "flops_ratio", "params_ratio")

    def complete(info):
        return {**{k: info.get(k) for k in order}, "file_size_ratio": safe_ratio(
            info["emitted"]["file_bytes"], info["source"]["file_bytes"])}

    return emit_model(pruned, output, source_path=model, sidecar=section, protect=protect,
                      verify_feeds=feeds, complete=complete)


def _parameters(output, options, recovery, head, runtime, **requests) -> dict:
    """Every option, defaults included (metadata.parameters)."""
    return {"output": str(output), **asdict(options), "recovery": asdict(recovery),
            "head": asdict(head), "providers": runtime.providers,
            **{role: None if r is None else r.params() for role, r in requests.items()}}
