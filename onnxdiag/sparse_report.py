"""The unstructured-pruning verbs (SPEC Part C): ``rr``, ``prune`` and ``sweep``.

- :func:`rr_report`: RR(ℓ, s) curves of every prunable layer (one capture pass, SPEC C2)
  and the label-free transition scan (agreement band and CTS, SPEC C4).
- :func:`prune_report_sparse`: one global sparsity, one allocation (SPEC C3), one repair
  (SPEC C1); emits the pruned model with its sidecar JSON (SPEC C5).
- :func:`sweep_report`: a grid of sparsities × allocations × repairs; agreement with the
  dense model on calibration data and, with ``eval_data``, accuracy; bands and winners.
- :func:`repairability_section`: the short RR summary ``onnxdiag analyze`` shows.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .analysis import CommandResult, _check_out, _finish, _header, _open
from .errors import OnnxDiagError, OutputError
from .report import SCHEMA_VERSION, build_metadata, render_table, to_json

#: SPEC C4 scan of the ``rr`` verb: coarse below 0.9, fine above (17 points).
DEFAULT_BAND = "0.1:0.9:0.1,0.91:0.99:0.01"
#: Sparsities shown as columns of the RR text table (the JSON / CSV hold the whole grid).
TABLE_SPARSITIES = (0.5, 0.8, 0.9, 0.95, 0.99)
#: Echoed into every report (SPEC: "our default" choices are parameters).
DEFAULTS = dict(rr_images=64, rr_positions=16, rr_eps=1e-12, alpha_cap=100.0, rr_prior="erk",
                rr_gamma=1.0, rr_cap=0.99, recalibrate="affected", band_hi=0.9, band_lo=0.5,
                band_repair="cr+bn", cts_baseline="bn")
CTS_NOTE = ("CTS compares CR+BN with BN-only; every pruned conv here feeds a BatchNormalization, "
            "where SPEC C4 measured CTS as noise (CR+BN ~ BN-only): read the agreement band.")
LATENCY_NOTE = ("unstructured zeros do not speed up ONNX Runtime (dense kernels); removing "
                "channels (onnxdiag prune-channels) does.")


# --------------------------------------------------------------------------- shared steps

def _setup(model, *, data, labels, limit, seed, batch_size, head, features):
    """(model, structure, specs, calibration DataSource, its feeds in memory)."""
    from .graph import analyze_structure
    from .model_io import get_input_specs, load_model
    from .sparsity.sweep import materialize

    if data is None:
        raise OnnxDiagError("Pruning needs unlabelled calibration images for the repair and "
                            "the agreement with the dense model; pass --data FILE.")
    m = load_model(model)
    structure = analyze_structure(m, head=head, features=features)
    specs = get_input_specs(m)
    calib = _open(data, specs, labels=labels, limit=limit, seed=seed, batch_size=batch_size)
    return m, structure, specs, calib, materialize(calib)


def _pruning_setup(model, *, eval_data, eval_labels, keep_dense, **setup):
    """:func:`_setup` plus the evaluation source (None without ``eval_data``) and the
    prunable layers: (model, structure, specs, calibration, its feeds, evaluation,
    layers)."""
    from .sparsity import find_prunable

    m, structure, specs, calib, feeds = _setup(model, **setup)
    evaluation = None if eval_data is None else _open(
        eval_data, specs, labels=eval_labels, seed=setup["seed"],
        batch_size=setup["batch_size"])
    return m, structure, specs, calib, feeds, evaluation, find_prunable(structure, keep_dense)


def _curves(m, layers, feeds, *, grid=None, n_images=64, positions=16, seed=0,
            providers=None, progress=False, executor=None):
    """RR curves on the first ``n_images`` calibration images, each conv's moments over
    ``positions`` seeded output positions per image (None / "all": every position)."""
    from .sparsity import DEFAULT_GRID, compute_rr_curves
    from .sparsity.repairability import parse_positions

    grid = DEFAULT_GRID if grid is None else grid
    positions = parse_positions(positions)
    where = "every position" if positions is None else f"{positions} positions per image"
    _say(progress, f"RR curves: {len(layers)} layers x {len(grid)} sparsities on "
                   f"{n_images} calibration images, {where} (one capture pass)")
    return compute_rr_curves(m, layers, feeds, grid=grid, n_images=n_images,
                             positions=positions, seed=seed, providers=providers,
                             executor=executor)


def _pruner(m, structure, feeds, *, keep_dense, curves, rr_prior, rr_gamma, rr_cap,
            force_projection, alpha_cap, recalibrate, providers):
    from .sparsity.sweep import Pruner

    options = dict(prior=rr_prior, gamma=rr_gamma, cap=rr_cap, force_projection=force_projection)
    return Pruner(m, structure, feeds, keep_dense=tuple(keep_dense), rr_curves=curves,
                  options=options, alpha_cap=alpha_cap, recalibrate=recalibrate,
                  providers=providers)


def _say(enabled: bool, line: str) -> None:
    if enabled:
        print(line, file=sys.stderr, flush=True)


def _cell_printer(enabled: bool):
    """on_cell callback: one progress line per sweep cell on stderr."""
    if not enabled:
        return None

    def show(cell, i, total):
        if cell.error:
            what = f"skipped ({cell.error})"
        else:
            what = f"agreement {cell.agreement:.3f}"
            if cell.accuracy is not None:
                what += f", top-1 {100 * cell.accuracy:.2f} %"
            what += f" ({cell.seconds:.1f} s)"
        _say(True, f"[{i}/{total}] S={cell.sparsity:g} {cell.allocation} {cell.repair}: {what}")
    return show


def _positions(positions):
    """``rr_positions`` as echoed in the parameters: an int, or "all"."""
    from .sparsity.repairability import parse_positions

    value = parse_positions(positions)
    return "all" if value is None else value


def _needs_rr(rules) -> bool:
    return any(r.startswith("rr") for r in rules)


def _all_bn(structure, layers) -> bool:
    convs = [la for la in layers if la.op_type == "Conv"]
    return bool(convs) and all(la.bn_node for la in convs)


def _band_text(band: dict | None, what: str) -> str:
    if not band or band.get("start") is None:
        hi = band.get("hi") if band else None
        return f"{what}: not reached on this grid (agreement stays >= {hi})"
    start = (f"<= {band['start']:.4g} (already below {band['hi']} at the first point)"
             if band.get("censored_start") else f"{band['start']:.4g}")
    if band["end"] is None:
        return (f"{what}: agreement below {band['hi']} from S = {start}; it stays above "
                f"{band['lo']} up to the grid end")
    return (f"{what}: S from {start} to {band['end']:.4g} (agreement falls from "
            f"{band['hi']} to {band['lo']})")


def _cts_text(tr: dict, all_bn: bool) -> list[str]:
    if tr.get("cts_band") is None:
        return []
    b = tr["cts_band"]
    vals = tr["cts"]["values"]
    line = (f"CTS band (CTS >= 1/2 max, max {max(vals):.3f}): "
            + (f"S {b['start']:.4g} to {b['end']:.4g}" if b["start"] is not None
               else "none (max CTS <= 0)"))
    return [line] + ([f"note: {CTS_NOTE}"] if all_bn else [])


# --------------------------------------------------------------------------- rr

@contextmanager
def _using(executor, jobs):
    """The executor for ``executor`` (None: this process), closed afterwards if made here."""
    from .executor import open_executor

    ex, own = (None, False) if executor is None else open_executor(executor, jobs)
    try:
        yield ex
    finally:
        if own:
            ex.close()


def rr_report(model, *, executor=None, jobs=None, **kwargs) -> CommandResult:
    """RR curves per prunable layer and the predicted transition band (``onnxdiag rr``).

    Parameters as :func:`_rr_report`; ``executor`` (``local``, ``ray``, ``ray=HOST:PORT``
    or an Executor; default this process): one unit per layer for the RR curves and one
    per cell for the label-free scan.
    """
    with _using(executor, jobs) as ex:
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
    from .model_io import model_hash
    from .sparsity import RULES, find_prunable
    from .sparsity.sweep import parse_sparsity_grid, run_sweep, transition_summary

    folder = _check_out(out, "rr", overwrite, write)
    rr_grid = None if grid is None else parse_sparsity_grid(grid)
    band = None if band_sparsity in (None, "none") else parse_sparsity_grid(band_sparsity)
    if allocation not in RULES:
        raise OnnxDiagError(f"Unknown allocation {allocation!r}; choose from {', '.join(RULES)}.")
    m, structure, _, calib, feeds = _setup(model, data=data, labels=labels, limit=limit,
                                           seed=seed, batch_size=batch_size, head=head,
                                           features=features)
    layers = find_prunable(structure, keep_dense)
    curves = _curves(m, layers, feeds, grid=rr_grid, n_images=rr_images,
                     positions=rr_positions, seed=seed, providers=providers,
                     progress=progress, executor=ex)
    section = {"curves": curves.to_dict(), "layers": _layer_rows(curves, layers),
               "keep_dense": list(keep_dense), "transition": None}
    methods = ["cr+bn", "bn"]
    if band is not None:
        pruner = _pruner(m, structure, feeds, keep_dense=keep_dense, curves=curves,
                         rr_prior=rr_prior, rr_gamma=rr_gamma, rr_cap=rr_cap,
                         force_projection=force_projection, alpha_cap=alpha_cap,
                         recalibrate=recalibrate, providers=providers)
        cells = run_sweep(pruner, band, [allocation], methods,
                          on_cell=_cell_printer(progress), executor=ex)
        section["transition"] = {**transition_summary(cells, allocation, methods),
                                 "n_images": pruner.n_images,
                                 "cells": [c.to_dict() for c in cells],
                                 "all_convs_feed_bn": _all_bn(structure, layers)}
    params = dict(data=data, labels=labels, grid=list(curves.grid), rr_images=rr_images,
                  rr_positions=_positions(rr_positions),
                  band_sparsity=None if band is None else list(band), allocation=allocation,
                  keep_dense=list(keep_dense), rr_prior=rr_prior, rr_gamma=rr_gamma,
                  rr_cap=rr_cap, force_projection=force_projection, alpha_cap=alpha_cap,
                  recalibrate=recalibrate, limit=limit, seed=seed, batch_size=batch_size,
                  providers=providers, head=head, features=features, defaults=DEFAULTS)
    meta = build_metadata(command="rr", parameters=params, model_path=model,
                          model_hash=model_hash(m), data={"calibration": calib.describe()})
    meta["executor"] = ex.describe() if ex is not None else {"kind": "in-process"}
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "repairability": section}
    text = _header(meta) + render_rr(section)
    files = {"rr_curves.csv": _curves_csv(curves)}
    if section["transition"]:
        files["transition.csv"] = _cells_csv(section["transition"]["cells"])
    return _finish_files("rr", report, text, folder, overwrite, files, "rr_curves.csv")


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
        trows = [{"S": S, "Agr CR+BN": _get(cells, S, "cr+bn", "agreement"),
                  "Agr BN": _get(cells, S, "bn", "agreement"), "CTS": cts_vals.get(S)}
                 for S in sorted({k[0] for k in cells})]
        lines += ["", f"== Label-free transition (SPEC C4), allocation {tr['allocation']}, "
                      f"{tr['n_images']} calibration images ==", render_table(trows).rstrip(),
                  _band_text(tr["band"], "predicted transition band")]
        lines += _cts_text(tr, tr.get("all_convs_feed_bn", False))
        errors = sorted({c_["error"] for c_ in tr["cells"] if c_["error"]})
        lines += [f"skipped: {e}" for e in errors[:3]]
    return "\n".join(lines) + "\n"


def _get(cells, S, repair, key):
    c = cells.get((S, repair))
    return None if c is None else c.get(key)


def _curves_csv(curves) -> str:
    from .report.text import rows_to_csv

    return rows_to_csv([{"layer": name, "sparsity": float(s), "d_raw": float(curves.d_raw[i, j]),
                         "d_repair": float(curves.d_repair[i, j]), "rr": float(curves.rr[i, j])}
                        for i, name in enumerate(curves.layers)
                        for j, s in enumerate(curves.grid)])


def _cells_csv(cells) -> str:
    from .report.text import rows_to_csv

    keys = ("sparsity", "allocation", "repair", "agreement", "accuracy", "loss", "seconds",
            "error")
    return rows_to_csv([{k: c[k] for k in keys} for c in cells])


def _finish_files(command, report, text, folder, overwrite, files, main) -> CommandResult:
    """Write report.json, report.txt and ``files`` ({name: CSV}); ``main`` names the table
    ``--format csv`` prints."""
    result = _finish(command, report, text, text, None, overwrite, csv=files[main])
    if folder is not None:
        from .report import write_report

        write_report(folder, {"report.json": to_json(report), "report.txt": text, **files},
                     overwrite=overwrite)
        result.folder = folder
    return result


# --------------------------------------------------------------------------- prune

def _check_model_output(output, protect, overwrite: bool) -> Path:
    """Fail before any work: -o is an input, a folder, or exists without ``overwrite``."""
    from .model_io import check_output_path

    out = check_output_path(output, protect=protect)
    for p in (out, out.with_name(out.name + ".json")):
        if p.exists() and not overwrite:
            raise OutputError(f"Output '{p}' already exists; choose another -o or pass "
                              "--overwrite.")
    return out


def prune_report_sparse(model, *, output, sparsity, allocation="rr", repair="cr+bn", data,
                        labels=None, eval_data=None, eval_labels=None, keep_dense=(),
                        rr_images=64, rr_positions=16, rr_prior="erk", rr_gamma=1.0, rr_cap=0.99,
                        force_projection=False, alpha_cap=100.0, recalibrate="affected",
                        sparse_initializers=False, limit=None, seed=0, batch_size=64,
                        providers=None, head=None, features=None, out=None, overwrite=False,
                        write=True, progress=True) -> CommandResult:
    """Prune to a global sparsity, repair, emit the model (``onnxdiag prune``, SPEC C5).

    The emitted file passes the full ONNX checker (the dense-stored form), is reloaded
    from its bytes in ONNX Runtime and compared with the in-memory model, and gets a
    sidecar ``<output>.json``: per-layer sparsity, allocation, repair parameters, the
    dense model's hash, agreement with the dense model, accuracies, sizes, latency.
    ``sparse_initializers``: store pruned weights as ``sparse_initializer`` when smaller.
    """
    from .emit import finalize_model
    from .model_io import model_hash
    from .sparsity import METHODS, RULES
    from .sparsity.budget import exact_fraction

    if allocation not in RULES:
        raise OnnxDiagError(f"Unknown allocation {allocation!r}; choose from {', '.join(RULES)}.")
    if repair not in METHODS:
        raise OnnxDiagError(f"Unknown repair {repair!r}; choose from {', '.join(METHODS)}.")
    exact_fraction(sparsity)
    protect = [model, data, eval_data, labels, eval_labels]
    folder = _check_out(out, "prune", overwrite, write)
    _check_model_output(output, protect, overwrite)
    m, structure, specs, calib, feeds, evaluation, layers = _pruning_setup(
        model, data=data, labels=labels, limit=limit, seed=seed, batch_size=batch_size,
        head=head, features=features, eval_data=eval_data, eval_labels=eval_labels,
        keep_dense=keep_dense)
    curves = None if not allocation.startswith("rr") else _curves(
        m, layers, feeds, n_images=rr_images, positions=rr_positions, seed=seed,
        providers=providers, progress=progress)
    pruner = _pruner(m, structure, feeds, keep_dense=keep_dense, curves=curves,
                     rr_prior=rr_prior, rr_gamma=rr_gamma, rr_cap=rr_cap,
                     force_projection=force_projection, alpha_cap=alpha_cap,
                     recalibrate=recalibrate, providers=providers)
    alloc = pruner.allocate(allocation, sparsity)
    _say(progress, f"Pruning {alloc.n_pruned} of {alloc.n_weights} weights ({allocation}), "
                   f"repair {repair} on {pruner.n_images} calibration images")
    pruned, record = pruner.prune(alloc, repair)
    pruned = finalize_model(pruned)
    info = _emit_pruned(m, pruned, pruner, alloc, record, output=output, model=model,
                        evaluation=evaluation, feeds=feeds, calib=calib,
                        specs=specs, sparse=sparse_initializers, protect=protect,
                        dense_hash=model_hash(m))
    params = dict(output=str(output), sparsity=sparsity, allocation=allocation, repair=repair,
                  data=data, labels=labels, eval_data=eval_data, eval_labels=eval_labels,
                  keep_dense=list(keep_dense), rr_images=rr_images,
                  rr_positions=_positions(rr_positions), rr_prior=rr_prior,
                  rr_gamma=rr_gamma, rr_cap=rr_cap, force_projection=force_projection,
                  alpha_cap=alpha_cap, recalibrate=recalibrate,
                  sparse_initializers=sparse_initializers, limit=limit, seed=seed,
                  batch_size=batch_size, providers=providers, head=head, features=features,
                  defaults=DEFAULTS)
    meta = build_metadata(command="prune", parameters=params, model_path=model,
                          model_hash=info["dense_model_sha256"],
                          data={"calibration": calib.describe(),
                                "eval": evaluation.describe() if evaluation else None})
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "prune": info}
    text = _header(meta) + render_prune_sparse(info)
    from .report.text import rows_to_csv

    alloc_d = info["allocation"]
    table = rows_to_csv([{"layer": k, "n_weights": alloc_d["n_params"][k],
                          "n_kept": alloc_d["n_kept"][k], "sparsity": info["layer_sparsity"][k]}
                         for k in alloc_d["layers"]])
    return _finish("prune", report, text, text, folder, overwrite, csv=table,
                   csv_name="layers.csv")


def _emit_pruned(m, pruned, pruner, alloc, record, *, output, model, evaluation, feeds, calib,
                 specs, sparse, protect, dense_hash) -> dict:
    """Checks, comparison, storage choice, latency; writes the model and its sidecar."""
    from . import __version__
    from .emit import compare_models, emit_model, measure_latency
    from .probe import make_head_runner
    from .prune_report import _example_input

    head = pruner.head
    agreement, ev_pruned = pruner.measure(pruned, evaluation)
    _, ev_dense = pruner.measure(m, evaluation) if evaluation is not None else (None, None)
    comparison = compare_models(make_head_runner(m, head), make_head_runner(pruned, head),
                                calib, head)
    checks = {"full_checker": "passed", "reload": _reload_check(pruned, feeds[0])}
    final, storage = pruned, {"format": "dense", "sparse_initializers": []}
    if sparse:
        final, storage = _sparse_storage(pruned, pruner, feeds[0])
    x = _example_input(specs, calib)
    latency = {"dense_ms": measure_latency(m, {1: x[:1], 32: x}),
               "pruned_ms": measure_latency(final, {1: x[:1], 32: x})}
    sidecar = {
        "tool": "onnxdiag prune", "tool_version": __version__,
        "dense_model_path": str(model), "dense_model_sha256": dense_hash,
        "sparsity_target": alloc.target, "sparsity_achieved": alloc.n_pruned / alloc.n_weights,
        "n_weights": alloc.n_weights, "n_pruned": alloc.n_pruned,
        "layer_sparsity": dict(alloc.sparsity), "keep_dense": list(pruner.keep_dense),
        "allocation": alloc.to_dict(), "repair": record.to_dict(arrays=True),
        "agreement_with_dense": {"top1_agreement": agreement, "n_images": pruner.n_images,
                                 "data": "calibration"},
        "comparison_with_dense": comparison, "accuracy_dense": ev_dense,
        "accuracy_pruned": ev_pruned, "checks": checks, "storage": storage,
        "sizes": {"dense_bytes": m.ByteSize(), "pruned_dense_storage_bytes": pruned.ByteSize(),
                  "emitted_bytes": final.ByteSize()},
        "latency_cpu": latency, "notes": [LATENCY_NOTE]}
    return emit_model(final, output, source_path=model, sidecar=sidecar, protect=protect)


def _reload_check(model, feeds: dict) -> dict:
    """Serialize, parse back, full checker, ORT session; outputs equal the in-memory model's."""
    import onnx

    from .runner import OrtRunner

    again = onnx.load_from_string(model.SerializeToString())
    onnx.checker.check_model(again, full_check=True)
    a = OrtRunner(model, providers="cpu").run(feeds)
    b = OrtRunner(again, providers="cpu").run(feeds)
    return {"onnxruntime_load": "passed",
            "max_abs_output_diff": max(float(np.max(np.abs(a[k] - b[k]))) for k in a)}


