"""The structured-pruning verbs (SPEC B6): ``prune-channels`` and ``prune-sweep``.

Channel scores (higher = keep) come from the model alone (magnitude, bn_scale, random)
or from one channel-statistics pass over calibration data (ix, relevance, two_axis,
peer). Budgets are FLOPs-matched by construction: with the ``uniform`` budget every
score removes the same number of channels from every group.
"""

from __future__ import annotations

import uuid

import numpy as np

from .analysis import CommandResult, _check_out, _finish, _header, _open
from .errors import OnnxDiagError
from .report import SCHEMA_VERSION, build_metadata, render_table

MODEL_SCORES = ("magnitude", "bn_scale", "random")
STAT_SCORES = ("ix", "relevance", "two_axis", "peer")
SCORES = MODEL_SCORES + STAT_SCORES
#: SPEC B6 two_axis = alpha·norm(I_X) − beta·norm(I(T;Y)); beta grid {0, .1, .25, .5, 1}.
DEFAULT_ALPHA, DEFAULT_BETA = 1.0, 0.25


def _norm(v: np.ndarray) -> np.ndarray:
    lo, hi = np.nanmin(v), np.nanmax(v)
    return np.zeros_like(v) if hi - lo <= 0 else (v - lo) / (hi - lo)


def stat_scores(model, structure, source, *, targets="auto", seed=0, providers=None,
                progress=False) -> dict:
    """ChannelScores per analysed layer from one statistics pass (SPEC B2–B3)."""
    from .channel_report import score_collected
    from .collect import collect_channel_moments

    stats = collect_channel_moments(model, structure, source, targets=targets, seed=seed,
                                    providers=providers,
                                    label="Channel statistics" if progress else None)
    return {name: s for name, (_, s, _) in score_collected(model, stats, structure).items()}


def layer_scores(name: str, model, structure, channel_scores: dict | None, *,
                 alpha=DEFAULT_ALPHA, beta=DEFAULT_BETA, seed=0) -> tuple[dict, list[str]]:
    """{layer: (n_out,) scores} for score ``name``; layers without statistics fall back
    to magnitude (listed in the returned notes)."""
    from .structured import bn_scale_scores, magnitude_scores, random_scores

    if name not in SCORES:
        raise OnnxDiagError(f"Unknown channel score {name!r}; choose one of {', '.join(SCORES)}.")
    if name == "magnitude":
        return magnitude_scores(model, structure), []
    if name == "bn_scale":
        out = magnitude_scores(model, structure)
        out.update(bn_scale_scores(model, structure))
        return out, ["bn_scale: layers without BN scored by magnitude"]
    if name == "random":
        return random_scores(structure, seed=seed), []
    if channel_scores is None:
        raise OnnxDiagError(f"Score {name!r} needs calibration data for the channel statistics; "
                            "pass --data FILE.")
    out = magnitude_scores(model, structure)
    prunable = {m for g in structure.groups if g.prunable for m in g.members}
    fallback = sorted((set(out) - set(channel_scores)) & prunable)
    for layer, cs in channel_scores.items():
        out[layer] = stat_score(name, cs.scores, alpha=alpha, beta=beta)
    notes = [f"{name}: {len(fallback)} layer(s) without channel statistics scored by "
             f"magnitude: {', '.join(fallback[:5])}"] if fallback else []
    return out, notes


def stat_score(name: str, s: dict, *, alpha=DEFAULT_ALPHA, beta=DEFAULT_BETA) -> np.ndarray:
    """One statistics-based channel score (higher = keep) from ChannelScores.scores."""
    if name == "ix":
        return s["input_capture"]
    if name == "relevance":
        return s["task_info"]
    if name == "peer":
        return 1.0 - s["peer_r2"]
    return alpha * _norm(s["input_capture"]) - beta * _norm(s["task_info"])


