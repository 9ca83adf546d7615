"""The ``sweep`` verb: agreement / accuracy over sparsity × allocation × repair, with the
label-free bands (docs/METHODS.md §C3, §C4)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, render_table
from .base import CommandResult, DataRequest, HeadChoice, ReportTarget, Runtime, render_header
from .pruning import (
    CTS_NOTE,
    PrunerOptions,
    band_text,
    cell_printer,
    cells_csv,
    compute_curves,
    cts_text,
    every_layer_has_bn,
    failed_cells,
    failure_lines,
    finish_files,
    make_pruner,
    needs_rr,
    open_fan_out,
    open_inputs,
    pruning_metadata,
    repair_notes,
    say,
)


@dataclass(frozen=True)
class SweepOptions:
    """Options of ``onnxdiag sweep``.

    ``sparsity``: the grid, e.g. "0.90:0.97:0.005" or "0.5,0.9" (required).
    ``allocations``: comma list or "all" (every rule, rr-greedy / rr-marginal included);
    ``repairs``: comma list. ``seed``: the RR position draw. ``pruner``: the options
    shared with rr and prune.
    """

    sparsity: str | tuple | None = None
    allocations: str | tuple = "all"
    repairs: str | tuple = "cr+bn,bn,none"
    seed: int = 0
    pruner: PrunerOptions = PrunerOptions()

    def choices(self) -> tuple[tuple, list, list]:
        """(grid, allocations, repairs), checked (OnnxDiagError)."""
        from ..sparsity import METHODS, RULES
        from ..sparsity.grid import parse_choices, parse_sparsity_grid

        if self.sparsity is None:
            raise OnnxDiagError("sweep needs a sparsity grid: give --sparsity, e.g. "
                                "0.90:0.97:0.005 or 0.5,0.9,0.95.")
        grid = parse_sparsity_grid(self.sparsity)
        rules = parse_choices(self.allocations, RULES, "allocation")
        methods = parse_choices(self.repairs, METHODS, "repair")
        self.pruner.check()
        return grid, rules, methods


def sweep_report(model, *, data, eval_data=None, options: SweepOptions = SweepOptions(),
                 head: HeadChoice = HeadChoice(),  # noqa: B008 - frozen records
                 runtime: Runtime = Runtime(),  # noqa: B008
                 report: ReportTarget = ReportTarget(),  # noqa: B008
                 ) -> CommandResult:
    """Accuracy / agreement table over sparsity × allocation × repair (``onnxdiag sweep``).

    ``data``: calibration data, ``eval_data``: labelled evaluation data or None (requests
    or paths). RR curves are computed once. ``runtime.executor`` (None: this process;
    ``local`` with ``jobs`` worker processes, ``ray``, ``ray=HOST:PORT`` or an Executor):
    one unit per cell and per RR layer. Writes report.json, report.txt and sweep.csv.
    """
    grid, rules, methods = options.choices()
    folder = report.folder("sweep")
    inputs = open_inputs(model, data, eval_data, head=head,
                         keep_dense=options.pruner.keep_dense)
    with open_fan_out(runtime) as ex:
        curves = None if not needs_rr(rules) else compute_curves(
            inputs, options.pruner, seed=options.seed, providers=runtime.providers,
            progress=runtime.progress, executor=ex, methods=methods)
        pruner = make_pruner(inputs, options.pruner, curves, runtime.providers, seed=options.seed,
                             progress=runtime.progress)
        _, dense_eval = pruner.measure(inputs.model, inputs.evaluation)
        say(runtime.progress, f"Sweep: {len(grid)} sparsities x {len(rules)} allocations x "
                              f"{len(methods)} repairs on {pruner.n_images} calibration images")
        cells = run_cells(pruner, grid, rules, methods, inputs, eval_data, runtime, ex)
        meta = pruning_metadata("sweep", inputs, options, runtime=runtime, head=head,
                                data=data, eval_data=eval_data, executor=ex,
                                sparsity=list(grid), allocations=rules, repairs=methods)
    section = summarize_sweep(cells, grid, rules, methods, dense_eval=dense_eval,
                              all_bn=every_layer_has_bn(inputs.layers))
    section["n_images"] = pruner.n_images
    section["notes"] = repair_notes(inputs, methods)
    section["rr_curves"] = None if curves is None else curves.to_dict()
    doc = {"schema": SCHEMA_VERSION, "metadata": meta, "sweep": section}
    text = render_header(meta) + render_sweep(section)
    return finish_files("sweep", doc, text, folder, report.overwrite,
                        {"sweep.csv": cells_csv(section["cells"])}, "sweep.csv")


def run_cells(pruner, grid, rules, methods, inputs, eval_data, runtime, ex) -> list:
    """The sweep's cells (:func:`~onnxdiag.sparsity.sweep.run_sweep`) with progress lines."""
    from ..sparsity.sweep import run_sweep

    return run_sweep(pruner, grid, rules, methods, eval_source=inputs.evaluation,
                     eval_request=DataRequest.of(eval_data), on_cell=cell_printer(
                         runtime.progress), executor=ex)


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
            "wins": wins, "rr_versus": versus, "all_convs_feed_bn": all_bn,
            "failed": failed_cells([c.to_dict() for c in cells])}


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
    lines += ["", f"== Label-free transition bands (docs/METHODS.md §C4), {section['n_images']} "
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
    lines += failure_lines(section["cells"])
    lines += [f"note: {n}" for n in section.get("notes", [])]
    return "\n".join(lines) + "\n"


def _pct100(cell, key):
    return None if cell is None or cell["error"] else 100 * cell[key]


def _fmt_ranges(rg) -> str:
    return ", ".join(f"{a:g}" if a == b else f"{a:g}-{b:g}" for a, b in rg)