def _sparse_storage(pruned, pruner, feeds) -> tuple:
    from .emit import check_sparse_copy, store_sparse
    from .graph import GraphIndex

    index = GraphIndex(pruned)
    names = [index.get_node(la.node_name).input[1] for la in pruner.layers]
    sparse, converted = store_sparse(pruned, names)
    info = {"format": "dense", "sparse_initializers": converted,
            "sparse_bytes": sparse.ByteSize(), "dense_bytes": pruned.ByteSize()}
    if not converted or sparse.ByteSize() >= pruned.ByteSize():
        info["note"] = "sparse_initializer storage would not be smaller; kept dense storage"
        return pruned, info
    info.update(format="sparse_initializer", check=check_sparse_copy(sparse, pruned, feeds),
                note="full checker run on the dense-stored form: ONNX shape inference does not "
                     "type a sparse_initializer read by Conv; this file passed the structural "
                     "checker, loads in ONNX Runtime and equals the dense form")
    return sparse, info


def render_prune_sparse(info: dict) -> str:
    alloc = info["allocation"]
    rows = [{"layer": name, "weights": alloc["n_params"][name], "kept": alloc["n_kept"][name],
             "sparsity": info["layer_sparsity"][name]} for name in alloc["layers"]]
    lat, sizes = info["latency_cpu"], info["sizes"]
    cmp_ = info["agreement_with_dense"]
    lines = [f"== Unstructured pruning (SPEC C): {alloc['rule']} at S = {alloc['target']}, "
             f"repair {info['repair']['method']} ==", render_table(rows).rstrip(),
             f"pruned {info['n_pruned']} of {info['n_weights']} prunable weights "
             f"({100 * info['sparsity_achieved']:.3f} %) -> {info['emitted']['path']} "
             f"(+ sidecar .json)",
             f"top-1 agreement with the dense model: {100 * cmp_['top1_agreement']:.2f} % on "
             f"{cmp_['n_images']} calibration images; max |logit diff| "
             f"{info['comparison_with_dense']['max_abs_logit_diff']:.4g}"]
    if info.get("accuracy_pruned"):
        lines.append(f"top-1 on eval data: dense {100 * info['accuracy_dense']['accuracy']:.2f} "
                     f"%, pruned {100 * info['accuracy_pruned']['accuracy']:.2f} %")
    st = info["storage"]
    lines += [f"checks: full ONNX checker {info['checks']['full_checker']}, reload in ONNX "
              f"Runtime {info['checks']['reload']['onnxruntime_load']}",
              f"size: dense {sizes['dense_bytes']:,} B, emitted {info['emitted']['file_bytes']:,}"
              f" B on disk ({st['format']} storage"
              + (f", {len(st['sparse_initializers'])} sparse initializers" if
                 st["format"] != "dense" else "") + ")",
              f"CPU latency ms: dense b=1 {lat['dense_ms']['1']:.3f}, b=32 "
              f"{lat['dense_ms']['32']:.3f}; pruned b=1 {lat['pruned_ms']['1']:.3f}, b=32 "
              f"{lat['pruned_ms']['32']:.3f}", f"note: {LATENCY_NOTE}"]
    if st.get("note"):
        lines.append(f"note: {st['note']}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- sweep

def sweep_report(model, *, executor=None, jobs=None, **kwargs) -> CommandResult:
    """Accuracy / agreement table over sparsity × allocation × repair (``onnxdiag sweep``).

    Parameters as :func:`_sweep_report`; ``executor`` (``local`` with ``jobs`` worker
    processes, ``ray``, ``ray=HOST:PORT`` or an Executor; default this process): one unit
    per cell and per RR layer.
    """
    with _using(executor, jobs) as ex:
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
    from .model_io import model_hash
    from .sparsity import METHODS, RULES
    from .sparsity.sweep import parse_choices, parse_sparsity_grid, run_sweep

    grid = parse_sparsity_grid(sparsity)
    rules = parse_choices(allocations, RULES, "allocation")
    methods = parse_choices(repairs, METHODS, "repair")
    folder = _check_out(out, "sweep", overwrite, write)
    m, structure, specs, calib, feeds, evaluation, layers = _pruning_setup(
        model, data=data, labels=labels, limit=limit, seed=seed, batch_size=batch_size,
        head=head, features=features, eval_data=eval_data, eval_labels=eval_labels,
        keep_dense=keep_dense)
    curves = _curves(m, layers, feeds, n_images=rr_images, positions=rr_positions, seed=seed,
                     providers=providers, progress=progress,
                     executor=ex) if _needs_rr(rules) else None
    pruner = _pruner(m, structure, feeds, keep_dense=keep_dense, curves=curves,
                     rr_prior=rr_prior, rr_gamma=rr_gamma, rr_cap=rr_cap,
                     force_projection=force_projection, alpha_cap=alpha_cap,
                     recalibrate=recalibrate, providers=providers)
    _, dense_eval = pruner.measure(m, evaluation)
    _say(progress, f"Sweep: {len(grid)} sparsities x {len(rules)} allocations x "
                   f"{len(methods)} repairs on {pruner.n_images} calibration images")
    cells = run_sweep(pruner, grid, rules, methods, eval_source=evaluation,
                      on_cell=_cell_printer(progress), executor=ex)
    ran_on = ex.describe() if ex is not None else {"kind": "in-process"}
    section = summarize_sweep(cells, grid, rules, methods, dense_eval=dense_eval,
                              all_bn=_all_bn(structure, layers))
    section["n_images"] = pruner.n_images
    section["rr_curves"] = None if curves is None else curves.to_dict()
    params = dict(sparsity=list(grid), allocations=rules, repairs=methods, data=data,
                  labels=labels, eval_data=eval_data, eval_labels=eval_labels,
                  keep_dense=list(keep_dense), rr_images=rr_images,
                  rr_positions=_positions(rr_positions), rr_prior=rr_prior,
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
    text = _header(meta) + render_sweep(section)
    return _finish_files("sweep", report, text, folder, overwrite,
                         {"sweep.csv": _cells_csv(section["cells"])}, "sweep.csv")


def summarize_sweep(cells, grid, rules, methods, *, dense_eval=None, all_bn=False) -> dict:
    """Cells, label-free bands per allocation, and where each allocation wins (per repair,
    on accuracy with labels, else on agreement); RR minus its prior and LAMP per S."""
    from .sparsity.sweep import ranges, transition_summary, winners

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
    from .sparsity.sweep import ranges

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
        lines.append(_band_text(tr["band"], f"{r:<11} ({tr['repair']})"))
        for extra in _cts_text(tr, False):
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


# --------------------------------------------------------------------------- analyze

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
    from .graph import analyze_structure
    from .model_io import load_model
    from .sparsity import find_prunable
    from .sparsity.sweep import materialize, run_sweep, transition_summary

    m = load_model(model) if isinstance(model, (str, Path)) else model
    structure = structure or analyze_structure(m)
    layers = find_prunable(structure, keep_dense)
    feeds = materialize(source, n_images)
    curves = _curves(m, layers, feeds, grid=sorted(set(_rr_grid()) | set(sparsities)),
                     n_images=n_images, positions=positions, providers=providers)
    pruner = _pruner(m, structure, feeds, keep_dense=keep_dense, curves=curves,
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
        lines.append(_band_text(tr["band"], "predicted transition band"))
        end = (tr["band"] or {}).get("end")
        if end is not None and end < target:
            lines.append(f"note: S = {target:g} lies beyond the predicted band (agreement with "
                         f"the dense model < 0.5 from S = {end:.3g}): expect a collapse there.")
        lines += _cts_text(tr, _all_bn(structure, layers))
    return section, "\n".join(lines) + "\n"


def _rr_grid():
    from .sparsity import DEFAULT_GRID

    return DEFAULT_GRID
