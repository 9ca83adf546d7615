"""Prune and repair a dense model over a grid of global sparsities (METHODS §C3–C4).

:class:`Pruner` prepares the dense model once (prunable layers, weights, the
calibration set in memory, the dense predictions on it); each cell of a sweep is
then allocate → magnitude masks → repair → predictions.  ``Agr_X(S)``: the
fraction of calibration images whose top-1 after pruning to S and repair X equals
the dense model's (label-free); with labelled data, also top-1 accuracy and loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import DataError, OnnxDiagError
from ..model.expose import expose_tensors
from ..runtime.batching import batch_len
from ..runtime.runner import OrtRunner
from .allocation import RULES, allocate_sparsity
from .budget import no_prunable_message
from .masks import describe_layers, find_prunable, make_masks, read_weights
from .repair import METHODS, repair_model
from .segments import feed_dicts
from .transition import cts, cts_band, transition_band

#: METHODS §C4 label-free band: the repair whose agreement defines it, and the one CTS compares.
BAND_REPAIR, CTS_BASELINE = "cr+bn", "bn"


def materialize(source, n_images: int | None = None) -> list[dict]:
    """The first ``n_images`` samples (all when None) of a DataSource or iterable of feed
    dicts, as a list of feed dicts held in memory."""
    out, seen = [], 0
    for feeds in feed_dicts(source):
        n = batch_len(feeds)
        take = n if n_images is None else min(n, n_images - seen)
        if take <= 0:
            break
        out.append({k: np.asarray(v)[:take] for k, v in feeds.items()})
        seen += take
    if seen == 0:
        raise DataError("The calibration data is empty; give at least one sample.")
    return out


def logits_runner(model, head, *, providers=None, threads=None) -> OrtRunner:
    """A session that outputs the head's logits tensor (exposed on a copy when needed)."""
    outputs = {o.name for o in model.graph.output}
    m = model if head.logits in outputs else expose_tensors(model, [head.logits])
    return OrtRunner(m, providers=providers, threads=threads)


def run_logits(runner: OrtRunner, head, batches: Iterable[dict]) -> np.ndarray:
    """Head logits ``(n_samples, n_classes)`` float64 over feed dicts."""
    return stack_logits([runner.run(feeds, [head.logits])[head.logits] for feeds in batches])


def stack_logits(parts) -> np.ndarray:
    """Per-batch logits as one ``(n_samples, n_classes)`` float64 array."""
    return np.concatenate([np.asarray(p, np.float64).reshape(p.shape[0], -1) for p in parts])


