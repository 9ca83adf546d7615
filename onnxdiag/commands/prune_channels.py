"""The ``prune-channels`` verb: remove channels physically and emit a smaller ONNX model."""

from __future__ import annotations

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, render_table
from ..report.text import fmt3
from ..structured.choice import DEFAULT_ALPHA, DEFAULT_BETA, STAT_SCORES, layer_scores, stat_scores
from .base import (
    CommandResult,
    check_out,
    describe_sources,
    example_input,
    finish_old,
    open_source,
    render_header,
    safe_ratio,
)
from .channel_pruning import check_recovery, evaluate_accuracy, recalibrate_pruned, resolve_round_to


def prune_channels_report(model, *, output, ratio=0.5, score="two_axis", data=None,
                          labels=None, eval_data=None, eval_labels=None, budget="uniform",
                          alpha=DEFAULT_ALPHA, beta=DEFAULT_BETA, plan=None, plan_out=None,
                          reference=None,
                          finetune=False, train_data=None, train_labels=None, epochs=5,
                          lr=1e-4, max_batches=200, limit=None, seed=0, batch_size=64,
                          providers=None, head=None, features=None, targets="auto",
                          out=None, overwrite=False, write=True, progress=True,
                          recalibrate_bn=False, round_to=None) -> CommandResult:
    """Remove channels physically and emit a smaller ONNX model (``onnxdiag prune-channels``).

    ``plan``: a plan JSON to replay (hash-checked) instead of scoring. ``budget``:
    uniform, global, or reference (per-group counts of the plan JSON ``reference``, by
    default of a global-threshold magnitude plan at ``ratio``). The emitted model
    gets a sidecar ``<output>.json``: plan, FLOPs/params/file size before and after,
    CPU latency at batch 1 and 32, agreement with the source, accuracy before/after.
    Recovery, in this order: ``recalibrate_bn`` (label-free: every BN's running statistics
    from the pruned model on ``data``, :func:`onnxdiag.sparsity.recalibrate_batchnorm`),
    then ``finetune``.
    """
    from ..evaluate import compare_models, make_head_runner
    from ..graph import analyze_structure
    from ..model.finalize import emit_model, finalize_model
    from ..model.io import get_input_specs, load_model, model_hash
    from ..runtime.latency import measure_latency
    from ..structured import load_plan, plan_pruning, prune_channels, replay_plan, save_plan

    protect = [model, data, eval_data, train_data, plan, reference]
    folder = check_out(out, "prune-channels", overwrite, write)
    _check_outputs(output, plan_out, protect, overwrite)
    check_recovery(recalibrate_bn, data, finetune, train_data)
    if plan is not None and round_to not in (None, 1):
        raise OnnxDiagError("--round-to shapes a new plan; a replayed --plan keeps its "
                            "channels: drop --round-to, or make the plan again with it.")
    round_to = resolve_round_to(round_to)
    m = load_model(model)
    structure = analyze_structure(m, head=head, features=features)
    specs = get_input_specs(m)
    calib = None if data is None else open_source(data, specs, labels=labels, limit=limit, seed=seed,
                                            batch_size=batch_size)
    evaluation = None if eval_data is None else open_source(eval_data, specs, labels=eval_labels,
                                                      seed=seed, batch_size=batch_size)
    notes = []
    if plan is not None:
        the_plan = load_plan(plan)
        pruned, record = replay_plan(m, the_plan)  # hash-checked: the plan's model only
        structure = analyze_structure(m, head=the_plan.head)
        score = the_plan.score
    else:
        cs = None
        if score in STAT_SCORES:
            if calib is None:
                raise OnnxDiagError(f"Score {score!r} needs calibration data; pass --data FILE.")
            cs = stat_scores(m, structure, calib, targets=targets, seed=seed,
                             providers=providers, progress=progress)
        scores, notes = layer_scores(score, m, structure, cs, alpha=alpha, beta=beta, seed=seed)
        ref = None
        if budget == "reference":  # a fixed allocation: another plan's, or global magnitude
            ref = load_plan(reference) if reference is not None else plan_pruning(
                m, structure, layer_scores("magnitude", m, structure, None)[0], ratio,
                budget="global", seed=seed)
            if ref.n_channels != the_groups(structure, ref):
                raise OnnxDiagError(f"The reference plan '{reference}' was made for a model "
                                    "with other channel groups; use a plan of this model.")
        the_plan = plan_pruning(m, structure, scores, ratio, budget=budget, reference=ref,
                                seed=seed, score_name=score, round_to=round_to)
        pruned, record = prune_channels(m, structure, the_plan.removed)
    pruned = finalize_model(pruned)
    recovered = recalibrate_bn or finetune
    acc_pruned = evaluate_accuracy(pruned, analyze_structure(pruned, head=structure.head.node_name),
                       evaluation) if recovered else None
    recalibration = None
    if recalibrate_bn:
        pruned, recalibration = recalibrate_pruned(pruned, calib, providers, m, structure,
                                             the_plan.removed)
    ft = None
    if finetune:
        pruned, ft = _finetune(pruned, train_data, train_labels, specs, epochs=epochs, lr=lr,
                               max_batches=max_batches, seed=seed, batch_size=batch_size,
                               evaluation=evaluation)
        pruned = finalize_model(pruned)
    verify = evaluation or calib
    p_struct = analyze_structure(pruned, head=structure.head.node_name)
    comparison = None if verify is None else compare_models(
        make_head_runner(m, structure.head), make_head_runner(pruned, p_struct.head), verify,
        structure.head)
    x = example_input(specs, verify)
    latency = {"source_ms": measure_latency(m, {1: x[:1], 32: x}),
               "pruned_ms": measure_latency(pruned, {1: x[:1], 32: x})}
    notes = notes + _width_notes(record, p_struct, round_to)
    sidecar = {"tool": "onnxdiag prune-channels", "plan": the_plan.to_dict(),
               "record": record.to_dict(), "comparison_with_source": comparison,
               "latency_cpu": latency, "accuracy_before": evaluate_accuracy(m, structure, evaluation),
               "accuracy_after": evaluate_accuracy(pruned, p_struct, evaluation),
               "accuracy_before_recovery": acc_pruned, "recalibration": recalibration,
               "finetune": ft,
               "notes": notes, "flops_ratio": safe_ratio(record.flops_after, record.flops_before),
               "params_ratio": safe_ratio(record.params_after, record.params_before)}
    info = emit_model(pruned, output, source_path=model, sidecar=sidecar, protect=protect)
    if plan_out:
        save_plan(the_plan, plan_out)
    info["file_size_ratio"] = safe_ratio(info["emitted"]["file_bytes"], info.get("source_file_bytes"))
    meta = build_metadata(command="prune-channels", model_path=model, model_hash=model_hash(m),
                          data=describe_sources(calibration=calib, eval=evaluation),
                          parameters=dict(output=str(output), ratio=ratio, score=score,
                                          budget=budget, alpha=alpha, beta=beta,
                                          plan=plan, reference=reference,
                                          recalibrate_bn=recalibrate_bn, round_to=round_to,
                                          finetune=finetune, epochs=epochs, lr=lr,
                                          seed=seed, limit=limit, data=data,
                                          eval_data=eval_data))
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "prune_channels": info}
    text = render_header(meta) + render_prune(info)
    from ..report import rows_to_csv

    widths = [{"layer": name, "channels_before": w[0], "channels_after": w[1]}
              for name, w in (info["record"].get("widths") or {}).items()]
    return finish_old("prune-channels", report, text, text, folder, overwrite,
                   csv=rows_to_csv(widths), csv_name="layers.csv")


