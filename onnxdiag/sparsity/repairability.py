"""Relative repairability RR(ℓ, s) of every prunable layer (METHODS §C2).

One ONNX Runtime pass captures each prunable layer's dense *input* on a fixed
number of calibration images; then, per layer and per sparsity s of the grid, the
single layer is evaluated offline (:mod:`onnxdiag.sparsity.offline`) with its
magnitude mask — never a network pass per (ℓ, s).  With y^d the dense and y^p the
pruned pre-BN output (all images × positions; population moments):

    D_raw    = Σ_c E[(y^d_c − y^p_c)²] / Σ_c Var(y^d_c)
    D_repair = Σ_c E[(y^d_c − ŷ_c)²] / Σ_c Var(y^d_c),  ŷ_c = μ^d_c + σ^d_c/σ^p_c (y^p_c − μ^p_c)
    RR       = (D_repair + ε) / (D_raw + ε)

Per channel E[(y^d − ŷ)²] = 2σ^d²(1 − corr(y^d, y^p)); a channel with σ^p = 0 can only be
restored to its mean, error σ^d² (**our default** for that 0/0; σ^p < 1e-6·σ^d counts as 0).
Only the per-channel moments of (y^d, y^d − y^p) are accumulated, batch by batch (memory
O(L·|grid|·C)).

Position sampling (``positions``, **our default** 16 per input): a conv's moments are
taken over ``positions`` output positions per image drawn by
:func:`onnxdiag.stats.draw_positions` (a counter-based hash of (seed, image index, draw),
with replacement; the same positions for an image whatever batch it arrives in), and
only those positions' patches are gathered; a linear layer's positions are its input's
tokens (METHODS §D: the leading axes after the batch), drawn alike
(:func:`~onnxdiag.sparsity.offline.sampled_rows`).  A layer with at most ``positions``
positions per input (an MLP's layers: one) and ``positions=None`` / "all" use every
position (exact).  The sampled moments estimate the all-position ones; RR
is then a ratio of estimates (see benchmarks/sections/issue5_bench.md for the measured
error on the bundled model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from ..report.json import to_jsonable as jsonable
from ..runtime.executor import raise_failures
from ..runtime.pool import THREADS, thread_map
from .rr_capture import capture
from .rr_layer import (  # noqa: F401 - PairMoments, distortions, … re-exported
    PairMoments,
    centre_rows,
    distortions,
    finish_layer,
    layer_unit,
    plan_layer,
)
from .rr_strategy import (  # noqa: F401 - GRAM_SPEED, choose_strategy re-exported
    GRAM_MAX_ENTRIES,
    GRAM_SPEED,
    STRATEGIES,
    choose_strategy,
    finish_cost,
    layer_positions,
)

#: METHODS §C2 default grid: {0, 0.05, …, 0.9} ∪ {0.91, …, 0.99} (28 points).
DEFAULT_GRID = tuple(round(0.05 * i, 2) for i in range(19)) + tuple(
    round(0.91 + 0.01 * i, 2) for i in range(9))
#: Output positions per image sampled for a conv's moments (**our default**; None = all).
DEFAULT_POSITIONS = 16
#: Threads planning, folding and finishing the layers (every core, at most 4): each
#: layer's work is its own (the same result as one thread, bit for bit), and its SciPy
#: sparse products, single-threaded, release the GIL.
LAYER_THREADS = THREADS
#: With sampled positions, the Gram finish's sparse products R_l Σ run in float32, each
#: step's product summed into float64 (**our default**; ~3x faster than float64 in SciPy,
#: the same order of error as the float32 Gram products of Σ itself, bound tested); with
#: every position they stay float64.
GRAM_STEPS_FLOAT32 = True


@dataclass(frozen=True, eq=False)
class RRCurves:
    """RR curves of L layers on a grid of n_s sparsities.

    Fields: ``layers`` (L,) names; ``grid`` (n_s,); ``d_raw`` / ``d_repair`` / ``rr`` (L, n_s);
    ``n_weights`` (L,); ``n_images`` calibration images; ``n_samples`` (L,) rows (images ×
    positions) per layer; ``eps`` (METHODS §C2's ε); ``positions`` output positions sampled per
    image (None: every position) and ``seed`` of that draw.  Between grid points values are
    linearly interpolated, outside the grid clamped to the end values.
    """

    layers: tuple[str, ...]
    grid: np.ndarray
    d_raw: np.ndarray
    d_repair: np.ndarray
    rr: np.ndarray
    n_weights: tuple[int, ...]
    n_images: int
    n_samples: tuple[int, ...]
    eps: float = 1e-12
    positions: int | None = None
    seed: int = 0
    #: With ``compute_rr_curves(output_moments=True)``: {layer: Moments of its dense
    #: output over every position of the ``n_images`` images} (the repairs' dense
    #: moments, from the same capture pass); not part of :meth:`to_dict`.
    output_moments: dict | None = None

    def get_index(self, layer: str) -> int:
        """Row of ``layer``; OnnxDiagError listing the layers otherwise."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise OnnxDiagError(f"No RR curve for layer {layer!r}; curves exist for (first 5 of "
                                f"{len(self.layers)}) {', '.join(self.layers[:5])}.") from None

    def rr_at(self, layer: str, s: float) -> float:
        """RR(layer, s), interpolated on the grid."""
        return float(np.interp(s, self.grid, self.rr[self.get_index(layer)]))

    def d_repair_at(self, layer: str, s: float) -> float:
        """D_repair(layer, s), interpolated on the grid."""
        return float(np.interp(s, self.grid, self.d_repair[self.get_index(layer)]))

    def d_raw_at(self, layer: str, s: float) -> float:
        """D_raw(layer, s), interpolated on the grid."""
        return float(np.interp(s, self.grid, self.d_raw[self.get_index(layer)]))

    def to_dict(self) -> dict:
        return {k: jsonable(getattr(self, k)) for k in (
            "layers", "grid", "d_raw", "d_repair", "rr", "n_weights", "n_images", "n_samples",
            "eps", "positions", "seed")}


def compute_rr_curves(model, layers, source, *, grid=DEFAULT_GRID, n_images: int = 64,
                      eps: float = 1e-12, providers=None, threads: int | None = None,
                      strategy: str = "auto", positions: int | str | None = DEFAULT_POSITIONS,
                      seed: int = 0, executor=None, label: str | None = None,
                      output_moments: bool = False) -> RRCurves:
    """RR curves of ``layers`` (prunable :class:`~onnxdiag.graph.Layer` records) (METHODS §C2).

    Args:
        model: the dense model (never modified); source: a DataSource (``batches()``) or
            an iterable of feed dicts; the first ``n_images`` samples are used.
        grid: sparsities (sorted, in [0, 1)); masks are :func:`magnitude_mask` at each s.
        positions: conv output positions per image whose patches enter the moments, or
            tokens per input of a linear layer (seeded draw, see the module docstring);
            None or "all": every position (exact).
        seed: seed of the position draw (image i's positions depend on (seed, i) only).
        executor: an :class:`onnxdiag.runtime.executor.Executor`: unless it runs
            ``in_process``, after the capture pass each layer's folding runs as one unit
            there (one Ray task per layer, its captured inputs shipped once); None (or an
            in-process one) folds batch by batch in this process. Same result.
        label: bars with an ETA (stderr, a terminal) of the planning, capture and layers.
        output_moments: also fold every non-head layer's dense *output* moments (all
            positions; ``RRCurves.output_moments``, None unless folded here) in the capture
            pass: the dense moments the cr / bn repairs need on the same images.

    Cost: one ONNX Runtime pass exposing the layers' inputs, then per batch and layer one
    im2col (of the sampled positions only) and either (``strategy``) ``incremental``: the
    removed weights' output grown level by level (sparse products adding up to one dense
    evaluation) with per-level moments, or ``gram``: the columns' (K × K) second moments,
    every level then being quadratic forms of the weights (exact, cheap for small
    K = C_in/groups·Πkernel).  ``auto`` picks per layer by an operation count
    (:func:`choose_strategy`).  With sampling, the Gram products run in float32 per batch
    and are merged in float64; with every position they stay float64 throughout.  The
    layers are planned, folded and finished on ``LAYER_THREADS`` threads; the capture's
    outputs are written into buffers reused from batch to batch
    (:class:`~onnxdiag.runtime.bound.BoundRunner`) when the layers are folded here.

    Raises:
        OnnxDiagError: an unknown strategy, bad positions, no layers; DataError: no
            samples; a failed layer unit: see :func:`~onnxdiag.runtime.executor.raise_failures`.
    """
    layers, grid, positions = _checked(layers, grid, strategy, positions)
    index = GraphIndex(model)
    here = executor is None or executor.in_process
    moment_layers = [la for la in layers if not la.is_head] if output_moments and here else []
    with thread_map(len(layers), LAYER_THREADS) as pool:
        plans = largest_first(pool, lambda la: _plan(index, la, grid, strategy, positions,
                                                      seed, n_images), layers, _weight_count,
                              label and f"{label}: plan")
        captured, seen, moments = capture(
            model, index, layers, plans, source, n_images, positions, seed,
            fold=pool if here else None, providers=providers, threads=threads, label=label,
            moment_layers=moment_layers)
        folded = largest_first(pool, finish_layer, plans, finish_cost, label and
                               f"{label}: layers") if here else None
    folded = folded or _fold_on(executor, layers, plans, captured, label)
    d_raw, d_rep = np.moveaxis(np.array([f[0] for f in folded]), -1, 0)
    return RRCurves(tuple(la.node_name for la in layers), grid, d_raw, d_rep,
                    (d_rep + eps) / (d_raw + eps), tuple(p["n"] for p in plans), seen,
                    tuple(f[1] for f in folded), eps, positions, int(seed),
                    moments if moment_layers else None)


def largest_first(pool, fn, items, cost, label=None) -> list:
    """``pool(fn, items)`` with the items handed to the threads in decreasing ``cost``
    (the longest-first schedule: a large layer taken last would leave the other threads
    idle while it runs); results in the order of ``items``."""
    items = list(items)
    order = sorted(range(len(items)), key=lambda i: -cost(items[i]))
    done = pool(fn, [items[i] for i in order], label)
    out = [None] * len(items)
    for i, r in zip(order, done):
        out[i] = r
    return out


def _weight_count(layer) -> int:
    """A layer's weight count (its planning cost: a selection and the steps over them)."""
    return int(np.prod(layer.weight_shape))


def _checked(layers, grid, strategy: str, positions) -> tuple[list, np.ndarray, int | None]:
    """(layers, sorted grid, positions) of :func:`compute_rr_curves`, or OnnxDiagError."""
    if strategy not in STRATEGIES:
        raise OnnxDiagError(f"Unknown RR strategy {strategy!r}; choose one of "
                            f"{', '.join(STRATEGIES)}.")
    positions = parse_positions(positions)
    layers = list(layers)
    if not layers:
        raise OnnxDiagError("No prunable layers to compute RR curves for.")
    return layers, np.asarray(sorted(float(s) for s in grid)), positions


def _plan(index, layer, grid, strategy, positions, seed, n_images=None) -> dict:
    """One layer's plan with its position draw (sampled Gram products in float32);
    ``n_images``: the images it will fold (for ``auto``'s strategy; None: unknown)."""
    sampled = positions is not None
    per_image = layer_positions(layer)
    n_samples = None if n_images is None or per_image is None else n_images * (
        per_image if positions is None else min(positions, per_image))
    plan = plan_layer(index, layer, grid, strategy,
                      gram_steps=np.float32 if sampled and GRAM_STEPS_FLOAT32 else np.float64,
                      n_samples=n_samples)
    plan["positions"], plan["seed"] = positions, int(seed)
    if plan["mode"] == "gram" and sampled:
        plan["gram_dtype"] = np.float32
    return plan


def _fold_on(executor, layers, plans, captured, label=None) -> list:
    """Each layer's folding as one unit of ``executor``; every layer is needed."""
    folded = [None] * len(plans)
    errors = {}
    for i, result, error in executor.map(layer_unit, list(zip(plans, captured)), (),
                                         label=label and f"{label}: layers"):
        if error is not None:
            errors[i] = error
        folded[i] = result
    if errors:
        first = min(errors)
        raise_failures([errors[i] for i in sorted(errors)],
                       f"RR curves of layer {layers[first].node_name}: {{first}}")
    return folded


def parse_positions(positions) -> int | None:
    """``positions`` as an int ≥ 1, or None for every position (None or "all")."""
    if positions is None or (isinstance(positions, str) and positions.strip().lower() == "all"):
        return None
    return positive_int(positions, f"RR positions must be a positive integer or 'all'; got "
                                   f"{positions!r}.")


def positive_int(value, message: str) -> int:
    """``value`` (an int, an integral float or a numeric string) as an int ≥ 1; otherwise
    OnnxDiagError(``message``)."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or (isinstance(value, float) and value != number):
        raise OnnxDiagError(message)
    return number