@dataclass
class Pruner:
    """A dense model prepared for pruning (never modified).

    Args:
        model, structure: the dense model and its :func:`~onnxdiag.graph.analyze_structure`.
        calib: calibration feed dicts (:func:`materialize`), used by every repair and for
            the agreement with the dense model.
        keep_dense: layer names left dense; rr_curves: needed by the ``rr*`` rules.
        options: allocation settings (prior, gamma, cap, force_projection, step).
        alpha_cap, recalibrate: repair settings (METHODS §C1); ls: the
            :class:`~onnxdiag.sparsity.ls_repair.LSSettings` of ``ls`` / ``ls+bn`` (§E1).
        pass_logits: (**our default** True) a repair's sequential pass also runs on to the
            head's logits, and a sweep cell's agreement is read from them (float32
            rounding of a fresh run of the repaired model: the pass caches α·y where the
            model computes with α·W) instead of a further pass; False: a fresh session.
    """

    model: object
    structure: object
    calib: list
    keep_dense: tuple = ()
    rr_curves: object = None
    options: dict = field(default_factory=dict)
    alpha_cap: float = 100.0
    recalibrate: str = "affected"
    providers: object = None
    threads: int | None = None
    ls: object = None  # LSSettings of the ls repairs (METHODS §E1); None: the defaults
    label: str | None = None  # progress bars of each repair's sequential pass (None: none)
    pass_logits: bool = True

    def __post_init__(self):
        self.keep_dense = tuple(self.keep_dense)
        self.layers = find_prunable(self.structure, self.keep_dense)
        if not self.layers:
            raise OnnxDiagError(no_prunable_message(self.structure.layers))
        self.infos = describe_layers(self.model, self.layers)
        self.weights = read_weights(self.model, self.layers)
        self.head = self.structure.head
        self.dense_logits = self.logits(self.model)  # (n_images, n_classes) float64
        self.dense_pred = self.dense_logits.argmax(axis=1)
        self.dense_moments = {}  # the repairs' dense layer-output moments, shared by cells
        self.orders = {}  # the layers' magnitude orders (masks.make_masks), shared by cells

    @property
    def n_images(self) -> int:
        return sum(batch_len(f) for f in self.calib)

    def allocate(self, rule: str, S: float):
        """The :class:`~onnxdiag.sparsity.Allocation` of ``rule`` at ``S``."""
        return allocate_sparsity(rule, self.infos, S, rr_curves=self.rr_curves,
                                 weights=self.weights, keep_dense=self.keep_dense,
                                 **self.options)

    def prune(self, allocation, method: str, *, masks=None):
        """(repaired pruned model, RepairRecord) for an allocation and a repair method;
        with ``pass_logits`` the record's ``outputs`` hold the head's logits when the
        repair ran a sequential pass (:meth:`pass_logits_of`)."""
        masks = make_masks(allocation, self.weights, self.orders) if masks is None else masks
        return repair_model(self.model, self.structure, masks, self.calib, method=method,
                            alpha_cap=self.alpha_cap, recalibrate=self.recalibrate,
                            providers=self.providers, threads=self.threads, ls=self.ls,
                            label=self.label and f"{self.label} ({method})",
                            dense=self.dense_moments,
                            outputs=(self.head.logits,) if self.pass_logits else ())

    def pass_logits_of(self, record) -> np.ndarray | None:
        """The head logits a repair's sequential pass computed (None: it ran none)."""
        parts = None if record is None else record.outputs.get(self.head.logits)
        return None if parts is None else stack_logits(parts)

    def logits(self, model, runner=None) -> np.ndarray:
        """Head logits of ``model`` on the calibration set."""
        runner = runner or logits_runner(model, self.head, providers=self.providers,
                                         threads=self.threads)
        return run_logits(runner, self.head, self.calib)

    def agreement(self, model, runner=None, logits=None) -> float:
        """Agr: fraction of calibration images with the dense model's top-1 (METHODS §C4);
        ``logits``: the model's calibration logits when already known."""
        logits = self.logits(model, runner) if logits is None else logits
        return float(np.mean(logits.argmax(axis=1) == self.dense_pred))

    def measure(self, model, eval_source=None, record=None) -> tuple[float, dict | None]:
        """(agreement on the calibration set, accuracy / loss on the labelled
        ``eval_source`` or None; :func:`onnxdiag.evaluate.evaluate`); ``record``: the
        repair's RepairRecord, whose pass logits then give the agreement."""
        from ..evaluate import evaluate, make_head_runner

        logits = self.pass_logits_of(record)
        if logits is not None and eval_source is None:
            return self.agreement(model, logits=logits), None
        runner = make_head_runner(model, self.head, providers=self.providers,
                                  threads=self.threads)
        ev = evaluate(runner, self.head, eval_source)
        return self.agreement(model, runner, logits), None if ev is None else ev.to_dict()


