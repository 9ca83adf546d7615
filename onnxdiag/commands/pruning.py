"""Steps shared by the unstructured-pruning verbs ``rr``, ``prune`` and ``sweep``.

:class:`PrunerOptions` is the record of the options the three verbs share (the layers
left dense, how the RR curves are estimated, the ``rr`` rule, the repair settings);
each verb's own record nests it as ``pruner``. :func:`open_inputs` loads the model and
opens the data roles once; :func:`compute_curves` and :func:`make_pruner` prepare the
dense model for allocation and repair (docs/METHODS.md §C1–§C3).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import OnnxDiagError, OutputError
from .base import CommandResult, DataRequest, HeadChoice, describe_sources, find_structure, finish

#: docs/METHODS.md §C4 scan of the ``rr`` verb: coarse below 0.9, fine above (17 points).
DEFAULT_BAND = "0.1:0.9:0.1,0.91:0.99:0.01"

#: Sparsities shown as columns of the RR text table (the JSON / CSV hold the whole grid).
TABLE_SPARSITIES = (0.5, 0.8, 0.9, 0.95, 0.99)

#: Echoed into every report ("our default" choices of docs/METHODS.md are parameters).
DEFAULTS = dict(rr_images=64, rr_positions=16, rr_eps=1e-12, alpha_cap=100.0, rr_prior="erk",
                ls_ridge=0.01, ls_prior="weights", ls_exact_max=1e9, ls_positions="all",
                ls_inputs="sequential",
                rr_gamma=1.0, rr_cap=0.99, recalibrate="affected", band_hi=0.9, band_lo=0.5,
                band_repair="cr+bn", cts_baseline="bn")

CTS_NOTE = ("CTS compares CR+BN with BN-only; every pruned layer here but the head feeds a "
            "BatchNormalization, where CTS was measured as noise (CR+BN ~ BN-only; "
            "docs/METHODS.md §C4): read the agreement band.")

LATENCY_NOTE = ("unstructured zeros do not speed up ONNX Runtime (dense kernels); removing "
                "channels (onnxdiag prune-channels) does.")

RECALIBRATE = ("affected", "all")


@dataclass(frozen=True)
class PrunerOptions:
    """The options ``rr``, ``prune`` and ``sweep`` share (defaults: docs/METHODS.md §C1–§C3).

    ``keep_dense``: layer names left dense (they count in the budget). ``rr_images``:
    calibration images for the RR curves; ``rr_positions``: conv output positions per image
    whose patches enter the RR moments (an int; None or "all": every position).
    ``rr_prior`` / ``rr_gamma`` / ``rr_cap``: the ``rr`` rule's prior, exponent and
    per-layer cap; ``force_projection``: ERK sets 1×1 shortcut convs to s = S.
    ``alpha_cap``: CR's cap on α; ``recalibrate``: the BNs downstream of a pruned weight
    ("affected") or "all". ``ls_ridge`` / ``ls_prior`` / ``ls_exact_max`` /
    ``ls_positions`` / ``ls_inputs``: the ``ls`` repairs' ridge factor, ridge target,
    exact-solve limit, positions per image (None: all) and whose inputs the layers are
    fitted on ("sequential": the repaired model's; "dense": the dense model's, one pass)
    (docs/METHODS.md §E1).
    """

    keep_dense: tuple[str, ...] = ()
    rr_images: int = 64
    rr_positions: int | str | None = 16
    rr_prior: str = "erk"
    rr_gamma: float = 1.0
    rr_cap: float = 0.99
    force_projection: bool = False
    alpha_cap: float = 100.0
    recalibrate: str = "affected"
    ls_ridge: float = 0.01
    ls_prior: str = "weights"
    ls_exact_max: float = 1e9
    ls_positions: int | None = None
    ls_inputs: str = "sequential"

    @classmethod
    def take(cls, kwargs: dict) -> PrunerOptions:
        """Remove this record's fields from ``kwargs`` (parsed CLI options) into a record."""
        values = {f.name: kwargs.pop(f.name) for f in dataclasses.fields(cls) if f.name in kwargs}
        if "keep_dense" in values:
            values["keep_dense"] = tuple(values["keep_dense"])
        return cls(**values)

    def check(self) -> None:
        """Raise OnnxDiagError for a value no verb can use (before any work)."""
        from ..sparsity.allocation import PRIORS
        from ..sparsity.repairability import parse_positions, positive_int

        parse_positions(self.rr_positions)
        positive_int(self.rr_images, f"rr_images must be a positive integer; got "
                                     f"{self.rr_images!r}.")
        if self.rr_prior not in PRIORS:
            raise OnnxDiagError(f"Unknown RR prior {self.rr_prior!r}; choose one of "
                                f"{', '.join(PRIORS)}.")
        if self.recalibrate not in RECALIBRATE:
            raise OnnxDiagError(f"Unknown recalibrate {self.recalibrate!r}; choose one of "
                                f"{', '.join(RECALIBRATE)}.")
        self.ls_settings().check()

    def ls_settings(self):
        """The :class:`~onnxdiag.sparsity.ls_repair.LSSettings` of these options."""
        from ..sparsity.ls_repair import LSSettings

        return LSSettings(ridge=self.ls_ridge, prior=self.ls_prior,
                          exact_max=self.ls_exact_max, positions=self.ls_positions,
                          inputs=self.ls_inputs)

    def params(self) -> dict:
        """The record as report parameters (``rr_positions`` as an int or "all")."""
        return {**dataclasses.asdict(self), "keep_dense": list(self.keep_dense),
                "rr_positions": parse_positions_arg(self.rr_positions),
                "ls_positions": parse_positions_arg(self.ls_positions)}


