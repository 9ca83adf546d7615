"""The ``prune-sweep`` verb: accuracy vs kept-channel fraction per channel score,
FLOPs-matched (docs/METHODS.md §B6)."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, render_table, rows_to_csv
from ..report.text import fmt3
from ..structured.choice import (
    CONSUMER_SCORES,
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    SCORES,
    STAT_SCORES,
    layer_scores,
    stat_scores,
)
from .base import (
    CommandResult,
    DataRequest,
    HeadChoice,
    ReportTarget,
    Runtime,
    describe_sources,
    find_structure,
    finish,
    render_header,
)
from .channel_pruning import (
    Recovery,
    check_labels,
    finetune_pruned,
    needs_moments,
    open_request,
    recalibrate_pruned,
    removal_reason,
    resolve_round_to,
)
from .prune_cells import SweepCells, run_cells

COMMAND = "prune-sweep"
#: The two axes of METHODS §B6: best local-axis score vs best target-axis score (with synergy
#: and redundancy the target axis has as many scores to pick from as the local one).
LOCAL_AXIS, TARGET_AXIS = ("ix", "peer"), ("relevance", "synergy", "redundancy")
DEFAULT_RATIOS = (0.1, 0.25, 0.5, 0.75)
SWEEP_BUDGETS = ("uniform", "reference", "global")


@dataclass(frozen=True)
class PruneSweepOptions:
    """The options of ``prune-sweep`` (defaults: the CLI's).

    ``ratios``: fractions of channels removed, each in (0, 1). ``scores``: the channel
    scores compared (:data:`~onnxdiag.structured.choice.SCORES`). ``budget``: uniform,
    reference (every score gets the per-group counts of a global-threshold magnitude plan
    at that ratio) or global. ``alpha``/``beta``: two_axis weights. ``round_to``: keep a
    multiple of N channels per narrowed group. ``targets``: target of the channel
    statistics. ``seed``: ties, the random score and the statistics' spatial samples.
    """

    ratios: tuple = DEFAULT_RATIOS
    scores: tuple = SCORES
    budget: str = "uniform"
    alpha: float = DEFAULT_ALPHA
    beta: float = DEFAULT_BETA
    round_to: int | str | None = None
    targets: str = "auto"
    seed: int = 0


def normalized_auc(kept, accuracy, dense_accuracy) -> float | None:
    """Trapezoid area under accuracy(kept-channel fraction), divided by dense accuracy ×
    the range of kept fractions: 1.0 = dense accuracy kept over the whole grid.

    ``kept``/``accuracy`` include the dense point (kept 1.0, dense accuracy)."""
    k = np.asarray(kept, dtype=float)
    a = np.asarray(accuracy, dtype=float)
    if k.size < 2 or not dense_accuracy or np.any(~np.isfinite(a)):
        return None
    order = np.argsort(k)
    k, a = k[order], a[order]
    span = k[-1] - k[0]
    if span <= 0:
        return None
    area = float(np.sum((k[1:] - k[:-1]) * (a[1:] + a[:-1]) / 2))
    return area / (dense_accuracy * span)


def _parse_list(values, kind, allowed=None):
    out = []
    for v in values:
        if allowed is not None and v not in allowed:
            raise OnnxDiagError(f"Unknown {kind} {v!r}; choose from {', '.join(allowed)}.")
        if v not in out:
            out.append(v)
    if not out:
        raise OnnxDiagError(f"Give at least one {kind}.")
    return out


def prune_sweep_report(model, *, eval_data, data=None, train_data=None,
                       options: PruneSweepOptions = PruneSweepOptions(),
                       recovery: Recovery = Recovery(),  # noqa: B008 - frozen records
                       head: HeadChoice = HeadChoice(),  # noqa: B008
                       runtime: Runtime = Runtime(),  # noqa: B008
                       report: ReportTarget = ReportTarget()) -> CommandResult:  # noqa: B008
    """Accuracy vs kept-channel fraction per score, before and after recovery
    (``onnxdiag prune-sweep``, docs/METHODS.md §B6).

    The channel statistics (ix, relevance, two_axis, peer) are computed once, on ``data``;
    every (score, ratio) cell is planned, pruned and evaluated on the labelled
    ``eval_data``. ``uniform`` and ``reference`` budgets are FLOPs-matched by construction;
    ``global`` is not (the table shows each cell's FLOPs ratio). AUC: :func:`normalized_auc`.

    ``runtime.executor``: None / ``local`` with ``runtime.jobs`` processes (default 1:
    every cell here), ``ray`` / ``ray=HOST:PORT`` or an Executor: the statistics pass is
    then sharded and every cell is one unit (:mod:`.prune_cells`); the model bytes, the
    per-score channel scores and the data are shipped once. A failed cell is reported in
    ``failed`` (its row has ``error``), the others kept; its score gets no AUC. With
    ``recovery.finetune`` on Ray every node needs the [training] extra.

    Recovery (the "after" curve): ``recovery.reconstruct`` (on ``data``; auto: on
    without BatchNormalization), then ``recovery.recalibrate_bn`` (on ``data``), then
    ``recovery.finetune`` (on ``train_data``); the dense model under the same recovery is
    the after-curve's top and normaliser (reconstruction of nothing is the identity).
    """
    from ..model.io import get_input_specs, load_model, model_hash

    data, eval_data, train_data = map(DataRequest.of, (data, eval_data, train_data))
    ratios, scores = _check_options(options, data, eval_data)
    recovery.check(data, train_data)
    round_to = resolve_round_to(options.round_to)
    folder = report.folder(COMMAND)
    m = load_model(model)
    structure = find_structure(m, head, data or eval_data, providers=runtime.providers)
    _check_prunable(structure)
    requests = (data, eval_data, train_data)
    calib, evaluation, train = sources = _open(get_input_specs(m), requests, recovery)
    check_labels(structure, *sources)
    resolved, auto = recovery.resolve(m, calib is not None)  # metadata: what was asked
    dense, dense_after = _dense(m, structure, sources, resolved, options.seed, head, runtime)
    rows, failed, notes, ran_on = _run(m, structure, requests, sources, options,
                                       (ratios, scores, round_to), resolved, head, runtime)
    section = summarize_sweep(rows, dense, scores, options.budget, resolved.steps, dense_after)
    section["notes"] = sorted(set(notes + ([auto] if auto else [])))
    section["failed"] = sorted(failed, key=lambda f: (scores.index(f["score"]), f["ratio"]))
    params = {**asdict(options), "ratios": ratios, "scores": scores,
              **_params(requests, recovery, head, runtime)}
    meta = build_metadata(providers=runtime.providers,
                          command=COMMAND, model_path=model, model_hash=model_hash(m),
                          data=describe_sources(calibration=calib, evaluation=evaluation,
                                                training=train), parameters=params)
    meta["executor"] = ran_on
    text = render_header(meta) + render_sweep(section)
    return finish(COMMAND, {"schema": SCHEMA_VERSION, "metadata": meta, "prune_sweep": section},
                  text, folder, report.overwrite, csv=rows_to_csv(rows), csv_name="sweep.csv")


def _run(m, structure, requests, sources, options, grid, recovery, head, runtime) -> tuple:
    """(rows, failed cells, notes, executor description): the statistics, then every
    (score, ratio) cell of ``grid`` = (ratios, scores, round_to) on the executor."""
    from ..runtime.executor import open_executor

    data, eval_data, train_data = requests
    calib, evaluation, train = sources
    ratios, scores, round_to = grid
    with open_executor(runtime.executor, runtime.jobs, local_jobs=1) as ex:
        moments = None
        if needs_moments(recovery, scores):  # one pass, in this process
            from ..structured.choice import consumer_moments

            moments = consumer_moments(m, structure, calib, runtime.providers)
        per_score, reference, notes = _scores(m, structure, data, calib, ex, options, ratios,
                                              scores, runtime, (moments, recovery.recon_ridge))
        ctx = SweepCells(
            token=uuid.uuid4().hex, per_score=per_score, reference=reference,
            budget=options.budget, seed=options.seed, providers=runtime.providers,
            head=HeadChoice(structure.head.node_name, head.features), recovery=recovery,
            round_to=round_to, threads=None if ex.in_process else 1,
            evaluation=ex.ship(eval_data, evaluation),
            train=None if train is None else ex.ship(train_data, train),
            calib=ex.ship(data, calib) if recovery.recalibrate_bn else None,
            moments=moments if recovery.reconstruct else None)
        rows, failed = run_cells(ex, m, ctx, [(sc, r) for sc in scores for r in ratios],
                                 progress=runtime.progress)
        ran_on = ex.describe()
    return rows, failed, notes, ran_on


def _check_options(options: PruneSweepOptions, data, eval_data) -> tuple[list, list]:
    """(sorted ratios, scores without repeats), checked before any work."""
    ratios = sorted({float(r) for r in options.ratios})
    for r in ratios:
        if not 0 < r < 1:
            raise OnnxDiagError(f"Ratio {r} must be in (0, 1) (fraction of channels removed).")
    if not ratios:
        raise OnnxDiagError("Give at least one ratio, e.g. --ratios 0.25,0.5.")
    scores = _parse_list(list(options.scores), "score", SCORES)
    if options.budget not in SWEEP_BUDGETS:
        raise OnnxDiagError(f"Unknown budget {options.budget!r}; use one of "
                            f"{', '.join(SWEEP_BUDGETS)}.")
    if eval_data is None:
        raise OnnxDiagError("prune-sweep measures accuracy; pass labelled --eval-data FILE.")
    needy = STAT_SCORES + CONSUMER_SCORES
    if any(sc in needy for sc in scores) and data is None:
        raise OnnxDiagError("Scores " + ", ".join(sc for sc in scores if sc in needy)
                            + " need calibration data for the channel statistics; pass "
                            "--data FILE (or drop them from --scores).")
    return ratios, scores


def _open(specs, requests, recovery: Recovery) -> tuple:
    """(calibration, evaluation, training) DataSources; the training data only when
    fine-tuning; refuses unlabelled evaluation data."""
    data, eval_data, train_data = requests
    evaluation = eval_data.open(specs)
    if not evaluation.has_labels:
        raise OnnxDiagError("--eval-data has no labels; give an npz with a 'labels' key or "
                            "--eval-labels FILE.")
    train = open_request(train_data, specs) if recovery.finetune else None
    return open_request(data, specs), evaluation, train


def _params(requests, recovery, head, runtime) -> dict:
    """The records' part of metadata.parameters (every option, defaults included)."""
    return {"recovery": asdict(recovery), "head": asdict(head), "providers": runtime.providers,
            "executor": runtime.executor_name(), "jobs": runtime.jobs,
            **{role: None if r is None else r.params()
               for role, r in zip(("data", "eval_data", "train_data"), requests)}}


def _check_prunable(structure) -> None:
    reason = removal_reason(structure, budget="reference", ratio=None)  # the groups alone
    if reason:
        raise OnnxDiagError(f"prune-sweep has nothing to compare: {reason}. `onnxdiag "
                            "inspect MODEL` lists the channel groups and why each is kept.")


def _dense(m, structure, sources, recovery: Recovery, seed, head, runtime) -> tuple:
    """(dense top-1, dense top-1 under the same recovery or None): the curves' tops."""
    from ..evaluate import evaluate

    calib, evaluation, train = sources
    dense = evaluate(m, structure.head, evaluation, providers=runtime.providers).accuracy
    if recovery.steps is None:
        return dense, None
    recovered = m if not recovery.recalibrate_bn else recalibrate_pruned(
        m, calib, runtime.providers, m, structure, {}, features=head.features)[0]
    if recovery.finetune:
        choice = HeadChoice(structure.head.node_name, head.features)
        return dense, finetune_pruned(recovered, train, recovery, seed=seed, head=choice,
                                      evaluation=evaluation)[1].accuracy_after
    return dense, evaluate(recovered, structure.head, evaluation,
                           providers=runtime.providers).accuracy


def _scores(m, structure, data, calib, ex, options, ratios, scores, runtime,
            consumers=(None, None)) -> tuple:
    """({score: per-layer scores}, {ratio: reference plan}, notes): the statistics pass
    once per sweep (sharded on a multi-worker executor)."""
    from ..structured import plan_pruning

    cs = None
    if any(sc in STAT_SCORES for sc in scores):
        if ex.in_process:
            cs = stat_scores(m, structure, calib, targets=options.targets, seed=options.seed,
                             providers=runtime.providers, progress=runtime.progress)
        else:
            cs = _sharded_scores(m, structure, data, ex, options, runtime)
    reference = {}
    if options.budget == "reference":
        mag, _ = layer_scores("magnitude", m, structure, None)
        reference = {r: plan_pruning(m, structure, mag, r, budget="global", seed=options.seed)
                     for r in ratios}
    notes, per_score = [], {}
    for sc in scores:
        per_score[sc], extra = layer_scores(sc, m, structure, cs, alpha=options.alpha,
                                            beta=options.beta, seed=options.seed,
                                            moments=consumers[0], ridge=consumers[1])
        notes += extra
    return per_score, reference, notes


def _sharded_scores(m, structure, data, ex, options, runtime) -> dict:
    """ChannelScores per layer from the statistics pass sharded over ``ex`` (the sampled
    positions are drawn with the verb's seed; the data subset with the request's)."""
    from ..channels.collect import collect_channel_moments_sharded
    from ..channels.layers import score_collected

    stats = collect_channel_moments_sharded(
        m, structure, data, executor=ex, seed=options.seed, targets=options.targets,
        providers=runtime.providers,
        label="Channel statistics" if runtime.progress else None)
    return {name: sc for name, (_, sc, _) in score_collected(m, stats, structure).items()}


def summarize_sweep(rows, dense, scores, budget, recovery, dense_after=None) -> dict:
    """Normalised AUC per score (before / after recovery), FLOPs matching per ratio and the
    local-axis vs target-axis comparison of docs/METHODS.md §B6.

    ``recovery``: what the after-curve applied ("BN recalibration", "fine-tuning", both
    joined by " + "), or None/False for none (True reads as "fine-tuning"). The
    after-recovery curve starts at, and is normalised by, ``dense_after``: the dense
    model under the same recovery (the dense accuracy when not given)."""
    if recovery is True:
        recovery = "fine-tuning"
    finetune = bool(recovery)  # whether there is an after-curve
    top = dense if dense_after is None else dense_after
    auc = {}
    for sc in scores:
        mine = [r for r in rows if r["score"] == sc]
        kept = [1.0] + [r["kept_fraction"] for r in mine]
        entry = {"before": normalized_auc(kept, [dense] + [r["accuracy_before"] for r in mine],
                                          dense)}
        if finetune:
            entry["after"] = normalized_auc(kept, [top] + [r["accuracy_after"]
                                                           for r in mine], top)
        auc[sc] = entry
    matched = {}
    for r in sorted({row["ratio"] for row in rows}):
        flops = {row["flops_ratio"] for row in rows
                 if row["ratio"] == r and row["flops_ratio"] is not None}
        if not flops:
            continue
        matched[str(r)] = {"flops_ratio_min": min(flops), "flops_ratio_max": max(flops),
                           "matched": max(flops) - min(flops) < 1e-12}
    compare = {}
    for phase in ("before", "after") if finetune else ("before",):
        local = [(auc[s][phase], s) for s in LOCAL_AXIS if s in auc and auc[s][phase] is not None]
        target = [(auc[s][phase], s) for s in TARGET_AXIS
                  if s in auc and auc[s][phase] is not None]
        if local and target:
            (bl, sl), (bt, st) = max(local), max(target)
            compare[phase] = {"best_local": sl, "best_target": st,
                              "local_minus_target_pp": 100 * (bl - bt)}
    return {"dense_accuracy": dense, "dense_accuracy_after_recovery": dense_after,
            "budget": budget, "finetune": "fine-tuning" in (recovery or ""),
            "recovery": recovery or None, "rows": rows,
            "auc": auc, "flops_matched": matched, "local_vs_target": compare,
            "auc_definition": "trapezoid area of accuracy over the kept-channel fraction "
                              "(dense point at 1.0 included), divided by dense accuracy x "
                              "the kept-fraction range"
                              + (f"; after recovery ({recovery}) the dense point and the "
                                 "normaliser are the dense model under the same recovery"
                                 if finetune else "")}


def render_sweep(section: dict) -> str:
    rows = section["rows"]
    recovery = section.get("recovery") or ("fine-tuning" if section["finetune"] else None)
    fin = bool(recovery)
    ratios = sorted({r["ratio"] for r in rows})
    table = []
    for sc, entry in section["auc"].items():
        line = {"score": sc}
        for r in ratios:
            cell = next(x for x in rows if x["score"] == sc and x["ratio"] == r)
            if cell.get("error") is not None:
                line[f"kept {1 - r:.2f}"] = "failed"
                continue
            acc = f"{100 * cell['accuracy_before']:.1f}"
            if fin:
                acc += f" / {100 * cell['accuracy_after']:.1f}"
            line[f"kept {1 - r:.2f}"] = acc
        line["AUC"] = fmt3(entry["before"])
        if fin:
            line["AUC rec."] = fmt3(entry.get("after"))
        table.append(line)
    flops = ", ".join(f"{1 - float(r):.2f}: {fmt3(v['flops_ratio_min'])}"
                      + ("" if v["matched"] else f"-{fmt3(v['flops_ratio_max'])} (not matched)")
                      for r, v in section["flops_matched"].items())
    lines = ["== Structured pruning sweep (docs/METHODS.md §B6) ==",
             f"dense top-1 {100 * section['dense_accuracy']:.2f} %"
             + ("" if section.get("dense_accuracy_after_recovery") is None else
                f" ({100 * section['dense_accuracy_after_recovery']:.2f} % after the same "
                f"{recovery})") + ", budget "
             f"{section['budget']}; cells: top-1 % before"
             + (f" / after recovery ({recovery})" if fin else " (no recovery)"),
             render_table(table).rstrip(),
             f"FLOPs ratio per kept fraction: {flops}",
             "AUC: " + section["auc_definition"]]
    for phase, c in section["local_vs_target"].items():
        lines.append(f"{phase} recovery: best local-axis ({c['best_local']}) minus best "
                     f"target-axis ({c['best_target']}) AUC: {c['local_minus_target_pp']:+.1f} pp")
    lines += [f"FAILED cell {f['score']} ratio {f['ratio']}: {f['error']}"
              for f in section.get("failed", [])]
    lines += [f"note: {n}" for n in section.get("notes", [])]
    return "\n".join(lines) + "\n"