def _eval(model, structure, source, providers=None):
    from .probe import evaluate_model, make_head_runner

    if source is None:
        return None
    return evaluate_model(make_head_runner(model, structure.head, providers=providers),
                          structure.head, source).to_dict()


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
    from .emit import compare_models, emit_model, finalize_model, measure_latency
    from .graph import analyze_structure
    from .model_io import get_input_specs, load_model, model_hash
    from .probe import make_head_runner
    from .structured import load_plan, plan_pruning, prune_channels, replay_plan, save_plan

    protect = [model, data, eval_data, train_data, plan, reference]
    folder = _check_out(out, "prune-channels", overwrite, write)
    _check_outputs(output, plan_out, protect, overwrite)
    _check_recovery(recalibrate_bn, data, finetune, train_data)
    if plan is not None and round_to not in (None, 1):
        raise OnnxDiagError("--round-to shapes a new plan; a replayed --plan keeps its "
                            "channels: drop --round-to, or make the plan again with it.")
    round_to = resolve_round_to(round_to)
    m = load_model(model)
    structure = analyze_structure(m, head=head, features=features)
    specs = get_input_specs(m)
    calib = None if data is None else _open(data, specs, labels=labels, limit=limit, seed=seed,
                                            batch_size=batch_size)
    evaluation = None if eval_data is None else _open(eval_data, specs, labels=eval_labels,
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
    acc_pruned = _eval(pruned, analyze_structure(pruned, head=structure.head.node_name),
                       evaluation) if recovered else None
    recalibration = None
    if recalibrate_bn:
        pruned, recalibration = _recalibrate(pruned, calib, providers, m, structure,
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
    x = _example_input(specs, verify)
    latency = {"source_ms": measure_latency(m, {1: x[:1], 32: x}),
               "pruned_ms": measure_latency(pruned, {1: x[:1], 32: x})}
    notes = notes + _width_notes(record, p_struct, round_to)
    sidecar = {"tool": "onnxdiag prune-channels", "plan": the_plan.to_dict(),
               "record": record.to_dict(), "comparison_with_source": comparison,
               "latency_cpu": latency, "accuracy_before": _eval(m, structure, evaluation),
               "accuracy_after": _eval(pruned, p_struct, evaluation),
               "accuracy_before_recovery": acc_pruned, "recalibration": recalibration,
               "finetune": ft,
               "notes": notes, "flops_ratio": _ratio(record.flops_after, record.flops_before),
               "params_ratio": _ratio(record.params_after, record.params_before)}
    info = emit_model(pruned, output, source_path=model, sidecar=sidecar, protect=protect)
    if plan_out:
        save_plan(the_plan, plan_out)
    info["file_size_ratio"] = _ratio(info["emitted"]["file_bytes"], info.get("source_file_bytes"))
    meta = build_metadata(command="prune-channels", model_path=model, model_hash=model_hash(m),
                          data=_described(calibration=calib, eval=evaluation),
                          parameters=dict(output=str(output), ratio=ratio, score=score,
                                          budget=budget, alpha=alpha, beta=beta,
                                          plan=plan, reference=reference,
                                          recalibrate_bn=recalibrate_bn, round_to=round_to,
                                          finetune=finetune, epochs=epochs, lr=lr,
                                          seed=seed, limit=limit, data=data,
                                          eval_data=eval_data))
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "prune_channels": info}
    text = _header(meta) + render_prune(info)
    from .report import rows_to_csv

    widths = [{"layer": name, "channels_before": w[0], "channels_after": w[1]}
              for name, w in (info["record"].get("widths") or {}).items()]
    return _finish("prune-channels", report, text, text, folder, overwrite,
                   csv=rows_to_csv(widths), csv_name="layers.csv")


def the_groups(structure, plan) -> dict:
    """{group id: channels} of ``structure`` for the groups ``plan`` names (-1: absent)."""
    n = len(structure.groups)
    return {g: structure.groups[g].n_channels if g < n else -1 for g in plan.n_channels}


def _check_outputs(output, plan_out, protect, overwrite: bool) -> None:
    """Refuse before any work: an output that is an input, or that exists (no --overwrite)."""
    from pathlib import Path

    from .errors import OutputError
    from .model_io import check_output_path

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


def _ratio(a, b):
    return None if not a or not b else a / b


def _example_input(specs, source) -> dict:
    """A batch of 32 for latency: real data when available, else zeros of the input shape."""
    if source is not None:
        feeds = next(iter(source.batches())).feeds
        if all(v.shape[0] >= 32 for v in feeds.values()):
            return _Feeds({k: v[:32] for k, v in feeds.items()})
    return _Feeds({s.name: np.zeros([32] + [d or 1 for d in s.shape[1:]], dtype=s.dtype)
                   for s in specs})


class _Feeds(dict):
    def __getitem__(self, key):  # slice every input: feeds[:1]
        if isinstance(key, slice):
            return _Feeds({k: v[key] for k, v in self.items()})
        return super().__getitem__(key)


def resolve_round_to(round_to) -> int | None:
    """``round_to`` as an int ≥ 1 or None; "auto" = this CPU's ONNX Runtime channel block
    (16 with AVX-512F, 8 with AVX2; None when unknown)."""
    if round_to is None:
        return None
    if isinstance(round_to, str) and round_to.strip().lower() == "auto":
        from .emit import cpu_conv_block

        return cpu_conv_block()
    from .sparsity.repairability import positive_int

    return positive_int(round_to, f"--round-to must be a positive integer or 'auto'; got "
                                  f"{round_to!r}.")


def _width_notes(record, pruned_structure, round_to) -> list[str]:
    """A hint when narrowed convs keep widths off ONNX Runtime's CPU channel block."""
    from .emit import cpu_conv_block

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


def _described(**sources) -> dict:
    """{role: DataSource.describe()} of the sources given (None ones left out)."""
    return {role: src.describe() for role, src in sources.items() if src is not None}


def _check_recovery(recalibrate_bn: bool, data, finetune: bool, train_data) -> None:
    """The recovery options' inputs, checked before any work (one-line user errors)."""
    if recalibrate_bn and data is None:
        raise OnnxDiagError("--recalibrate-bn needs calibration images for the new BN "
                            "statistics; pass --data FILE (labels are not needed).")
    if finetune:
        if train_data is None:
            raise OnnxDiagError("--finetune needs labelled training data; pass "
                                "--train-data FILE.")
        from .finetune import import_training

        import_training()  # without the training extra: its install hint, before any work


def _recalibrate(model, calib, providers, dense, structure, removed, *, threads=None,
                 cache: dict | None = None) -> tuple:
    """(model with every BN recalibrated on ``calib``, the record as a dict); convs without
    BN are re-standardised to the ``dense`` model's statistics of the channels they keep
    (``structure`` of the dense model, the plan's ``removed`` channels). ``cache``: a dict
    kept across calls on the same dense model and data (a sweep's cells), holding the
    calibration batches and the dense statistics once."""
    from .emit import finalize_model
    from .sparsity.repair import _collect_batches, conv_output_moments, recalibrate_batchnorm
    from .structured import kept_output_channels

    cache = {} if cache is None else cache
    head = structure.head.node_name if structure.head is not None else None
    if "batches" not in cache:
        cache["batches"] = _collect_batches(calib, None)
        cache["dense"] = conv_output_moments(dense, cache["batches"], head=head,
                                             providers=providers, threads=threads)
    out, record = recalibrate_batchnorm(
        model, cache["batches"], dense_model=dense,
        kept_channels=kept_output_channels(structure, removed), head=head,
        dense_moments=cache["dense"], providers=providers, threads=threads)
    return finalize_model(out), record.to_dict()


def _finetune(model, train_data, train_labels, specs, *, epochs, lr, max_batches, seed,
              batch_size, evaluation):
    if train_data is None:
        raise OnnxDiagError("--finetune needs labelled training data; pass --train-data FILE.")
    from .finetune import finetune_model

    train = _open(train_data, specs, labels=train_labels, seed=seed, batch_size=batch_size)
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
             f"FLOPs ratio {_fmt(info['flops_ratio'])}, params ratio "
             f"{_fmt(info['params_ratio'])}, file-size ratio {_fmt(info.get('file_size_ratio'))}"
             f", CPU speed-up b=1 {_fmt(_speed(lat, '1'))}x, b=32 {_fmt(_speed(lat, '32'))}x"]
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


