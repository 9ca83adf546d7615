"""Steps shared by the unstructured-pruning verbs ``rr``, ``prune`` and ``sweep``."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

from ..errors import OnnxDiagError, OutputError
from .base import CommandResult, finish, open_source

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


def open_setup(model, *, data, labels, limit, seed, batch_size, head, features):
    """(model, structure, specs, calibration DataSource, its feeds in memory)."""
    from ..graph import analyze_structure
    from ..model.io import get_input_specs, load_model
    from ..sparsity.sweep import materialize

    if data is None:
        raise OnnxDiagError("Pruning needs unlabelled calibration images for the repair and "
                            "the agreement with the dense model; pass --data FILE.")
    m = load_model(model)
    structure = analyze_structure(m, head=head, features=features)
    specs = get_input_specs(m)
    calib = open_source(data, specs, labels=labels, limit=limit, seed=seed, batch_size=batch_size)
    return m, structure, specs, calib, materialize(calib)


def pruning_setup(model, *, eval_data, eval_labels, keep_dense, **setup):
    """:func:`open_setup` plus the evaluation source (None without ``eval_data``) and the
    prunable layers: (model, structure, specs, calibration, its feeds, evaluation,
    layers)."""
    from ..sparsity import find_prunable

    m, structure, specs, calib, feeds = open_setup(model, **setup)
    evaluation = None if eval_data is None else open_source(
        eval_data, specs, labels=eval_labels, seed=setup["seed"],
        batch_size=setup["batch_size"])
    return m, structure, specs, calib, feeds, evaluation, find_prunable(structure, keep_dense)


def compute_curves(m, layers, feeds, *, grid=None, n_images=64, positions=16, seed=0,
            providers=None, progress=False, executor=None):
    """RR curves on the first ``n_images`` calibration images, each conv's moments over
    ``positions`` seeded output positions per image (None / "all": every position)."""
    from ..sparsity import DEFAULT_GRID, compute_rr_curves
    from ..sparsity.repairability import parse_positions

    grid = DEFAULT_GRID if grid is None else grid
    positions = parse_positions(positions)
    where = "every position" if positions is None else f"{positions} positions per image"
    say(progress, f"RR curves: {len(layers)} layers x {len(grid)} sparsities on "
                   f"{n_images} calibration images, {where} (one capture pass)")
    return compute_rr_curves(m, layers, feeds, grid=grid, n_images=n_images,
                             positions=positions, seed=seed, providers=providers,
                             executor=executor)


def make_pruner(m, structure, feeds, *, keep_dense, curves, rr_prior, rr_gamma, rr_cap,
            force_projection, alpha_cap, recalibrate, providers):
    from ..sparsity.sweep import Pruner

    options = dict(prior=rr_prior, gamma=rr_gamma, cap=rr_cap, force_projection=force_projection)
    return Pruner(m, structure, feeds, keep_dense=tuple(keep_dense), rr_curves=curves,
                  options=options, alpha_cap=alpha_cap, recalibrate=recalibrate,
                  providers=providers)


def say(enabled: bool, line: str) -> None:
    if enabled:
        print(line, file=sys.stderr, flush=True)


def cell_printer(enabled: bool):
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
        say(True, f"[{i}/{total}] S={cell.sparsity:g} {cell.allocation} {cell.repair}: {what}")
    return show


def parse_positions_arg(positions):
    """``rr_positions`` as echoed in the parameters: an int, or "all"."""
    from ..sparsity.repairability import parse_positions

    value = parse_positions(positions)
    return "all" if value is None else value


def needs_rr(rules) -> bool:
    return any(r.startswith("rr") for r in rules)


def every_layer_has_bn(structure, layers) -> bool:
    convs = [la for la in layers if la.op_type == "Conv"]
    return bool(convs) and all(la.bn_node for la in convs)


def band_text(band: dict | None, what: str) -> str:
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


def cts_text(tr: dict, all_bn: bool) -> list[str]:
    if tr.get("cts_band") is None:
        return []
    b = tr["cts_band"]
    vals = tr["cts"]["values"]
    line = (f"CTS band (CTS >= 1/2 max, max {max(vals):.3f}): "
            + (f"S {b['start']:.4g} to {b['end']:.4g}" if b["start"] is not None
               else "none (max CTS <= 0)"))
    return [line] + ([f"note: {CTS_NOTE}"] if all_bn else [])


@contextmanager
def using(executor, jobs):
    """The executor for ``executor`` (None: this process), closed afterwards if made here."""
    from ..runtime.executor import open_executor

    if executor is None:
        yield None
        return
    with open_executor(executor, jobs) as ex:
        yield ex


def cell_value(cells, S, repair, key):
    c = cells.get((S, repair))
    return None if c is None else c.get(key)


def curves_csv(curves) -> str:
    from ..report.text import rows_to_csv

    return rows_to_csv([{"layer": name, "sparsity": float(s), "d_raw": float(curves.d_raw[i, j]),
                         "d_repair": float(curves.d_repair[i, j]), "rr": float(curves.rr[i, j])}
                        for i, name in enumerate(curves.layers)
                        for j, s in enumerate(curves.grid)])


def cells_csv(cells) -> str:
    from ..report.text import rows_to_csv

    keys = ("sparsity", "allocation", "repair", "agreement", "accuracy", "loss", "seconds",
            "error")
    return rows_to_csv([{k: c[k] for k in keys} for c in cells])


def finish_files(command, report, text, folder, overwrite, files, main) -> CommandResult:
    """Write report.json, report.txt and ``files`` ({name: CSV}); ``main`` names the table
    ``--format csv`` prints."""
    return finish(command, report, text, folder, overwrite, csv=files[main], csv_name=main,
                  files=files)


def check_model_output(output, protect, overwrite: bool) -> Path:
    """Fail before any work: -o is an input, a folder, or exists without ``overwrite``."""
    from ..model.io import check_output_path

    out = check_output_path(output, protect=protect)
    for p in (out, out.with_name(out.name + ".json")):
        if p.exists() and not overwrite:
            raise OutputError(f"Output '{p}' already exists; choose another -o or pass "
                              "--overwrite.")
    return out