@dataclass(frozen=True)
class SweepCell:
    """One (S, allocation, repair) of a sweep; ``error`` is set when the rule cannot meet S
    or (``failed``) the cell's unit of work failed; the other fields are then None.
    ``layer_sparsity``: the allocation per layer."""

    sparsity: float
    allocation: str
    repair: str
    agreement: float | None = None
    accuracy: float | None = None
    loss: float | None = None
    seconds: float = 0.0
    error: str | None = None
    layer_sparsity: dict | None = None
    failed: bool = False

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _measured(key: tuple, alloc, model, pruner: Pruner, eval_source, seconds: float,
              record=None) -> SweepCell:
    agr, ev = pruner.measure(model, eval_source, record)
    return SweepCell(float(key[0]), key[1], key[2], agreement=agr,
                     accuracy=None if ev is None else ev["accuracy"],
                     loss=None if ev is None else ev["loss"], seconds=seconds,
                     layer_sparsity=dict(alloc.sparsity))


def _sweep_cell(key: tuple, pruner: Pruner, shipped_eval, specs) -> SweepCell:
    """One (S, rule, method) cell, self-contained (the unit of work of an executor)."""
    from ..runtime.executor import receive

    S, rule, method = key
    t0 = time.perf_counter()
    try:
        alloc = pruner.allocate(rule, S)
    except OnnxDiagError as exc:
        return SweepCell(float(S), rule, method, error=str(exc))
    model, record = pruner.prune(alloc, method)
    source = None if shipped_eval is None else receive(shipped_eval, specs)
    return _measured(key, alloc, model, pruner, source, time.perf_counter() - t0, record)


def _run_on(executor, pruner, keys, shipped, on_cell) -> list[SweepCell]:
    """The cells as units of ``executor``: the pruner (dense model, calibration samples, RR
    curves) and the ``shipped`` evaluation data go once; cells come back in grid order."""
    import dataclasses

    from ..model.io import get_input_specs
    from ..runtime.executor import wants_gpu

    worker = dataclasses.replace(pruner, threads=1)  # one core per unit
    shared = (worker, shipped, get_input_specs(pruner.model))
    out: dict[int, SweepCell] = {}
    for i, cell, error in executor.map(_sweep_cell, keys, shared,
                                       gpu=wants_gpu(pruner.providers)):
        if cell is None:  # the unit failed outside the allocation: keep the message
            cell = SweepCell(keys[i][0], keys[i][1], keys[i][2], error=error, failed=True)
        out[i] = cell
        if on_cell:
            on_cell(cell, len(out), len(keys))
    return [out[i] for i in range(len(keys))]


def _run_here(pruner, grid, rules, methods, eval_source, on_cell) -> list[SweepCell]:
    """The cells in this process: one allocation and mask set per (S, rule)."""
    cells, total = [], len(grid) * len(rules) * len(methods)

    def add(cell):
        cells.append(cell)
        if on_cell:
            on_cell(cell, len(cells), total)

    for S in grid:
        for rule in rules:
            t0 = time.perf_counter()
            try:
                alloc = pruner.allocate(rule, S)
            except OnnxDiagError as exc:
                for method in methods:
                    add(SweepCell(float(S), rule, method, error=str(exc)))
                continue
            masks = make_masks(alloc, pruner.weights, pruner.orders)
            for method in methods:
                model, record = pruner.prune(alloc, method, masks=masks)
                add(_measured((S, rule, method), alloc, model, pruner, eval_source,
                              time.perf_counter() - t0, record))
                t0 = time.perf_counter()
    return cells


