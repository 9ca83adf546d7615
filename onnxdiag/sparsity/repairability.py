"""Relative repairability RR(ℓ, s) of every prunable layer (SPEC C2).

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

Position sampling (``positions``, **our default** 16 per image): a conv's moments are
taken over ``positions`` output positions per image drawn by
:func:`onnxdiag.stats.draw_positions` (a counter-based hash of (seed, image index, draw),
with replacement; the same positions for an image whatever batch it arrives in), and
only those positions' patches are gathered.  A layer whose output has at most
``positions`` positions per image, every linear layer, and ``positions=None`` / "all"
use every position (exact).  The sampled moments estimate the all-position ones; RR
is then a ratio of estimates (see benchmarks/sections/issue5_bench.md for the measured
error on the bundled model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import sparse

from ..errors import DataError, OnnxDiagError
from ..graph import GraphIndex
from ..graph._records import jsonable
from ..model.expose import expose_channels_last, expose_tensors
from ..runtime.runner import OrtRunner
from .budget import prune_count
from .masks import magnitude_order
from .offline import apply_columns, layer_op, sampled_columns, weight_matrix

#: SPEC C2 default grid: {0, 0.05, …, 0.9} ∪ {0.91, …, 0.99} (28 points).
DEFAULT_GRID = tuple(round(0.05 * i, 2) for i in range(19)) + tuple(
    round(0.91 + 0.01 * i, 2) for i in range(9))
#: Output positions per image sampled for a conv's moments (**our default**; None = all).
DEFAULT_POSITIONS = 16


@dataclass(frozen=True, eq=False)
class RRCurves:
    """RR curves of L layers on a grid of n_s sparsities.

    Fields: ``layers`` (L,) names; ``grid`` (n_s,); ``d_raw`` / ``d_repair`` / ``rr`` (L, n_s);
    ``n_weights`` (L,); ``n_images`` calibration images; ``n_samples`` (L,) rows (images ×
    positions) per layer; ``eps`` (SPEC C2's ε); ``positions`` output positions sampled per
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


class PairMoments:
    """Streaming per-channel moments of a pair (a, b), each ``(n_samples, n_channels)``.

    Keeps n, means and centred sums Σaa, Σbb, Σab (Chan et al. pairwise update, float64),
    so the result does not depend on the batch split.
    """

    def __init__(self, n_channels: int):
        self.n = 0
        self.mean_a = np.zeros(n_channels)
        self.mean_b = np.zeros(n_channels)
        self.s_aa = np.zeros(n_channels)
        self.s_bb = np.zeros(n_channels)
        self.s_ab = np.zeros(n_channels)

    def update(self, a: np.ndarray, b: np.ndarray) -> PairMoments:
        """Fold in a batch: ``a``, ``b`` of shape ``(n_samples, n_channels)``; returns self."""
        a_t = np.asarray(a, np.float64).T
        return self.update_channels_first(centre_rows(a_t), np.ascontiguousarray(
            np.asarray(b, np.float64).T))

    def update_channels_first(self, a_centred: tuple, b_t: np.ndarray) -> PairMoments:
        """Fold in a batch given as ``centre_rows(a.T)`` and ``b.T`` ``(n_channels, n)``.

        Lets one dense batch ``a`` be centred once and paired with many ``b``.
        """
        ma, ca, saa = a_centred
        m = ca.shape[1]
        if m == 0:
            return self
        mb = b_t.mean(axis=1)
        cb = b_t - mb[:, None]
        n = self.n + m
        da, db, w = ma - self.mean_a, mb - self.mean_b, self.n * m / n
        self.s_aa += saa + da * da * w
        self.s_bb += np.einsum("ij,ij->i", cb, cb) + db * db * w
        self.s_ab += np.einsum("ij,ij->i", ca, cb) + da * db * w
        self.mean_a += da * (m / n)
        self.mean_b += db * (m / n)
        self.n = n
        return self


def centre_rows(x_t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row means, centred rows, row sums of squares) of ``x_t`` ``(n_channels, n)``, float64."""
    x_t = np.asarray(x_t, np.float64)
    mean = x_t.mean(axis=1)
    centred = np.ascontiguousarray(x_t - mean[:, None])
    return mean, centred, np.einsum("ij,ij->i", centred, centred)


def distortions(acc: PairMoments) -> tuple[float, float]:
    """(D_raw, D_repair) from the moments of a = y^d and b = y^d − y^p (population moments)."""
    n = max(acc.n, 1)
    var_d, var_r, cov_dr = acc.s_aa / n, acc.s_bb / n, acc.s_ab / n
    total = float(var_d.sum())
    raw = float((var_r + acc.mean_b ** 2).sum())
    var_p = np.maximum(var_d - 2 * cov_dr + var_r, 0.0)
    cov_dp = var_d - cov_dr
    alive = var_p > 1e-12 * var_d  # σ^p < 1e-6 σ^d: collapsed (rounding noise otherwise)
    ratio = np.sqrt(var_d) / np.sqrt(np.where(alive, var_p, 1.0))
    err = np.where(alive, 2 * var_d - 2 * ratio * cov_dp, var_d)
    repair = float(np.maximum(err, 0.0).sum())
    if total <= 0:
        return 0.0, 0.0
    return raw / total, repair / total


def compute_rr_curves(model, layers, source, *, grid=DEFAULT_GRID, n_images: int = 64,
                      eps: float = 1e-12, providers=None, threads: int | None = None,
                      label: str | None = None, strategy: str = "auto",
                      positions: int | str | None = DEFAULT_POSITIONS, seed: int = 0,
                      executor=None) -> RRCurves:
    """RR curves of ``layers`` (prunable :class:`~onnxdiag.graph.Layer` records) (SPEC C2).

    Args:
        model: the dense model (never modified); source: a DataSource (``batches()``) or
            an iterable of feed dicts; the first ``n_images`` samples are used.
        grid: sparsities (sorted, in [0, 1)); masks are :func:`magnitude_mask` at each s.
        positions: conv output positions per image whose patches enter the moments
            (seeded draw, see the module docstring); None or "all": every position (exact).
        seed: seed of the position draw (image i's positions depend on (seed, i) only).
        executor: an :class:`onnxdiag.executor.Executor`: after the capture pass, each
            layer's folding runs as one unit there (one Ray task per layer, its captured
            inputs shipped once); None folds batch by batch in this process. Same result.

    Cost: one ONNX Runtime pass exposing the layers' inputs, then per batch and layer one
    im2col (of the sampled positions only) and either (``strategy``) ``incremental``: the
    removed weights' output grown level by level (sparse products adding up to one dense
    evaluation) with per-level moments, or ``gram``: the columns' (K × K) second moments,
    every level then being quadratic forms of the weights (exact, cheap for small
    K = C_in/groups·Πkernel).  ``auto`` picks per layer by an operation count
    (:func:`choose_strategy`).  With sampling, the Gram products run in float32 per batch
    and are merged in float64; with every position they stay float64 throughout.
    """
    if strategy not in STRATEGIES:
        raise OnnxDiagError(f"Unknown RR strategy {strategy!r}; choose one of "
                            f"{', '.join(STRATEGIES)}.")
    positions = parse_positions(positions)
    grid = np.asarray(sorted(float(s) for s in grid))
    layers = list(layers)
    if not layers:
        raise OnnxDiagError("No prunable layers to compute RR curves for.")
    index = GraphIndex(model)
    plans = [_plan(index, la, grid, strategy) for la in layers]
    for plan in plans:
        plan["positions"], plan["seed"] = positions, int(seed)
        if plan["mode"] == "gram" and positions is not None:
            plan["gram_dtype"] = np.float32
    inputs = list(dict.fromkeys(la.input for la in layers))
    exposed = [t for t in inputs if t not in index.inputs]
    capture = expose_tensors(model, exposed) if exposed else model
    if positions is not None:  # sampled convs gather C-vectors from a channels-last copy
        capture, last = expose_channels_last(
            capture, {la.input: len(la.kernel) + 2 for la in layers if la.op_type == "Conv"},
            tag="rr_channels_last")
    else:
        last = {}
    runner = OrtRunner(capture, providers=providers, threads=threads)
    fetch = exposed + list(last.values())
    captured: list[list] = [[] for _ in layers]
    seen = 0
    for feeds in _feed_batches(source, label):
        take = min(n_images - seen, _batch_len(feeds))
        if take <= 0:
            break
        feeds = {k: v[:take] for k, v in feeds.items()}
        outs = runner.run(feeds, fetch) if fetch else {}
        outs.update(feeds)
        images = np.arange(seen, seen + take)
        for i, (la, plan) in enumerate(zip(layers, plans)):
            if executor is None:
                _fold_layer(plan, outs[la.input], images, outs.get(last.get(la.input)))
            else:
                captured[i].append((outs[la.input], images, outs.get(last.get(la.input))))
        seen += take
    if seen == 0:
        raise DataError("The calibration data is empty; give at least one sample.")
    if executor is None:
        folded = [_finish_layer(plan) for plan in plans]
    else:
        folded = [None] * len(plans)
        for i, result, error in executor.map(_layer_unit, list(zip(plans, captured)), ()):
            if error is not None:
                raise OnnxDiagError(f"RR curves of layer {layers[i].node_name}: {error}")
            folded[i] = result
    d = np.array([f[0] for f in folded])
    d_raw, d_rep = d[..., 0], d[..., 1]
    return RRCurves(tuple(la.node_name for la in layers), grid, d_raw, d_rep,
                    (d_rep + eps) / (d_raw + eps), tuple(p["n"] for p in plans), seen,
                    tuple(f[1] for f in folded), eps, positions, int(seed))


def _finish_layer(plan: dict) -> tuple[list, int]:
    """(distortions per level, samples folded) of a layer whose batches are all folded."""
    if plan["mode"] == "gram":
        _finish_gram(plan)
    return [distortions(acc) for acc in plan["acc"]], plan["acc"][0].n


def _layer_unit(item) -> tuple[list, int]:
    """One layer as a unit of work: fold its captured batches, then finish it."""
    import copy

    plan, batches = item
    plan = copy.deepcopy(plan)  # writable accumulators (Ray's arguments are read-only views)

    def writable(a):
        return a if a is None or a.flags.writeable else np.array(a)

    for x, images, x_last in batches:
        _fold_layer(plan, writable(x), images, writable(x_last))
    return _finish_layer(plan)


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


STRATEGIES = ("auto", "incremental", "gram")
#: ``gram`` keeps groups·K² float64 per layer; above this many entries ``auto`` never picks it.
GRAM_MAX_ENTRIES = 4_000_000
#: Measured on 2 CPU cores (benchmarks/bench_rr.py): BLAS Gram work runs ~8x faster per
#: operation than the sparse increments and per-level moments.
GRAM_SPEED = 8


def choose_strategy(n_out: int, k: int, groups: int, n_levels: int) -> str:
    """``gram`` when its per-sample work groups·K² (a multi-threaded BLAS product) is at most
    ``GRAM_SPEED`` times the incremental one, n_out·(K + 3·n_levels) (single-threaded sparse
    products plus per-level moments), and its groups·K² accumulator fits GRAM_MAX_ENTRIES."""
    gram = groups * k * k
    if gram > GRAM_MAX_ENTRIES:
        return "incremental"
    return "gram" if gram <= GRAM_SPEED * n_out * (k + 3 * n_levels) else "incremental"


def _plan(index: GraphIndex, layer, grid, strategy: str = "auto") -> dict:
    """Per layer: its op, dense matrix, the weights removed between consecutive grid points
    (sparse, rows = output channels, columns = column features), and accumulators; or, for
    the ``gram`` strategy, the removed weights per level and the column moments."""
    w = np.asarray(index.get_constant(layer.weight), dtype=np.float32)
    op = layer_op(index, layer)
    order = magnitude_order(w)
    rows, cols, n_cols = _coordinates(op, w.shape, order)
    groups = op.groups if op.kind == "conv" else 1
    if strategy == "auto":
        strategy = choose_strategy(layer.n_out, n_cols // groups, groups, len(grid))
    if strategy == "gram":
        return _gram_plan(op, w, order, rows, cols, n_cols, groups, grid, layer.n_out)
    values = w.ravel()[order]
    steps, previous = [], w.size
    for s in grid:
        kept = w.size - prune_count(w.size, s)
        part = slice(kept, previous)
        steps.append(None if kept >= previous else sparse.csr_matrix(
            (values[part], (rows[part], cols[part])), shape=(layer.n_out, n_cols)))
        previous = min(previous, kept)
    return {"mode": "incremental", "op": op, "kernel": tuple(w.shape[2:]),
            "dense": weight_matrix(op, w), "steps": steps, "n": int(w.size),
            "acc": [PairMoments(layer.n_out) for _ in grid]}


def _gram_plan(op, w, order, rows, cols, n_cols, groups, grid, n_out) -> dict:
    """Dense per-channel weight rows (C, K) in column order, the removed rows per level
    (n_levels, C, K), float64; accumulators of the shifted column moments per group."""
    k = n_cols // groups
    dense = np.zeros((n_out, k))
    values = w.ravel()[order].astype(np.float64)
    dense[rows, cols % k] = values
    removed = np.zeros((len(grid), n_out, k))
    for j, s in enumerate(grid):
        kept = w.size - prune_count(w.size, s)
        removed[j, rows[kept:], cols[kept:] % k] = values[kept:]
    return {"mode": "gram", "op": op, "kernel": tuple(w.shape[2:]), "n": int(w.size),
            "groups": groups, "group_of": np.arange(n_out) // (n_out // groups),
            "dense_rows": dense, "removed_rows": removed, "shift": None,
            "gram": np.zeros((groups, k, k)), "sums": np.zeros((groups, k)), "count": 0,
            "acc": [PairMoments(n_out) for _ in grid]}


def _fold_gram(plan: dict, cols: np.ndarray, own: bool = False) -> None:
    """One batch of columns (m, groups, K): Σ (col − shift)(col − shift)ᵀ per group (a
    symmetric BLAS product in ``plan["gram_dtype"]``, merged into float64) and column sums;
    the shift (the first batch's column means) keeps the final subtraction well conditioned.
    ``own``: ``cols`` is a scratch array that may be shifted in place."""
    dtype = plan.get("gram_dtype", np.float64)
    if plan["shift"] is None:
        plan["shift"] = cols.mean(axis=0, dtype=np.float64)
    if own and cols.dtype == dtype:
        c = np.subtract(cols, plan["shift"].astype(dtype), out=cols)
    else:
        c = np.asarray(cols, dtype=dtype) - plan["shift"].astype(dtype)
    if plan["groups"] == 1:
        c0 = c[:, 0, :]
        plan["gram"][0] += c0.T @ c0  # A.T @ A: NumPy uses the symmetric rank-k update
    else:
        ct = c.transpose(1, 0, 2)
        plan["gram"] += np.matmul(ct.transpose(0, 2, 1), ct)
    plan["sums"] += (np.ones(c.shape[0], dtype) @ c.reshape(c.shape[0], -1)).reshape(
        plan["sums"].shape)  # a BLAS product: faster than sum(axis=0), same precision
    plan["count"] += c.shape[0]


def _finish_gram(plan: dict) -> None:
    """Fill each level's PairMoments from the column covariance Σ and mean μ (SPEC C2 moments
    of a = y^d = Wx and b = y^d − y^p = W_r x are quadratic forms: Var a = wᵀΣw, …): per
    level one batched (C, K) × (K, K) product per group, O(C·K²), no pass over samples."""
    n = plan["count"]
    g = plan["groups"]
    centred = plan["sums"] / n
    cov = plan["gram"] / n - np.einsum("gi,gj->gij", centred, centred)
    mean = centred + plan["shift"]
    w = plan["dense_rows"]
    c, k = w.shape
    wg = w.reshape(g, c // g, k)
    var_d = np.einsum("gok,gok->go", wg, wg @ cov).ravel()
    mean_a = np.einsum("gok,gk->go", wg, mean).ravel()
    rem = plan["removed_rows"].reshape(-1, g, c // g, k)
    srem = rem @ cov  # (levels, g, C/g, K)
    s_bb = np.einsum("lgok,lgok->lgo", rem, srem).reshape(len(rem), c)
    s_ab = np.einsum("gok,lgok->lgo", wg, srem).reshape(len(rem), c)
    mean_b = np.einsum("lgok,gk->lgo", rem, mean).reshape(len(rem), c)
    for j, acc in enumerate(plan["acc"]):
        acc.n = n
        acc.s_aa = n * var_d
        acc.s_bb = n * s_bb[j]
        acc.s_ab = n * s_ab[j]
        acc.mean_a = mean_a.copy()
        acc.mean_b = mean_b[j]


def _coordinates(op, shape, flat) -> tuple[np.ndarray, np.ndarray, int]:
    """(output channel, column feature) of flat weight indices, and the number of columns."""
    if op.kind == "linear":
        a, b = np.divmod(flat, shape[1])
        return (a, b, shape[1]) if op.layout == "oi" else (b, a, shape[0])
    per = int(np.prod(shape[1:]))
    out, k = np.divmod(flat, per)
    return out, (out // (shape[0] // op.groups)) * per + k, op.groups * per


def _fold_layer(plan: dict, x: np.ndarray, images: np.ndarray,
                x_last: np.ndarray | None = None) -> None:
    """One batch (``images``: the batch's global image indices, for the position draw):
    the (sampled) columns, then the ``gram`` moments, or y^d once and y^d − y^p (the removed
    weights' output) grown step by step over the grid, so all s together cost about one
    more dense evaluation."""
    cols = sampled_columns(plan["op"], x, plan["kernel"], plan["positions"],
                           seed=plan["seed"], sample_indices=images, x_last=x_last)
    if plan["mode"] == "gram":
        # Shift in place only a scratch array: never a (read-only) view of the captured
        # inputs, which other layers reading the same tensor still need.
        own = (cols.flags.writeable and not np.may_share_memory(cols, x)
               and (x_last is None or not np.may_share_memory(cols, x_last)))
        _fold_gram(plan, cols, own=own)
        return
    dense = centre_rows(apply_columns(cols, plan["dense"]).T)
    cols_t = np.ascontiguousarray(cols.reshape(cols.shape[0], -1).T)
    removed = np.zeros(dense[1].shape)  # (C, P) float64; exact 0 at s = 0
    for acc, step in zip(plan["acc"], plan["steps"]):
        if step is not None:
            removed += step @ cols_t
        acc.update_channels_first(dense, removed)


def _feed_batches(source, label):
    if hasattr(source, "batches"):
        for batch in source.batches():
            yield batch.feeds
    else:
        yield from source


def _batch_len(feeds: dict) -> int:
    return int(next(iter(feeds.values())).shape[0])