def _fmt(x):
    return "-" if x is None else f"{x:.3f}"


# -- prune-sweep ------------------------------------------------------------------------------
LOCAL_AXIS, TARGET_AXIS = ("ix", "peer"), ("relevance",)
DEFAULT_RATIOS = (0.1, 0.25, 0.5, 0.75)
SWEEP_BUDGETS = ("uniform", "reference", "global")


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


def prune_sweep_report(model, *, eval_data, ratios=DEFAULT_RATIOS, scores=SCORES, data=None,
                       labels=None, eval_labels=None, budget="uniform", alpha=DEFAULT_ALPHA,
                       beta=DEFAULT_BETA, finetune=False, train_data=None, train_labels=None,
                       epochs=5, lr=1e-4, max_batches=200, limit=None, seed=0, batch_size=64,
                       providers=None, head=None, features=None, targets="auto",
                       executor=None, jobs=None, out=None, overwrite=False, write=True,
                       progress=True, recalibrate_bn=False, round_to=None) -> CommandResult:
    """Accuracy vs kept-channel fraction per score, before and after recovery
    (``onnxdiag prune-sweep``, SPEC B6).

    The channel statistics (for ix, relevance, two_axis, peer) are computed once; every
    (score, ratio) cell is planned, physically pruned and evaluated on ``eval_data``.
    Budgets: ``uniform`` (default) and ``reference`` (every score gets the per-group
    counts of a global-threshold magnitude plan at that ratio) are FLOPs-matched by
    construction; ``global`` (per-score threshold) is not, and the table shows each
    cell's FLOPs ratio. Normalised AUC: :func:`normalized_auc`.

    ``executor``: ``local`` (default) with ``jobs`` worker processes (default 1: every
    cell in this process), ``ray`` / ``ray=HOST:PORT``, or an
    :class:`~onnxdiag.executor.Executor`. The statistics pass is then sharded
    (:func:`onnxdiag.collect.collect_channel_moments_sharded`) and every (score, ratio)
    cell is one unit; the model bytes and every score's per-layer channel scores are
    shipped once. A failed cell is reported in ``failed`` (its row has ``error``) and the
    other cells are kept; a score with a failed cell gets no AUC. With ``finetune`` on
    Ray every node needs the [training] extra.

    Recovery (the "after" curve), in this order: ``recalibrate_bn`` (label-free, every
    BN's statistics from the pruned model on ``data``), then ``finetune``; the dense
    model goes through the same recovery for the after-curve's top and normaliser.
    """
    from .executor import LocalExecutor, RayExecutor, open_executor
    from .graph import analyze_structure
    from .model_io import get_input_specs, load_model, model_hash
    from .probe import evaluate_model, make_head_runner
    from .structured import plan_pruning

    ratios = sorted({float(r) for r in ratios})
    for r in ratios:
        if not 0 < r < 1:
            raise OnnxDiagError(f"Ratio {r} must be in (0, 1) (fraction of channels removed).")
    if not ratios:
        raise OnnxDiagError("Give at least one ratio, e.g. --ratios 0.25,0.5.")
    scores = _parse_list(list(scores), "score", SCORES)
    if budget not in SWEEP_BUDGETS:
        raise OnnxDiagError(f"Unknown budget {budget!r}; use one of {', '.join(SWEEP_BUDGETS)}.")
    if eval_data is None:
        raise OnnxDiagError("prune-sweep measures accuracy; pass labelled --eval-data FILE.")
    need_stats = any(sc in STAT_SCORES for sc in scores)
    if need_stats and data is None:
        raise OnnxDiagError("Scores " + ", ".join(sc for sc in scores if sc in STAT_SCORES)
                            + " need calibration data for the channel statistics; pass "
                            "--data FILE (or drop them from --scores).")
    _check_recovery(recalibrate_bn, data, finetune, train_data)
    round_to = resolve_round_to(round_to)
    folder = _check_out(out, "prune-sweep", overwrite, write)
    m = load_model(model)
    structure = analyze_structure(m, head=head, features=features)
    specs = get_input_specs(m)
    evaluation = _open(eval_data, specs, labels=eval_labels, seed=seed, batch_size=batch_size)
    if not evaluation.has_labels:
        raise OnnxDiagError("--eval-data has no labels; give an npz with a 'labels' key or "
                            "--eval-labels FILE.")
    train = None if not finetune else _open(train_data, specs, labels=train_labels, seed=seed,
                                            batch_size=batch_size)

    def accuracy(net, st):
        return evaluate_model(make_head_runner(net, st.head, providers=providers), st.head,
                              evaluation).accuracy

    dense = accuracy(m, structure)
    calib = None if data is None else _open(data, specs, labels=labels, limit=limit, seed=seed,
                                            batch_size=batch_size)
    dense_after = None
    if recalibrate_bn or finetune:  # the dense model under the same recovery: the top
        recovered = m if not recalibrate_bn else _recalibrate(m, calib, providers, m,
                                                              structure, {})[0]
        dense_after = accuracy(recovered, structure)
        if finetune:
            from .finetune import finetune_model

            dense_after = finetune_model(recovered, train, epochs=epochs, lr=lr,
                                         max_batches=max_batches, seed=seed,
                                         eval_source=evaluation)[1].accuracy_after
    ex, own = open_executor(executor, jobs, local_jobs=1)
    single = isinstance(ex, LocalExecutor) and (ex.jobs or 0) == 1
    try:
        cs = None
        if need_stats:  # once per sweep
            if single:
                cs = stat_scores(m, structure, calib, targets=targets, seed=seed,
                                 providers=providers, progress=progress)
            else:
                from .channel_report import score_collected
                from .collect import collect_channel_moments_sharded

                stats = collect_channel_moments_sharded(
                    m, structure, data, executor=ex, labels=labels, limit=limit, seed=seed,
                    batch_size=batch_size, targets=targets, providers=providers,
                    label="Channel statistics" if progress else None)
                cs = {name: sc for name, (_, sc, _) in
                      score_collected(m, stats, structure).items()}
        reference = {}
        if budget == "reference":
            mag, _ = layer_scores("magnitude", m, structure, None)
            reference = {r: plan_pruning(m, structure, mag, r, budget="global", seed=seed)
                         for r in ratios}
        notes, per_score = [], {}
        for sc in scores:
            per_score[sc], extra = layer_scores(sc, m, structure, cs, alpha=alpha, beta=beta,
                                                seed=seed)
            notes += extra
        cells = [(sc, r) for sc in scores for r in ratios]
        ctx = dict(token=uuid.uuid4().hex, per_score=per_score,  # one per sweep
                   reference=reference, budget=budget, seed=seed, providers=providers,
                   head=structure.head.node_name, finetune=finetune,
                   recalibrate_bn=recalibrate_bn, round_to=round_to,
                   finetune_args=dict(epochs=epochs, lr=lr, max_batches=max_batches,
                                      seed=seed),
                   threads=None if single else 1)
        eval_args = dict(source=eval_data, labels=eval_labels, seed=seed,
                         batch_size=batch_size)
        train_args = None if not finetune else dict(source=train_data, labels=train_labels,
                                                    seed=seed, batch_size=batch_size)
        calib_args = None if not recalibrate_bn else dict(
            source=data, labels=labels, limit=limit, seed=seed, batch_size=batch_size)
        if single:  # the sources opened here serve every cell
            ctx.update(evaluation=evaluation, train=train, calib=calib)
        elif isinstance(ex, RayExecutor):  # read once here, shipped once (object store)
            ctx.update(eval_args=_materialize_source(evaluation),
                       train_args=None if train is None else _materialize_source(train),
                       calib_args=None if not recalibrate_bn else _materialize_source(calib))
        else:  # each local worker process reads them once from the source
            ctx.update(eval_args=eval_args, train_args=train_args, calib_args=calib_args)
        rows, failed = [None] * len(cells), []
        for i, row, error in ex.map(_sweep_cell, cells, (m.SerializeToString(), ctx),
                                    label="Pruning cells" if progress else None,
                                    gpu=_wants_gpu(providers)):
            if row is None:
                sc, r = cells[i]
                row = {"score": sc, "ratio": r, "kept_fraction": None,
                       "channels_removed": None, "flops_ratio": None, "params_ratio": None,
                       "accuracy_before": None, "accuracy_after": None, "error": error}
                failed.append({"score": sc, "ratio": r, "error": error})
            rows[i] = row
        ran_on = ex.describe()
    finally:
        _CELL_CACHE.clear()  # this process's copy of the sweep (single-process cells)
        if own:
            ex.close()
    recovery = " + ".join(name for name, on in (("BN recalibration", recalibrate_bn),
                                                ("fine-tuning", finetune)) if on) or None
    section = summarize_sweep(rows, dense, scores, budget, recovery, dense_after)
    section["notes"] = sorted(set(notes))
    section["failed"] = sorted(failed, key=lambda f: (scores.index(f["score"]), f["ratio"]))
    meta = build_metadata(command="prune-sweep", model_path=model, model_hash=model_hash(m),
                          data=_described(calibration=calib, eval=evaluation, train=train),
                          parameters=dict(ratios=ratios, scores=scores, budget=budget,
                                          alpha=alpha, beta=beta,
                                          recalibrate_bn=recalibrate_bn, round_to=round_to,
                                          finetune=finetune,
                                          epochs=epochs, lr=lr, max_batches=max_batches,
                                          seed=seed, limit=limit, data=data,
                                          eval_data=eval_data, train_data=train_data,
                                          executor=executor.name if not own
                                          else str(executor or "local"), jobs=jobs))
    meta["executor"] = ran_on
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "prune_sweep": section}
    text = _header(meta) + render_sweep(section)
    from .channel_report import _csv

    return _finish("prune-sweep", report, text, text, folder, overwrite, csv=_csv(rows),
                   csv_name="sweep.csv")