def run_sweep(pruner: Pruner, grid: Sequence[float], rules: Sequence[str],
              methods: Sequence[str], *, eval_source=None, eval_request=None,
              on_cell: Callable[[SweepCell, int, int], None] | None = None,
              executor=None) -> list[SweepCell]:
    """Every (S, rule, method) cell: one allocation and mask set per (S, rule), one repair
    per method.  A rule that cannot meet S yields cells with ``error`` (not an exception).

    ``eval_source``: labelled data (a DataSource) or None. ``executor`` (an
    :class:`onnxdiag.runtime.executor.Executor` that does not run ``in_process``): run each
    cell as a unit of work there (local processes or Ray tasks); the evaluation data go to
    the workers once (:meth:`~onnxdiag.runtime.executor.Executor.ship`; ``eval_request``,
    the :class:`~onnxdiag.commands.base.DataRequest` it was opened from, lets local workers
    reopen its path instead of receiving the samples). A unit that fails becomes a cell
    with ``error`` and ``failed`` set.
    """
    for rule in rules:
        if rule not in RULES:
            raise OnnxDiagError(f"Unknown allocation {rule!r}; choose from {', '.join(RULES)}.")
    for method in methods:
        if method not in METHODS:
            raise OnnxDiagError(f"Unknown repair {method!r}; choose from {', '.join(METHODS)}.")
    if executor is None or executor.in_process:
        return _run_here(pruner, grid, rules, methods, eval_source, on_cell)
    keys = [(float(S), rule, method) for S in grid for rule in rules for method in methods]
    shipped = None
    if eval_source is not None:
        if eval_request is None:  # no path to reopen: the samples themselves are shipped
            from ..data.request import DataRequest

            eval_request = DataRequest(None)
        shipped = executor.ship(eval_request, eval_source)
    return _run_on(executor, pruner, keys, shipped, on_cell)


def curve(cells: Sequence[SweepCell], rule: str, method: str, metric: str = "agreement"
          ) -> tuple[np.ndarray, np.ndarray]:
    """(S grid, values) of one allocation and repair, skipping failed cells."""
    pts = [(c.sparsity, getattr(c, metric)) for c in cells
           if c.allocation == rule and c.repair == method and getattr(c, metric) is not None]
    pts.sort()
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts], dtype=np.float64)


def transition_summary(cells: Sequence[SweepCell], rule: str, methods: Sequence[str], *,
                       hi: float = 0.9, lo: float = 0.5) -> dict:
    """Label-free transition of one allocation (METHODS §C4): the agreement band of the
    ``cr+bn`` curve (else of the first repair, named in ``repair``), and CTS with its
    half-max band when both ``cr+bn`` and ``bn`` were run."""
    band_method = BAND_REPAIR if BAND_REPAIR in methods else methods[0]
    S, agr = curve(cells, rule, band_method)
    out = {"allocation": rule, "repair": band_method, "band": None, "cts": None,
           "cts_band": None}
    if S.size:
        out["band"] = transition_band(S, agr, hi=hi, lo=lo).to_dict()
    if BAND_REPAIR in methods and CTS_BASELINE in methods:
        S1, a = curve(cells, rule, BAND_REPAIR)
        S2, b = curve(cells, rule, CTS_BASELINE)
        common = np.intersect1d(S1, S2)
        if common.size:
            values = cts(a[np.isin(S1, common)], b[np.isin(S2, common)])
            out["cts"] = {"sparsity": common.tolist(), "values": values.tolist()}
            out["cts_band"] = cts_band(common, values).to_dict()
    return out


def winners(cells: Sequence[SweepCell], method: str, metric: str, *, tol: float = 0.0
            ) -> dict[float, list[str]]:
    """{S: allocations within ``tol`` of the best ``metric`` (higher is better)}."""
    out: dict[float, list[str]] = {}
    for S in sorted({c.sparsity for c in cells}):
        row = {c.allocation: getattr(c, metric) for c in cells
               if c.sparsity == S and c.repair == method and getattr(c, metric) is not None}
        if row:
            best = max(row.values())
            out[S] = [r for r, v in row.items() if v >= best - tol]
    return out


def ranges(points: Sequence[float], grid: Sequence[float]) -> list[tuple[float, float]]:
    """``points`` (a subset of ``grid``) as maximal runs of consecutive grid points."""
    grid = sorted(grid)
    pos = sorted(grid.index(p) for p in points)
    runs: list[tuple[float, float]] = []
    for i in pos:
        if runs and grid.index(runs[-1][1]) == i - 1:
            runs[-1] = (runs[-1][0], grid[i])
        else:
            runs.append((grid[i], grid[i]))
    return runs