def the_groups(structure, plan) -> dict:
    """{group id: channels} of ``structure`` for the groups ``plan`` names (-1: absent)."""
    n = len(structure.groups)
    return {g: structure.groups[g].n_channels if g < n else -1 for g in plan.n_channels}


def _check_outputs(output, plan_out, protect, overwrite: bool) -> None:
    """Refuse before any work: an output that is an input, or that exists (no --overwrite)."""
    from pathlib import Path

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


def _width_notes(record, pruned_structure, round_to) -> list[str]:
    """A hint when narrowed convs keep widths off ONNX Runtime's CPU channel block."""
    from ..runtime.latency import cpu_conv_block

    block = cpu_conv_block()
    if not block or (round_to and round_to % block == 0):
        return []
    convs = {la.node_name for la in pruned_structure.layers if la.op_type == "Conv"}
    off = sorted(name for name, (_, after) in record.widths.items()
                 if name in convs and after % block)
    if not off:
        return []
    return [f"{len(off)} of the {len(record.widths)} narrowed layers keep a width that is "
            f"not a multiple of {block} (e.g. {off[0]}: {record.widths[off[0]][1]}); ONNX "
            f"Runtime's blocked CPU convolutions (block {block} on this CPU) run such widths "
            f"at the cost of the next multiple or slower: a plan made with --round-to {block} "
            "keeps multiples (benchmarks/RESULTS.md, channel alignment)."]