def summarize_sweep(rows, dense, scores, budget, recovery, dense_after=None) -> dict:
    """Normalised AUC per score (before / after recovery), FLOPs matching per ratio and the
    local-axis vs target-axis comparison of SPEC B6.

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
        line["AUC"] = _fmt(entry["before"])
        if fin:
            line["AUC rec."] = _fmt(entry.get("after"))
        table.append(line)
    flops = ", ".join(f"{1 - float(r):.2f}: {_fmt(v['flops_ratio_min'])}"
                      + ("" if v["matched"] else f"-{_fmt(v['flops_ratio_max'])} (not matched)")
                      for r, v in section["flops_matched"].items())
    lines = ["== Structured pruning sweep (SPEC B6) ==",
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


# -- prune-sweep units (issue 9) ----------------------------------------------------------------
_CELL_CACHE: dict = {}  # per worker process: the sweep's model, structure and data, once


def _wants_gpu(providers) -> bool:
    from .executor import wants_gpu

    return wants_gpu(providers)


def _materialize_source(source) -> dict:
    """A DataSource's samples (in order) as arrays + labels, to ship once to Ray workers."""
    arrays, labels = source.to_arrays()
    return dict(source=arrays, labels=labels, seed=source.seed, batch_size=source.batch_size)


def _cell_context(model_bytes: bytes, ctx: dict):
    """(model, structure, evaluation, train, calib) of this sweep, built once per process."""
    hit = _CELL_CACHE.get(ctx["token"])
    if hit is not None:
        return hit
    import onnx

    from .graph import analyze_structure
    from .model_io import get_input_specs

    model = onnx.load_from_string(model_bytes)
    structure = analyze_structure(model, head=ctx["head"])
    evaluation, train, calib = ctx.get("evaluation"), ctx.get("train"), ctx.get("calib")
    if evaluation is None:
        specs = get_input_specs(model)
        evaluation = _open(ctx["eval_args"]["source"], specs, **_rest(ctx["eval_args"]))
        if ctx.get("train_args") is not None:
            train = _open(ctx["train_args"]["source"], specs, **_rest(ctx["train_args"]))
        if ctx.get("calib_args") is not None:
            calib = _open(ctx["calib_args"]["source"], specs, **_rest(ctx["calib_args"]))
    _CELL_CACHE.clear()
    _CELL_CACHE[ctx["token"]] = hit = (model, structure, evaluation, train, calib)
    return hit