@dataclass
class Inputs:
    """The dense model and the data a pruning verb works on (see :func:`open_inputs`).

    ``path``: the model as given; ``model``: loaded (never modified); ``calib``: the
    calibration DataSource and ``feeds`` its samples in memory; ``evaluation``: the
    labelled DataSource or None; ``layers``: the prunable layers (docs/METHODS.md §C1).
    """

    path: object
    model: object
    structure: object
    specs: list | None
    calib: object
    feeds: list
    evaluation: object | None
    layers: list


def open_inputs(model, data, eval_data=None, *, head: HeadChoice | None = None,
                keep_dense=()) -> Inputs:
    """Load ``model``, find its structure and open the data roles (requests or paths)."""
    from ..model.io import get_input_specs, load_model
    from ..sparsity import find_prunable
    from ..sparsity.sweep import materialize

    if data is None:
        raise OnnxDiagError("Pruning needs unlabelled calibration images for the repair and "
                            "the agreement with the dense model; pass --data FILE.")
    head = head or HeadChoice()
    m = load_model(model)
    structure = find_structure(m, head, data)
    specs = get_input_specs(m)
    classes = structure.head.n_classes if structure.head is not None else None
    calib = DataRequest.of(data).open(specs, classes=classes)
    request = DataRequest.of(eval_data)
    evaluation = None if request is None else request.open(specs, classes=classes)
    return Inputs(model, m, structure, specs, calib, materialize(calib), evaluation,
                  find_prunable(structure, keep_dense))


def compute_curves(inputs: Inputs, options: PrunerOptions, *, seed=0, grid=None,
                   providers=None, progress=False, executor=None, methods=()):
    """RR curves on the first ``rr_images`` calibration images, each conv's moments over
    ``rr_positions`` seeded output positions per image (docs/METHODS.md §C2). When they
    are every calibration image and one of the repair ``methods`` to follow needs the
    dense layer-output moments, the capture pass folds those too (:func:`make_pruner`
    hands them to the Pruner: one dense pass fewer)."""
    from ..sparsity import DEFAULT_GRID, compute_rr_curves
    from ..sparsity.budget import no_prunable_message
    from ..sparsity.repair import parse_method
    from ..sparsity.repairability import parse_positions
    from ..sparsity.segments import batch_len

    if not inputs.layers:  # refused before any progress line: the error is the only one
        raise OnnxDiagError(no_prunable_message(inputs.structure.layers))
    grid = DEFAULT_GRID if grid is None else grid
    positions = parse_positions(options.rr_positions)
    where = "every position" if positions is None else f"{positions} positions per image"
    say(progress, f"RR curves: {len(inputs.layers)} layers x {len(grid)} sparsities on "
                  f"{options.rr_images} calibration images, {where} (one capture pass)")
    n_calib = sum(batch_len(f) for f in inputs.feeds)
    return compute_rr_curves(inputs.model, inputs.layers, inputs.feeds, grid=grid,
                             n_images=options.rr_images, positions=positions, seed=seed,
                             providers=providers, executor=executor,
                             label="RR curves" if progress else None,
                             # the cr / bn family reads them; none and ls never do
                             output_moments=options.rr_images >= n_calib and any(
                                 m != "none" and parse_method(m)[0] != "ls" for m in methods))


def make_pruner(inputs: Inputs, options: PrunerOptions, curves=None, providers=None, *,
                seed: int = 0, progress: bool = False):
    """The :class:`~onnxdiag.sparsity.sweep.Pruner` of the dense model (rr rules need
    ``curves``; ``seed``: the LS position draw); ``progress``: a bar with an ETA over each
    repair's layers."""
    from ..sparsity.sweep import Pruner

    rule = dict(prior=options.rr_prior, gamma=options.rr_gamma, cap=options.rr_cap,
                force_projection=options.force_projection)
    pruner = Pruner(inputs.model, inputs.structure, inputs.feeds,
                    keep_dense=options.keep_dense, rr_curves=curves, options=rule,
                    alpha_cap=options.alpha_cap, recalibrate=options.recalibrate,
                    providers=providers, ls=dataclasses.replace(options.ls_settings(), seed=seed),
                    label="Repair" if progress else None)
    moments = None if curves is None else curves.output_moments
    if moments and curves.n_images == pruner.n_images:  # the same images: the first n
        pruner.dense_moments.update(moments)
    return pruner