def _finetune(model, train_data, train_labels, specs, *, epochs, lr, max_batches, seed,
              batch_size, evaluation):
    if train_data is None:
        raise OnnxDiagError("--finetune needs labelled training data; pass --train-data FILE.")
    from ..finetune import finetune_model

    train = open_source(train_data, specs, labels=train_labels, seed=seed, batch_size=batch_size)
    tuned, record = finetune_model(model, train, epochs=epochs, lr=lr, max_batches=max_batches,
                                   seed=seed, eval_source=evaluation)
    return tuned, record.to_dict()


def render_prune(info: dict) -> str:
    rec, plan = info["record"], info["plan"]
    lat = info["latency_cpu"]
    acc_b, acc_a = info.get("accuracy_before"), info.get("accuracy_after")
    rows = [{"": "source", "params": rec["params_before"], "FLOPs": rec["flops_before"],
             "file bytes": info.get("source_file_bytes"),
             "ms b=1": lat["source_ms"]["1"], "ms b=32": lat["source_ms"]["32"],
             "top-1 %": None if not acc_b else 100 * acc_b["accuracy"]},
            {"": "pruned", "params": rec["params_after"], "FLOPs": rec["flops_after"],
             "file bytes": info["emitted"]["file_bytes"],
             "ms b=1": lat["pruned_ms"]["1"], "ms b=32": lat["pruned_ms"]["32"],
             "top-1 %": None if not acc_a else 100 * acc_a["accuracy"]}]
    lines = ["== Structured pruning (SPEC B6) ==",
             f"score {plan['score']}, budget {plan['budget']}, ratio {plan['ratio']}: "
             f"{sum(len(v) for v in plan['removed'].values())} of "
             f"{sum(plan['n_channels'].values())} channels removed -> {info['emitted']['path']}",
             render_table(rows).rstrip(),
             f"FLOPs ratio {fmt3(info['flops_ratio'])}, params ratio "
             f"{fmt3(info['params_ratio'])}, file-size ratio {fmt3(info.get('file_size_ratio'))}"
             f", CPU speed-up b=1 {fmt3(_speed(lat, '1'))}x, b=32 {fmt3(_speed(lat, '32'))}x"]
    rec_acc = info.get("accuracy_before_recovery")
    if rec_acc and acc_a:
        steps = " + ".join(name for name, on in (("BN recalibration", info.get("recalibration")),
                                                 ("fine-tuning", info.get("finetune"))) if on)
        lines.append(f"top-1 of the pruned model {100 * rec_acc['accuracy']:.2f} % before "
                     f"recovery, {100 * acc_a['accuracy']:.2f} % after {steps}")
    rcl = info.get("recalibration")
    if rcl:
        lines.append(f"BN recalibration: {len(rcl['bns'])} BatchNormalization nodes"
                     + (f" and {len(rcl['layers'])} convs without BN re-standardised"
                        if rcl["layers"] else "")
                     + f" on {rcl['n_images']} calibration images"
                     + "".join(f"; {n}" for n in rcl.get("notes", [])))
    cmp_ = info.get("comparison_with_source")
    if cmp_:
        lines.append(f"top-1 agreement with the source {100 * cmp_['top1_agreement']:.1f} % on "
                     f"{cmp_['n_samples']} samples")
    lines += [f"note: {n}" for n in info.get("notes", [])]
    return "\n".join(lines) + "\n"


def _speed(lat, b):
    return lat["source_ms"][b] / lat["pruned_ms"][b] if lat["pruned_ms"][b] else None
