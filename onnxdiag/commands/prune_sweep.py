"""The ``prune-sweep`` verb: accuracy vs kept-channel fraction per channel score (FLOPs-matched)."""

from __future__ import annotations

import uuid

import numpy as np

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, render_table
from ..report.text import fmt3
from ..structured.choice import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    SCORES,
    STAT_SCORES,
    layer_scores,
    stat_scores,
)
from .base import (
    CommandResult,
    check_out,
    describe_sources,
    finish_old,
    open_source,
    render_header,
    safe_ratio,
)
from .channel_pruning import check_recovery, recalibrate_pruned, resolve_round_to

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
    from ..evaluate import evaluate_model, make_head_runner
    from ..graph import analyze_structure
    from ..model.io import get_input_specs, load_model, model_hash
    from ..runtime.executor import open_executor
    from ..structured import plan_pruning

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
    check_recovery(recalibrate_bn, data, finetune, train_data)
    round_to = resolve_round_to(round_to)
    folder = check_out(out, "prune-sweep", overwrite, write)
    m = load_model(model)
    structure = analyze_structure(m, head=head, features=features)
    specs = get_input_specs(m)
    evaluation = open_source(eval_data, specs, labels=eval_labels, seed=seed, batch_size=batch_size)
    if not evaluation.has_labels:
        raise OnnxDiagError("--eval-data has no labels; give an npz with a 'labels' key or "
                            "--eval-labels FILE.")
    train = None if not finetune else open_source(train_data, specs, labels=train_labels, seed=seed,
                                            batch_size=batch_size)

    def accuracy(net, st):
        return evaluate_model(make_head_runner(net, st.head, providers=providers), st.head,
                              evaluation).accuracy

    dense = accuracy(m, structure)
    calib = None if data is None else open_source(data, specs, labels=labels, limit=limit, seed=seed,
                                            batch_size=batch_size)
    dense_after = None
    if recalibrate_bn or finetune:  # the dense model under the same recovery: the top
        recovered = m if not recalibrate_bn else recalibrate_pruned(m, calib, providers, m,
                                                              structure, {})[0]
        dense_after = accuracy(recovered, structure)
        if finetune:
            from ..finetune import finetune_model

            dense_after = finetune_model(recovered, train, epochs=epochs, lr=lr,
                                         max_batches=max_batches, seed=seed,
                                         eval_source=evaluation)[1].accuracy_after
    with open_executor(executor, jobs, local_jobs=1) as ex:
        single = ex.in_process
        cs = None
        if need_stats:  # once per sweep
            if single:
                cs = stat_scores(m, structure, calib, targets=targets, seed=seed,
                                 providers=providers, progress=progress)
            else:
                from ..channels.collect import collect_channel_moments_sharded
                from ..channels.layers import score_collected

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
        elif not ex.reads_paths:  # read once here, shipped once (object store)
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
        _CELL_CACHE.clear()  # this process's copy of the sweep (single-process cells)
    recovery = " + ".join(name for name, on in (("BN recalibration", recalibrate_bn),
                                                ("fine-tuning", finetune)) if on) or None
    section = summarize_sweep(rows, dense, scores, budget, recovery, dense_after)
    section["notes"] = sorted(set(notes))
    section["failed"] = sorted(failed, key=lambda f: (scores.index(f["score"]), f["ratio"]))
    meta = build_metadata(command="prune-sweep", model_path=model, model_hash=model_hash(m),
                          data=describe_sources(calibration=calib, eval=evaluation, train=train),
                          parameters=dict(ratios=ratios, scores=scores, budget=budget,
                                          alpha=alpha, beta=beta,
                                          recalibrate_bn=recalibrate_bn, round_to=round_to,
                                          finetune=finetune,
                                          epochs=epochs, lr=lr, max_batches=max_batches,
                                          seed=seed, limit=limit, data=data,
                                          eval_data=eval_data, train_data=train_data,
                                          executor=getattr(executor, "name", None)
                                          or str(executor or "local"), jobs=jobs))
    meta["executor"] = ran_on
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "prune_sweep": section}
    text = render_header(meta) + render_sweep(section)
    from ..report.text import dict_rows_csv

    return finish_old("prune-sweep", report, text, text, folder, overwrite, csv=dict_rows_csv(rows),
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
        line["AUC"] = fmt3(entry["before"])
        if fin:
            line["AUC rec."] = fmt3(entry.get("after"))
        table.append(line)
    flops = ", ".join(f"{1 - float(r):.2f}: {fmt3(v['flops_ratio_min'])}"
                      + ("" if v["matched"] else f"-{fmt3(v['flops_ratio_max'])} (not matched)")
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
    from ..runtime.executor import wants_gpu

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

    from ..graph import analyze_structure
    from ..model.io import get_input_specs

    model = onnx.load_from_string(model_bytes)
    structure = analyze_structure(model, head=ctx["head"])
    evaluation, train, calib = ctx.get("evaluation"), ctx.get("train"), ctx.get("calib")
    if evaluation is None:
        specs = get_input_specs(model)
        evaluation = open_source(ctx["eval_args"]["source"], specs, **_rest(ctx["eval_args"]))
        if ctx.get("train_args") is not None:
            train = open_source(ctx["train_args"]["source"], specs, **_rest(ctx["train_args"]))
        if ctx.get("calib_args") is not None:
            calib = open_source(ctx["calib_args"]["source"], specs, **_rest(ctx["calib_args"]))
    _CELL_CACHE.clear()
    _CELL_CACHE[ctx["token"]] = hit = (model, structure, evaluation, train, calib)
    return hit


def _rest(args: dict) -> dict:
    return {k: v for k, v in args.items() if k != "source"}


def _sweep_cell(cell, model_bytes: bytes, ctx: dict) -> dict:
    """One (score, ratio) cell: plan, prune physically, evaluate (and fine-tune)."""
    from ..evaluate import evaluate_model, make_head_runner
    from ..graph import analyze_structure
    from ..structured import plan_pruning, prune_channels

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
           "flops_ratio": safe_ratio(record.flops_after, record.flops_before),
           "params_ratio": safe_ratio(record.params_after, record.params_before),
           "accuracy_before": evaluate_model(runner, p_struct.head, evaluation).accuracy,
           "accuracy_after": None}
    if ctx.get("recalibrate_bn"):
        cache = _CELL_CACHE.setdefault((ctx["token"], "recalibration"), {})
        pruned = recalibrate_pruned(pruned, calib, ctx["providers"], m, structure, plan.removed,
                              threads=ctx["threads"], cache=cache)[0]
        if not ctx["finetune"]:
            runner = make_head_runner(pruned, p_struct.head, providers=ctx["providers"],
                                      threads=ctx["threads"])
            row["accuracy_after"] = evaluate_model(runner, p_struct.head, evaluation).accuracy
    if ctx["finetune"]:
        from ..finetune import finetune_model

        _, ft = finetune_model(pruned, train, eval_source=evaluation, **ctx["finetune_args"])
        row["accuracy_after"] = ft.accuracy_after
        row["finetune_loss_first_last"] = [ft.first_loss, ft.last_loss]
    return row
