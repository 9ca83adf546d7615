"""The ``rr`` verb: RR(layer, s) curves of every prunable layer and the label-free
transition scan (docs/METHODS.md §C2, §C4)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, render_table
from .base import CommandResult, HeadChoice, ReportTarget, Runtime, render_header
from .pruning import (
    DEFAULT_BAND,
    TABLE_SPARSITIES,
    Inputs,
    PrunerOptions,
    band_text,
    cell_printer,
    cell_value,
    cells_csv,
    compute_curves,
    cts_text,
    curves_csv,
    every_layer_has_bn,
    failed_cells,
    failure_lines,
    finish_files,
    make_pruner,
    open_fan_out,
    open_inputs,
    pruning_metadata,
    repair_notes,
)

#: The repairs of the label-free scan: the band's, and CTS's baseline (docs/METHODS.md §C4).
SCAN_REPAIRS = ("cr+bn", "bn")


@dataclass(frozen=True)
class RROptions:
    """Options of ``onnxdiag rr``.

    ``grid``: RR sparsities ("0:0.9:0.05,0.91:0.99:0.01" or a list; None: the 28 points of
    docs/METHODS.md §C2). ``band_sparsity``: global sparsities of the label-free scan (None
    or "none": no scan), each pruned with ``allocation`` and repaired with CR+BN and
    BN-only. ``seed``: the RR position draw. ``pruner``: the options shared with prune and
    sweep.
    """

    grid: str | tuple | None = None
    band_sparsity: str | tuple | None = DEFAULT_BAND
    allocation: str = "rr"
    seed: int = 0
    pruner: PrunerOptions = PrunerOptions()

    def grids(self) -> tuple:
        """(RR grid or None, scan grid or None), checked (OnnxDiagError)."""
        from ..sparsity import RULES
        from ..sparsity.grid import parse_sparsity_grid

        if self.allocation not in RULES:
            raise OnnxDiagError(f"Unknown allocation {self.allocation!r}; choose from "
                                f"{', '.join(RULES)}.")
        self.pruner.check()
        rr_grid = None if self.grid is None else parse_sparsity_grid(self.grid)
        none = self.band_sparsity is None or str(self.band_sparsity).strip() == "none"
        return rr_grid, None if none else parse_sparsity_grid(self.band_sparsity)


def rr_report(model, *, data, options: RROptions = RROptions(),
              head: HeadChoice = HeadChoice(),  # noqa: B008 - frozen records
              runtime: Runtime = Runtime(),  # noqa: B008
              report: ReportTarget = ReportTarget(),  # noqa: B008
              ) -> CommandResult:
    """RR curves per prunable layer and the predicted transition band (``onnxdiag rr``).

    ``data``: calibration data (a :class:`~onnxdiag.commands.base.DataRequest` or a path).
    ``runtime.executor`` (``local``, ``ray``, ``ray=HOST:PORT`` or an Executor; default
    this process): one unit per layer for the RR curves and one per cell for the scan.
    Writes report.json, report.txt, rr_curves.csv and (with the scan) transition.csv.
    """
    rr_grid, band = options.grids()
    folder = report.folder("rr")
    inputs = open_inputs(model, data, head=head, keep_dense=options.pruner.keep_dense)
    with open_fan_out(runtime) as ex:
        curves = compute_curves(inputs, options.pruner, seed=options.seed, grid=rr_grid,
                                providers=runtime.providers, progress=runtime.progress,
                                executor=ex, methods=SCAN_REPAIRS if band is not None else ())
        section = {"curves": curves.to_dict(), "layers": _layer_rows(curves, inputs.layers),
                   "keep_dense": list(options.pruner.keep_dense), "transition": None}
        if band is not None:
            section["transition"] = _scan(inputs, options, curves, band, runtime, ex)
        meta = pruning_metadata("rr", inputs, options, runtime=runtime, head=head, data=data,
                                executor=ex, grid=list(curves.grid),
                                band_sparsity=None if band is None else list(band))
    doc = {"schema": SCHEMA_VERSION, "metadata": meta, "repairability": section}
    text = render_header(meta) + render_rr(section)
    files = {"rr_curves.csv": curves_csv(curves)}
    if section["transition"]:
        files["transition.csv"] = cells_csv(section["transition"]["cells"])
    return finish_files("rr", doc, text, folder, report.overwrite, files, "rr_curves.csv")


def _scan(inputs: Inputs, options: RROptions, curves, band, runtime, ex) -> dict:
    """The label-free transition scan: ``band`` × ``allocation`` × CR+BN / BN-only."""
    from ..sparsity.sweep import run_sweep, transition_summary

    pruner = make_pruner(inputs, options.pruner, curves, runtime.providers,
                         progress=runtime.progress)
    cells = run_sweep(pruner, band, [options.allocation], list(SCAN_REPAIRS),
                      on_cell=cell_printer(runtime.progress), executor=ex)
    rows = [c.to_dict() for c in cells]
    return {**transition_summary(cells, options.allocation, list(SCAN_REPAIRS)),
            "n_images": pruner.n_images, "cells": rows, "failed": failed_cells(rows),
            "all_convs_feed_bn": every_layer_has_bn(inputs.layers),
            "notes": repair_notes(inputs, SCAN_REPAIRS)}


def _layer_rows(curves, layers) -> list[dict]:
    by_name = {la.node_name: la for la in layers}
    rows = []
    for i, name in enumerate(curves.layers):
        la = by_name[name]
        row = {"layer": name, "op": la.op_type, "n_weights": curves.n_weights[i],
               "bn": bool(la.bn_node)}
        for s in TABLE_SPARSITIES:
            row[f"rr@{s:g}"] = curves.rr_at(name, s)
        row["d_raw@0.9"] = curves.d_raw_at(name, 0.9)
        row["d_repair@0.9"] = curves.d_repair_at(name, 0.9)
        rows.append(row)
    return rows


def render_rr(section: dict) -> str:
    c = section["curves"]
    rows = [{"layer": r["layer"], "weights": r["n_weights"],
             **{f"RR {s:g}": r[f"rr@{s:g}"] for s in TABLE_SPARSITIES},
             "D_raw 0.9": r["d_raw@0.9"], "D_rep 0.9": r["d_repair@0.9"]}
            for r in section["layers"]]
    pos = c.get("positions")
    where = ("every position" if pos is None else
             f"{pos} positions per input (conv output positions, linear-layer tokens)")
    lines = [f"== Relative repairability (docs/METHODS.md §C2), {len(c['layers'])} layers, "
             f"{len(c['grid'])} sparsities, {c['n_images']} calibration images, {where} ==",
             render_table(rows).rstrip(),
             "RR = D_repair / D_raw: low = the damage is mostly a per-channel scale/shift that "
             "CR+BN removes. Whole curves: rr_curves.csv."]
    tr = section.get("transition")
    if tr:
        cells = {(c_["sparsity"], c_["repair"]): c_ for c_ in tr["cells"]}
        cts_vals = dict(zip(*(tr["cts"]["sparsity"], tr["cts"]["values"]))) if tr["cts"] else {}
        trows = [{"S": S, "Agr CR+BN": cell_value(cells, S, "cr+bn", "agreement"),
                  "Agr BN": cell_value(cells, S, "bn", "agreement"), "CTS": cts_vals.get(S)}
                 for S in sorted({k[0] for k in cells})]
        lines += ["", f"== Label-free transition (docs/METHODS.md §C4), allocation "
                      f"{tr['allocation']}, {tr['n_images']} calibration images ==",
                  render_table(trows).rstrip(),
                  band_text(tr["band"], "predicted transition band")]
        lines += cts_text(tr, tr.get("all_convs_feed_bn", False))
        lines += failure_lines(tr["cells"])
        lines += [f"note: {n}" for n in tr.get("notes", [])]
    return "\n".join(lines) + "\n"


def repairability_section(model, source, *, structure=None, sparsities=(0.5, 0.9, 0.95),
                          target=0.9, n_images=64, keep_dense=(),
                          transition_grid=(0.5, 0.7, 0.8, 0.9, 0.95), providers=None,
                          positions=16) -> tuple[dict, str]:
    """The repairability section of ``onnxdiag analyze``: (JSON-ready dict, text).

    Per prunable layer RR at ``sparsities``; the ``rr`` allocation at ``target`` next to
    its ERK prior (the suggested allocation); with ``transition_grid`` (None: skip) the
    label-free agreement band and CTS from ``rr`` + CR+BN / BN-only on the first
    ``n_images`` calibration samples.  ``model``: a path or ModelProto (never modified);
    ``source``: a DataSource or an iterable of feed dicts; ``positions``: conv output
    positions per image, or linear-layer tokens per input, for the RR moments (None: every
    position). Convs, hidden linear layers and the head alike (docs/METHODS.md §D).
    """
    from ..graph import analyze_structure
    from ..model.io import load_model
    from ..sparsity import DEFAULT_GRID, find_prunable
    from ..sparsity.sweep import materialize

    m = load_model(model) if isinstance(model, (str, Path)) else model
    structure = structure or analyze_structure(m)
    layers = find_prunable(structure, keep_dense)
    inputs = Inputs(model, m, structure, None, source, materialize(source, n_images), None,
                    layers)
    options = PrunerOptions(keep_dense=tuple(keep_dense), rr_images=n_images,
                            rr_positions=positions)
    curves = compute_curves(inputs, options, grid=sorted(set(DEFAULT_GRID) | set(sparsities)),
                            providers=providers)
    pruner = make_pruner(inputs, options, curves, providers)
    alloc = pruner.allocate("rr", target)
    rows = [{"layer": name, "weights": curves.n_weights[i],
             **{f"RR {s:g}": curves.rr_at(name, s) for s in sparsities},
             f"ERK s@{target:g}": alloc.prior.sparsity[name],
             f"rr s@{target:g}": alloc.sparsity[name]} for i, name in enumerate(curves.layers)]
    section = {"rows": rows, "target": target, "n_images": pruner.n_images,
               "allocation": alloc.to_dict(), "transition": None}
    lines = [f"== Repairability (docs/METHODS.md §C2-§C4), {pruner.n_images} calibration "
             "images ==", render_table(rows).rstrip(),
             f"suggested allocation at S = {target:g}: rr (RR-modulated ERK), columns above"]
    if transition_grid:
        section["transition"], more = _analyze_scan(pruner, transition_grid, target, layers)
        section["notes"] = repair_notes(inputs, SCAN_REPAIRS)
        lines += more + [f"note: {n}" for n in section["notes"]]
    return section, "\n".join(lines) + "\n"


def _analyze_scan(pruner, grid, target, layers) -> tuple[dict, list[str]]:
    """analyze's label-free scan of ``rr`` + CR+BN / BN-only: (section, text lines)."""
    from ..sparsity.sweep import run_sweep, transition_summary

    cells = run_sweep(pruner, list(grid), ["rr"], list(SCAN_REPAIRS))
    tr = transition_summary(cells, "rr", list(SCAN_REPAIRS))
    tr["cells"] = [c.to_dict() for c in cells]
    lines = [band_text(tr["band"], "predicted transition band")]
    end = (tr["band"] or {}).get("end")
    if end is not None and end < target:
        lines.append(f"note: S = {target:g} lies beyond the predicted band (agreement with "
                     f"the dense model < 0.5 from S = {end:.3g}): expect a collapse there.")
    return tr, lines + cts_text(tr, every_layer_has_bn(layers))