def open_fan_out(runtime):
    """The executor of a fan-out verb (``with open_fan_out(runtime) as ex``): without
    ``executor`` and ``jobs`` everything runs in this process; ``local`` alone uses one
    worker process per core."""
    from ..runtime.executor import open_executor

    return open_executor(runtime.executor, runtime.jobs,
                         local_jobs=1 if runtime.executor is None else None)


def pruning_metadata(command: str, inputs: Inputs, options, *, runtime, head, data,
                     eval_data=None, executor=None, **extra) -> dict:
    """``metadata`` of a pruning verb: every option (defaults included), each data role's
    request, the data sources by role and, for fan-out verbs, the executor."""
    from ..model.io import model_hash
    from ..report import build_metadata

    params = {**dataclasses.asdict(options), "pruner": options.pruner.params(), **extra,
              "data": DataRequest.of(data).params(),
              "eval_data": None if eval_data is None else DataRequest.of(eval_data).params(),
              "head": dataclasses.asdict(head), "providers": runtime.providers,
              "defaults": DEFAULTS}
    if executor is not None:
        params.update(executor=runtime.executor_name(), jobs=runtime.jobs)
    meta = build_metadata(providers=runtime.providers,
                          command=command, parameters=params, model_path=inputs.path,
                          model_hash=model_hash(inputs.model),
                          data=describe_sources(calibration=inputs.calib,
                                                evaluation=inputs.evaluation))
    if executor is not None:
        meta["executor"] = executor.describe()
    return meta


def protected_inputs(model, *requests) -> list:
    """The input files an emitted model must never overwrite: the model and each data
    role's source and labels."""
    out = [model]
    for request in requests:
        request = DataRequest.of(request)
        if request is not None:
            out += [request.source, request.labels]
    return [p for p in out if p is not None]


def say(enabled: bool, line: str) -> None:
    if enabled:
        print(line, file=sys.stderr, flush=True)


def cell_printer(enabled: bool):
    """on_cell callback: one progress line per sweep cell on stderr."""
    if not enabled:
        return None
    import time

    start = time.perf_counter()

    def show(cell, i, total):
        if cell.error:
            what = f"{'FAILED' if cell.failed else 'skipped'} ({cell.error})"
        else:
            what = f"agreement {cell.agreement:.3f}"
            if cell.accuracy is not None:
                what += f", top-1 {100 * cell.accuracy:.2f} %"
            what += f" ({cell.seconds:.1f} s)"
        left = (time.perf_counter() - start) / i * (total - i)
        eta = f", ETA {left:.0f} s" if i < total else ""
        say(True, f"[{i}/{total}] S={cell.sparsity:g} {cell.allocation} {cell.repair}: "
                  f"{what}{eta}")
    return show


def parse_positions_arg(positions):
    """``rr_positions`` as echoed in the parameters: an int, or "all"."""
    from ..sparsity.repairability import parse_positions

    value = parse_positions(positions)
    return "all" if value is None else value


def needs_rr(rules) -> bool:
    return any(r.startswith("rr") for r in rules)


def every_layer_has_bn(layers) -> bool:
    """Whether every prunable layer but the head (convs and hidden linear layers, which
    CR repairs) feeds a BatchNormalization: then CR+BN ~ BN-only (docs/METHODS.md §C1)."""
    repaired = [la for la in layers if not la.is_head]
    return bool(repaired) and all(la.bn_node for la in repaired)


def repair_notes(inputs: Inputs, methods) -> list[str]:
    """What the ``methods``' BN parts leave alone in this model (linear layers under
    LayerNorm, docs/METHODS.md §D), for the report's ``notes``."""
    from ..sparsity.repair import repair_notes as notes_of

    return notes_of(inputs.model, inputs.layers, methods)


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


def failure_lines(cells: list[dict]) -> list[str]:
    """Text lines for the cells that could not run: units that failed, then (first 3)
    the distinct reasons a rule could not meet its S."""
    lines = [f"FAILED cell S={c['sparsity']:g} {c['allocation']} {c['repair']}: {c['error']}"
             for c in cells if c.get("failed")]
    skipped = sorted({c["error"] for c in cells if c["error"] and not c.get("failed")})
    return lines + [f"skipped cells: {e}" for e in skipped[:3]]


def failed_cells(cells: list[dict]) -> list[dict]:
    """The section's ``failed`` list: cells whose unit of work failed."""
    return [{k: c[k] for k in ("sparsity", "allocation", "repair", "error")}
            for c in cells if c.get("failed")]


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