def _rest(args: dict) -> dict:
    return {k: v for k, v in args.items() if k != "source"}


def _sweep_cell(cell, model_bytes: bytes, ctx: dict) -> dict:
    """One (score, ratio) cell: plan, prune physically, evaluate (and fine-tune)."""
    from .graph import analyze_structure
    from .probe import evaluate_model, make_head_runner
    from .structured import plan_pruning, prune_channels

    sc, r = cell
    m, structure, evaluation, train, calib = _cell_context(model_bytes, ctx)
    per_layer, seed = ctx["per_score"][sc], ctx["seed"]
    if ctx["budget"] == "reference":
        plan = plan_pruning(m, structure, per_layer, None, budget="reference",
                            reference=ctx["reference"][r], seed=seed, score_name=sc,
                            round_to=ctx.get("round_to"))
    else:
        plan = plan_pruning(m, structure, per_layer, r, budget=ctx["budget"], seed=seed,
                            score_name=sc, round_to=ctx.get("round_to"))
    pruned, record = prune_channels(m, structure, plan.removed)
    p_struct = analyze_structure(pruned, head=structure.head.node_name)
    total = sum(plan.n_channels.values())
    runner = make_head_runner(pruned, p_struct.head, providers=ctx["providers"],
                              threads=ctx["threads"])
    row = {"score": sc, "ratio": r,
           "kept_fraction": 1 - plan.n_removed / total if total else 1.0,
           "channels_removed": plan.n_removed,
           "flops_ratio": _ratio(record.flops_after, record.flops_before),
           "params_ratio": _ratio(record.params_after, record.params_before),
           "accuracy_before": evaluate_model(runner, p_struct.head, evaluation).accuracy,
           "accuracy_after": None}
    if ctx.get("recalibrate_bn"):
        cache = _CELL_CACHE.setdefault((ctx["token"], "recalibration"), {})
        pruned = _recalibrate(pruned, calib, ctx["providers"], m, structure, plan.removed,
                              threads=ctx["threads"], cache=cache)[0]
        if not ctx["finetune"]:
            runner = make_head_runner(pruned, p_struct.head, providers=ctx["providers"],
                                      threads=ctx["threads"])
            row["accuracy_after"] = evaluate_model(runner, p_struct.head, evaluation).accuracy
    if ctx["finetune"]:
        from .finetune import finetune_model

        _, ft = finetune_model(pruned, train, eval_source=evaluation, **ctx["finetune_args"])
        row["accuracy_after"] = ft.accuracy_after
        row["finetune_loss_first_last"] = [ft.first_loss, ft.last_loss]
    return row
