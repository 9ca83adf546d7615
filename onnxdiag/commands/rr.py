"""The ``rr`` verb: RR(layer, s) curves of every prunable layer and the label-free
transition scan."""

from __future__ import annotations

from pathlib import Path

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, render_table
from .base import CommandResult, check_out, render_header
from .pruning import (
    DEFAULT_BAND,
    DEFAULTS,
    TABLE_SPARSITIES,
    band_text,
    cell_printer,
    cell_value,
    cells_csv,
    compute_curves,
    cts_text,
    curves_csv,
    every_layer_has_bn,
    finish_files,
    make_pruner,
    open_setup,
    parse_positions_arg,
    using,
)


def rr_report(model, *, executor=None, jobs=None, **kwargs) -> CommandResult:
    """RR curves per prunable layer and the predicted transition band (``onnxdiag rr``).

    Parameters as :func:`_rr_report`; ``executor`` (``local``, ``ray``, ``ray=HOST:PORT``
    or an Executor; default this process): one unit per layer for the RR curves and one
    per cell for the label-free scan.
    """
    with using(executor, jobs) as ex:
        return _rr_report(model, ex=ex, **kwargs)


def _rr_report(model, *, ex=None, data, labels=None, grid=None, rr_images=64, rr_positions=16,
              band_sparsity=DEFAULT_BAND,
              allocation="rr", keep_dense=(), rr_prior="erk", rr_gamma=1.0, rr_cap=0.99,
              force_projection=False, alpha_cap=100.0, recalibrate="affected", limit=None,
              seed=0, batch_size=64, providers=None, head=None, features=None, out=None,
              overwrite=False, write=True, progress=True) -> CommandResult:
    """RR curves per prunable layer and the predicted transition band (``onnxdiag rr``).

    ``grid``: RR sparsities (default SPEC C2's 28 points); ``band_sparsity``: global
    sparsities of the label-free scan (None or "none": no scan), each pruned with
    ``allocation`` and repaired with CR+BN and BN-only. ``rr_positions``: conv output
    positions per image sampled (with ``seed``) for the RR moments, or "all" / None (exact).
    Writes report.json, report.txt, rr_curves.csv and (with the scan) transition.csv.
    """
    from ..model.io import model_hash
    from ..sparsity import RULES, find_prunable
    from ..sparsity.sweep import parse_sparsity_grid, run_sweep, transition_summary

    folder = check_out(out, "rr", overwrite, write)
    rr_grid = None if grid is None else parse_sparsity_grid(grid)
    band = None if band_sparsity in (None, "none") else parse_sparsity_grid(band_sparsity)
    if allocation not in RULES:
        raise OnnxDiagError(f"Unknown allocation {allocation!r}; choose from {', '.join(RULES)}.")
    m, structure, _, calib, feeds = open_setup(model, data=data, labels=labels, limit=limit,
                                           seed=seed, batch_size=batch_size, head=head,
                                           features=features)
    layers = find_prunable(structure, keep_dense)
    curves = compute_curves(m, layers, feeds, grid=rr_grid, n_images=rr_images,
                     positions=rr_positions, seed=seed, providers=providers,
                     progress=progress, executor=ex)
    section = {"curves": curves.to_dict(), "layers": _layer_rows(curves, layers),
               "keep_dense": list(keep_dense), "transition": None}
    methods = ["cr+bn", "bn"]
    if band is not None:
        pruner = make_pruner(m, structure, feeds, keep_dense=keep_dense, curves=curves,
                         rr_prior=rr_prior, rr_gamma=rr_gamma, rr_cap=rr_cap,
                         force_projection=force_projection, alpha_cap=alpha_cap,
                         recalibrate=recalibrate, providers=providers)
        cells = run_sweep(pruner, band, [allocation], methods,
                          on_cell=cell_printer(progress), executor=ex)
        section["transition"] = {**transition_summary(cells, allocation, methods),
                                 "n_images": pruner.n_images,
                                 "cells": [c.to_dict() for c in cells],
                                 "all_convs_feed_bn": every_layer_has_bn(structure, layers)}
    params = dict(data=data, labels=labels, grid=list(curves.grid), rr_images=rr_images,
                  rr_positions=parse_positions_arg(rr_positions),
                  band_sparsity=None if band is None else list(band), allocation=allocation,
                  keep_dense=list(keep_dense), rr_prior=rr_prior, rr_gamma=rr_gamma,
                  rr_cap=rr_cap, force_projection=force_projection, alpha_cap=alpha_cap,
                  recalibrate=recalibrate, limit=limit, seed=seed, batch_size=batch_size,
                  providers=providers, head=head, features=features, defaults=DEFAULTS)
    meta = build_metadata(command="rr", parameters=params, model_path=model,
                          model_hash=model_hash(m), data={"calibration": calib.describe()})
    meta["executor"] = ex.describe() if ex is not None else {"kind": "in-process"}
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "repairability": section}
    text = render_header(meta) + render_rr(section)
    files = {"rr_curves.csv": curves_csv(curves)}
    if section["transition"]:
        files["transition.csv"] = cells_csv(section["transition"]["cells"])
    return finish_files("rr", report, text, folder, overwrite, files, "rr_curves.csv")


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
    where = "every position" if pos is None else f"{pos} conv positions per image"
    lines = [f"== Relative repairability (SPEC C2), {len(c['layers'])} layers, "
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
        lines += ["", f"== Label-free transition (SPEC C4), allocation {tr['allocation']}, "
                      f"{tr['n_images']} calibration images ==", render_table(trows).rstrip(),
                  band_text(tr["band"], "predicted transition band")]
        lines += cts_text(tr, tr.get("all_convs_feed_bn", False))
        errors = sorted({c_["error"] for c_ in tr["cells"] if c_["error"]})
        lines += [f"skipped: {e}" for e in errors[:3]]
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
    positions per image for the RR moments (None: every position).
    """
    from ..graph import analyze_structure
    from ..model.io import load_model
    from ..sparsity import find_prunable
    from ..sparsity.sweep import materialize, run_sweep, transition_summary

    m = load_model(model) if isinstance(model, (str, Path)) else model
    structure = structure or analyze_structure(m)
    layers = find_prunable(structure, keep_dense)
    feeds = materialize(source, n_images)
    curves = compute_curves(m, layers, feeds, grid=sorted(set(_rr_grid()) | set(sparsities)),
                     n_images=n_images, positions=positions, providers=providers)
    pruner = make_pruner(m, structure, feeds, keep_dense=keep_dense, curves=curves,
                     rr_prior="erk", rr_gamma=1.0, rr_cap=0.99, force_projection=False,
                     alpha_cap=100.0, recalibrate="affected", providers=providers)
    alloc = pruner.allocate("rr", target)
    rows = [{"layer": name, "weights": curves.n_weights[i],
             **{f"RR {s:g}": curves.rr_at(name, s) for s in sparsities},
             f"ERK s@{target:g}": alloc.prior.sparsity[name],
             f"rr s@{target:g}": alloc.sparsity[name]} for i, name in enumerate(curves.layers)]
    section = {"rows": rows, "target": target, "n_images": pruner.n_images,
               "allocation": alloc.to_dict(), "transition": None}
    lines = [f"== Repairability (SPEC C2-C4), {pruner.n_images} calibration images ==",
             render_table(rows).rstrip(),
             f"suggested allocation at S = {target:g}: rr (RR-modulated ERK), columns above"]
    if transition_grid:
        methods = ["cr+bn", "bn"]
        cells = run_sweep(pruner, list(transition_grid), ["rr"], methods)
        tr = transition_summary(cells, "rr", methods)
        tr["cells"] = [c.to_dict() for c in cells]
        section["transition"] = tr
        lines.append(band_text(tr["band"], "predicted transition band"))
        end = (tr["band"] or {}).get("end")
        if end is not None and end < target:
            lines.append(f"note: S = {target:g} lies beyond the predicted band (agreement with "
                         f"the dense model < 0.5 from S = {end:.3g}): expect a collapse there.")
        lines += cts_text(tr, every_layer_has_bn(structure, layers))
    return section, "\n".join(lines) + "\n"


def _rr_grid():
    from ..sparsity import DEFAULT_GRID

    return DEFAULT_GRID
