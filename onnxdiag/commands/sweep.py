"""The ``sweep`` verb: agreement / accuracy over sparsity × allocation × repair, with the bands."""

from __future__ import annotations

from ..report import SCHEMA_VERSION, build_metadata, render_table
from .base import CommandResult, check_out, render_header
from .pruning import (
    CTS_NOTE,
    DEFAULTS,
    band_text,
    cell_printer,
    cells_csv,
    compute_curves,
    cts_text,
    every_layer_has_bn,
    finish_files,
    make_pruner,
    needs_rr,
    parse_positions_arg,
    pruning_setup,
    say,
    using,
)


def sweep_report(model, *, executor=None, jobs=None, **kwargs) -> CommandResult:
    """Accuracy / agreement table over sparsity × allocation × repair (``onnxdiag sweep``).

    Parameters as :func:`_sweep_report`; ``executor`` (``local`` with ``jobs`` worker
    processes, ``ray``, ``ray=HOST:PORT`` or an Executor; default this process): one unit
    per cell and per RR layer.
    """
    with using(executor, jobs) as ex:
        return _sweep_report(model, ex=ex, executor=executor, jobs=jobs, **kwargs)


def _sweep_report(model, *, ex=None, sparsity, allocations="all", repairs="cr+bn,bn,none", data,
                 labels=None, eval_data=None, eval_labels=None, keep_dense=(), rr_images=64,
                 rr_positions=16, rr_prior="erk", rr_gamma=1.0, rr_cap=0.99, force_projection=False,
                 alpha_cap=100.0, recalibrate="affected", limit=None, seed=0, batch_size=64,
                 providers=None, head=None, features=None, executor=None, jobs=None,
                 out=None, overwrite=False, write=True, progress=True) -> CommandResult:
    """Accuracy / agreement table over sparsity × allocation × repair (``onnxdiag sweep``).

    ``sparsity``: a grid such as ``"0.90:0.97:0.005"``; ``allocations``: comma list or
    ``"all"`` (every rule, rr-greedy / rr-marginal included); ``repairs``: comma list.
    RR curves are computed once. Writes report.json, report.txt and sweep.csv.
    ``executor``: None (this process), ``local`` (``jobs`` worker processes), ``ray`` or
    ``ray=HOST:PORT`` (one Ray task per cell), or an :class:`~onnxdiag.executor.Executor`.
    """
    from ..model.io import model_hash
    from ..sparsity import METHODS, RULES
    from ..sparsity.sweep import parse_choices, parse_sparsity_grid, run_sweep

    grid = parse_sparsity_grid(sparsity)
    rules = parse_choices(allocations, RULES, "allocation")
    methods = parse_choices(repairs, METHODS, "repair")
    folder = check_out(out, "sweep", overwrite, write)
    m, structure, specs, calib, feeds, evaluation, layers = pruning_setup(
        model, data=data, labels=labels, limit=limit, seed=seed, batch_size=batch_size,
        head=head, features=features, eval_data=eval_data, eval_labels=eval_labels,
        keep_dense=keep_dense)
    curves = compute_curves(m, layers, feeds, n_images=rr_images, positions=rr_positions, seed=seed,
                     providers=providers, progress=progress,
                     executor=ex) if needs_rr(rules) else None
    pruner = make_pruner(m, structure, feeds, keep_dense=keep_dense, curves=curves,
                     rr_prior=rr_prior, rr_gamma=rr_gamma, rr_cap=rr_cap,
                     force_projection=force_projection, alpha_cap=alpha_cap,
                     recalibrate=recalibrate, providers=providers)
    _, dense_eval = pruner.measure(m, evaluation)
    say(progress, f"Sweep: {len(grid)} sparsities x {len(rules)} allocations x "
                   f"{len(methods)} repairs on {pruner.n_images} calibration images")
    cells = run_sweep(pruner, grid, rules, methods, eval_source=evaluation,
                      on_cell=cell_printer(progress), executor=ex)
    ran_on = ex.describe() if ex is not None else {"kind": "in-process"}
    section = summarize_sweep(cells, grid, rules, methods, dense_eval=dense_eval,
                              all_bn=every_layer_has_bn(structure, layers))
    section["n_images"] = pruner.n_images
    section["rr_curves"] = None if curves is None else curves.to_dict()
    params = dict(sparsity=list(grid), allocations=rules, repairs=methods, data=data,
                  labels=labels, eval_data=eval_data, eval_labels=eval_labels,
                  keep_dense=list(keep_dense), rr_images=rr_images,
                  rr_positions=parse_positions_arg(rr_positions), rr_prior=rr_prior,
                  rr_gamma=rr_gamma, rr_cap=rr_cap, force_projection=force_projection,
                  alpha_cap=alpha_cap, recalibrate=recalibrate, limit=limit, seed=seed,
                  batch_size=batch_size, providers=providers, head=head, features=features,
                  executor=None if executor is None else str(executor), jobs=jobs,
                  defaults=DEFAULTS)
    meta = build_metadata(command="sweep", parameters=params, model_path=model,
                          model_hash=model_hash(m),
                          data={"calibration": calib.describe(),
                                "eval": evaluation.describe() if evaluation else None})
    meta["executor"] = ran_on
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "sweep": section}
    text = render_header(meta) + render_sweep(section)
    return finish_files("sweep", report, text, folder, overwrite,
                         {"sweep.csv": cells_csv(section["cells"])}, "sweep.csv")


def summarize_sweep(cells, grid, rules, methods, *, dense_eval=None, all_bn=False) -> dict:
    """Cells, label-free bands per allocation, and where each allocation wins (per repair,
    on accuracy with labels, else on agreement); RR minus its prior and LAMP per S."""
    from ..sparsity.sweep import ranges, transition_summary, winners

    metric = "accuracy" if dense_eval is not None else "agreement"
    wins = {}
    for method in methods:
        top = winners(cells, method, metric)
        wins[method] = {"by_sparsity": {str(S): v for S, v in top.items()},
                        "ranges": {r: ranges([S for S, v in top.items() if r in v], list(grid))
                                   for r in rules}}
    versus = {}
    for other in ("erk", "lamp"):
        if "rr" in rules and other in rules:
            versus[f"rr-{other}"] = {m: _differences(cells, "rr", other, m, metric, grid)
                                     for m in methods}
    return {"metric": metric, "grid": list(grid), "allocations": list(rules),
            "repairs": list(methods), "dense": dense_eval,
            "cells": [c.to_dict() for c in cells],
            "transitions": {r: transition_summary(cells, r, methods) for r in rules},
            "wins": wins, "rr_versus": versus, "all_convs_feed_bn": all_bn}


def _differences(cells, a, b, method, metric, grid) -> dict:
    val = {(c.allocation, c.sparsity): getattr(c, metric) for c in cells
           if c.repair == method}
    diff = {S: val[(a, S)] - val[(b, S)] for S in grid
            if val.get((a, S)) is not None and val.get((b, S)) is not None}
    from ..sparsity.sweep import ranges

    better = [S for S, d in diff.items() if d > 0]
    return {"difference": {str(S): d for S, d in diff.items()},
            "better_ranges": ranges(better, list(grid))}


def render_sweep(section: dict) -> str:
    metric, rules = section["metric"], section["allocations"]
    pct = "top-1 %" if metric == "accuracy" else "agreement %"
    cells = {(c["sparsity"], c["allocation"], c["repair"]): c for c in section["cells"]}
    lines = []
    dense = section.get("dense")
    for method in section["repairs"]:
        rows = []
        for S in section["grid"]:
            row = {"S": S}
            for r in rules:
                c = cells.get((S, r, method))
                v = None if c is None or c["error"] else c[metric]
                row[r] = None if v is None else 100 * v
            rows.append(row)
        title = f"== {pct} after repair {method} (rows S, columns allocation) =="
        lines += [render_table(rows, title=title).rstrip(), ""]
    if metric == "accuracy":
        lines.append(f"dense model: top-1 {100 * dense['accuracy']:.2f} % on "
                     f"{dense['n_samples']} eval samples")
        rows = [{"S": S, **{r: _pct100(cells.get((S, r, section["repairs"][0])), "agreement")
                            for r in rules}} for S in section["grid"]]
        lines += [render_table(rows, title=f"== agreement % with the dense model, repair "
                                            f"{section['repairs'][0]} (label-free) ==").rstrip()]
    lines += ["", f"== Label-free transition bands (SPEC C4), {section['n_images']} "
                  "calibration images =="]
    for r in rules:
        tr = section["transitions"][r]
        lines.append(band_text(tr["band"], f"{r:<11} ({tr['repair']})"))
        for extra in cts_text(tr, False):
            lines.append(f"{'':<13}{extra}")
    if section.get("all_convs_feed_bn") and any(
            section["transitions"][r]["cts"] for r in rules):
        lines.append(f"note: {CTS_NOTE}")
    lines += ["", f"== Where each allocation wins (best {metric}, ties included) =="]
    for method, w in section["wins"].items():
        parts = [f"{r} {_fmt_ranges(rg)}" for r, rg in w["ranges"].items() if rg]
        lines.append(f"{method}: " + "; ".join(parts))
    for name, per in section["rr_versus"].items():
        for method, d in per.items():
            diffs = d["difference"]
            if not diffs:
                continue
            best = max(diffs.items(), key=lambda kv: kv[1])
            lines.append(f"{name.replace('-', ' - ')} ({method}): better at "
                         f"{_fmt_ranges(d['better_ranges']) or 'no S'}; largest gain "
                         f"{100 * best[1]:+.2f} pp at S = {float(best[0]):g}")
    errors = sorted({c["error"] for c in section["cells"] if c["error"]})
    lines += [f"skipped cells: {e}" for e in errors[:3]]
    return "\n".join(lines) + "\n"


def _pct100(cell, key):
    return None if cell is None or cell["error"] else 100 * cell[key]


def _fmt_ranges(rg) -> str:
    return ", ".join(f"{a:g}" if a == b else f"{a:g}-{b:g}" for a, b in rg)
