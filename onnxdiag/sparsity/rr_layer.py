"""One layer's RR moments (docs/METHODS.md §C2): the plan of a prunable layer, its batches
folded into per-level moments, and D_raw / D_repair from them.

A plan (:func:`plan_layer`) holds the layer's op, its dense weights and, per grid level,
either the weights removed since the previous level (``incremental``: the removed
weights' output grown level by level) or the removed weight rows (``gram``: the columns'
second moments, every level then a quadratic form of the weights). :func:`fold_columns`
folds one batch of the layer's columns; :func:`finish_layer` returns the
distortions per level. Only per-channel moments are kept (memory O(|grid|·C)).
"""

from __future__ import annotations

import copy

import numpy as np
from scipy import sparse

from ..graph import GraphIndex
from .budget import prune_count
from .masks import magnitude_levels
from .offline import apply_columns, layer_columns, layer_op, weight_matrix
from .rr_strategy import choose_strategy


class PairMoments:
    """Streaming per-channel moments of a pair (a, b), each ``(n_samples, n_channels)``.

    Keeps n, means and centred sums Σaa, Σbb, Σab (Chan et al. pairwise update, float64),
    so the result does not depend on the batch split. ``s_pp``: the centred sums of
    p = a − b when known directly (the ``gram`` finish); None: Σaa − 2Σab + Σbb.
    """

    s_pp: np.ndarray | None = None

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
    var_p = np.maximum(var_d - 2 * cov_dr + var_r if acc.s_pp is None else acc.s_pp / n, 0.0)
    cov_dp = var_d - cov_dr
    alive = var_p > 1e-12 * var_d  # σ^p < 1e-6 σ^d: collapsed (rounding noise otherwise)
    ratio = np.sqrt(var_d) / np.sqrt(np.where(alive, var_p, 1.0))
    err = np.where(alive, 2 * var_d - 2 * ratio * cov_dp, var_d)
    repair = float(np.maximum(err, 0.0).sum())
    if total <= 0:
        return 0.0, 0.0
    return raw / total, repair / total


def finish_layer(plan: dict) -> tuple[list, int]:
    """(distortions per level, samples folded) of a layer whose batches are all folded."""
    if plan["mode"] == "gram":
        _finish_gram(plan)
        accs = plan["acc"]
    else:
        accs = _unshifted(plan)
    return [distortions(acc) for acc in accs], plan["acc"][0].n


def layer_unit(item) -> tuple[list, int]:
    """One layer as a unit of work: fold its captured batches of columns, then finish it.
    A plan marked ``unit_cuts`` (a conv with every position) gets its inputs instead and
    cuts the columns here, batch by batch (they are its input × taps / stride²)."""
    plan, batches = item
    plan = copy.deepcopy(plan)  # writable accumulators (Ray's arguments are read-only views)
    for cols in batches:
        if plan.get("unit_cuts"):  # im2col: a fresh array
            cols = layer_columns(plan["op"], np.asarray(cols), plan["kernel"])[0]
        fold_columns(plan, cols if cols.flags.writeable else np.array(cols), own=True)
    return finish_layer(plan)


def plan_layer(index: GraphIndex, layer, grid, strategy: str = "auto",
               gram_steps=np.float64, n_samples: int | None = None) -> dict:
    """Per layer: its op, dense matrix, the weights removed between consecutive grid points
    (sparse, rows = output channels, columns = column features), and accumulators; or, for
    the ``gram`` strategy, the removed weights per level and the column moments.
    ``gram_steps``: the dtype of a ``gram`` plan's sparse steps and so of its finish's
    products R_l Σ (float32: each step's product rounded to float32 before it is summed
    in float64); an ``incremental`` plan's steps are float32, as its columns.
    ``n_samples``: the rows the layer will fold (images × positions), for ``auto``'s
    choice (:func:`choose_strategy`; None: unknown)."""
    w = np.asarray(index.get_constant(layer.weight), dtype=np.float32)
    op = layer_op(index, layer)
    rows, cols, n_cols, walk = _flat_coordinates(op, w.shape)
    levels = removal_levels(w, grid)
    groups = op.groups if op.kind == "conv" else 1
    if strategy == "auto":
        strategy = choose_strategy(layer.n_out, n_cols // groups, groups, len(grid),
                                   n_samples)
    if strategy == "gram":
        return _gram_plan(op, w, levels, (rows, cols, walk), n_cols, groups, grid, layer.n_out,
                          gram_steps)
    steps = _steps(w.ravel(), rows, cols, walk, levels, len(grid), (layer.n_out, n_cols))
    return {"mode": "incremental", "op": op, "kernel": tuple(w.shape[2:]),
            "dense": weight_matrix(op, w), "steps": steps, "n": int(w.size),
            "acc": [PairMoments(layer.n_out) for _ in grid]}


def removal_levels(weight: np.ndarray, grid) -> np.ndarray:
    """Per flat weight, the first grid level whose magnitude mask removes it (``len(grid)``:
    never): the weight of keep-first rank r goes at level j when kept_j <= r < kept_(j-1),
    kept_j = size - prune_count(size, s_j) (the running minimum over the levels)
    (:func:`~onnxdiag.sparsity.masks.magnitude_levels`: a selection, not a sort)."""
    size = int(np.asarray(weight).size)
    kept = [size - prune_count(size, s) for s in grid]
    return magnitude_levels(weight, np.minimum.accumulate(np.asarray(kept, np.int64)))


def _gram_plan(op, w, levels, coords, n_cols, groups, grid, n_out, gram_steps) -> dict:
    """Dense per-channel weight rows (C, K) in column order and accumulators of the shifted
    column moments per group; the weights removed per level as sparse (C, K) steps (one
    group), or as dense removed rows (n_levels, C, K) for grouped convs (K small).
    ``levels``: per flat weight (:func:`removal_levels`); ``coords``: (rows, cols, walk)
    of :func:`_flat_coordinates`."""
    rows, cols, walk = coords
    k = n_cols // groups
    values = w.ravel().astype(np.float64)
    # row c holds output channel c's weights in column order: the weight itself, (C, K)
    dense = np.ascontiguousarray((values.reshape(w.shape[0], -1) if walk is None
                                  else values.reshape(w.shape).T).reshape(n_out, k))
    plan = {"mode": "gram", "op": op, "kernel": tuple(w.shape[2:]), "n": int(w.size),
            "groups": groups, "group_of": np.arange(n_out) // (n_out // groups),
            "dense_rows": dense, "shift": None,
            "gram": np.zeros((groups, k, k)), "sums": np.zeros((groups, k)), "count": 0,
            "acc": [PairMoments(n_out) for _ in grid]}
    if groups == 1:
        plan["steps"] = _steps(values.astype(gram_steps, copy=False), rows, cols, walk, levels,
                               len(grid), (n_out, k))
        return plan
    removed = np.zeros((len(grid), n_out, k))
    for j in range(len(grid)):
        gone = levels <= j
        removed[j, rows[gone], cols[gone] % k] = values[gone]
    plan["removed_rows"] = removed
    return plan


def _steps(values, rows, cols, walk, levels, n_levels: int, shape) -> list:
    """Per grid level, the weights removed at that level (:func:`removal_levels`) as a
    sparse (C, K) matrix in canonical form (columns sorted within each row, as SciPy
    builds it from coordinates), or None when that level removes nothing. ``values``,
    ``rows``, ``cols``, ``levels``: per flat weight; ``walk``: the flat weights in (row,
    column) order (None: flat order). One stable radix sort by level of the weights in
    that order splits them into the levels, each already sorted."""
    perm = (np.argsort(levels, kind="stable") if walk is None
            else walk[np.argsort(levels[walk], kind="stable")])
    bounds = np.concatenate([[0], np.cumsum(np.bincount(levels, minlength=n_levels + 1))])
    steps = []
    for j in range(n_levels):
        part = perm[bounds[j]:bounds[j + 1]]
        if part.size == 0:
            steps.append(None)
            continue
        indptr = np.concatenate([[0], np.cumsum(np.bincount(rows[part], minlength=shape[0]))])
        steps.append(sparse.csr_matrix((values[part], cols[part], indptr), shape=shape))
    return steps


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
    """Fill each level's PairMoments from the column covariance Σ and mean μ (METHODS §C2 moments
    of a = y^d = Wx and b = y^d − y^p = W_r x are quadratic forms: Var a = wᵀΣw, …), no pass
    over samples. One group: Cov(a, b) = rowsum(R_l ⊙ WΣ) summed level by level over the
    removed weights, and R_l Σ grown from the sparse steps (R_l = R_{l−1} + Δ_l, so
    R_l Σ = R_{l−1} Σ + Δ_l Σ: the removed weights times K in all, not levels·C·K²), then
    Var b = rowsum(R_l ⊙ R_l Σ); grouped convs: one batched (C, K) × (K, K) product per level
    and group."""
    n = plan["count"]
    g = plan["groups"]
    centred = plan["sums"] / n
    cov = plan["gram"] / n - np.einsum("gi,gj->gij", centred, centred)
    mean = centred + plan["shift"]
    w = plan["dense_rows"]
    c, k = w.shape
    wg = w.reshape(g, c // g, k)
    w_cov = wg @ cov  # (g, C/g, K): WΣ per group
    var_d = np.einsum("gok,gok->go", wg, w_cov).ravel()
    mean_a = np.einsum("gok,gk->go", wg, mean).ravel()
    if g == 1:
        levels = _levels_from_steps(plan["steps"], w, w_cov[0], var_d, cov[0], mean[0])
    else:
        rem = plan["removed_rows"].reshape(-1, g, c // g, k)
        srem = rem @ cov  # (levels, g, C/g, K)
        levels = zip(np.einsum("lgok,lgok->lgo", rem, srem).reshape(len(rem), c),
                     np.einsum("gok,lgok->lgo", wg, srem).reshape(len(rem), c),
                     np.einsum("lgok,gk->lgo", rem, mean).reshape(len(rem), c),
                     [None] * len(rem))
    for acc, (s_bb, s_ab, mean_b, s_pp) in zip(plan["acc"], levels):
        acc.n = n
        acc.s_aa = n * var_d
        acc.s_bb = n * s_bb
        acc.s_ab = n * s_ab
        acc.s_pp = None if s_pp is None else n * s_pp
        acc.mean_a = mean_a.copy()
        acc.mean_b = mean_b


def _levels_from_steps(steps, w, w_cov, var_d, cov, mean):
    """Per level (Var b, Cov(a, b), mean b, Var p) of one group: Cov(a, b) and mean b summed
    over each step's removed weights, R_l Σ grown from the steps' products Δ_l Σ,
    Var b = rowsum(R_l ⊙ R_l Σ). Var p = Cov(a, p) − rowsum(K_l ⊙ R_l Σ) with the kept
    weights K_l = W − R_l, and 0 for a channel with every weight removed (Var a −
    2 Cov(a, b) + Var b would leave the products' rounding there, which METHODS §C2's
    collapse test would read as a live channel). ``w_cov``: WΣ (C, K); ``var_d``: Var a."""
    c = w_cov.shape[0]
    removed = np.zeros_like(w_cov)
    kept = np.array(w, dtype=np.float64)
    n_kept = np.full(c, w.shape[1])
    r_cov = np.zeros_like(w_cov)  # R_l Σ
    s_ab = np.zeros(c)
    mean_b = np.zeros(c)
    cov_s = None
    for step in steps:
        if step is not None:
            if cov_s is None:  # Σ in the steps' dtype: float32 products summed in float64
                cov_s = cov.astype(step.dtype, copy=False)
            r_cov += step @ cov_s  # sparse × dense: nnz(Δ_l)·K
            coo = step.tocoo()
            data = coo.data.astype(np.float64)
            removed[coo.row, coo.col] = data
            kept[coo.row, coo.col] = 0.0
            n_kept -= np.bincount(coo.row, minlength=c)
            s_ab = s_ab + np.bincount(coo.row, data * w_cov[coo.row, coo.col], minlength=c)
            mean_b = mean_b + np.bincount(coo.row, data * mean[coo.col], minlength=c)
        var_p = np.where(n_kept > 0, var_d - s_ab - np.einsum("ck,ck->c", kept, r_cov), 0.0)
        yield np.einsum("ck,ck->c", removed, r_cov), s_ab.copy(), mean_b.copy(), var_p


def _flat_coordinates(op, shape) -> tuple:
    """(output channel, column feature) of every flat weight index (int32), the number of
    columns, and the flat indices in (row, column) order (None: flat order, all but an
    "io" linear layer, whose rows are the weight's columns)."""
    if op.kind == "linear":
        a = np.repeat(np.arange(shape[0], dtype=np.int32), shape[1])
        b = np.tile(np.arange(shape[1], dtype=np.int32), shape[0])
        if op.layout == "oi":
            return a, b, shape[1], None
        return b, a, shape[0], np.arange(a.size).reshape(shape).T.ravel()
    per = int(np.prod(shape[1:]))
    out = np.repeat(np.arange(shape[0], dtype=np.int32), per)
    cols = np.tile(np.arange(per, dtype=np.int32), shape[0])
    if op.groups > 1:
        cols += (out // (shape[0] // op.groups)) * per
    return out, cols, op.groups * per, None


def fold_columns(plan: dict, cols: np.ndarray, own: bool = False) -> None:
    """One batch of columns (m, groups, K): the ``gram`` moments, or y^d once and y^d − y^p
    (the removed weights' output) grown step by step over the grid, so all s together cost
    about one more dense evaluation. ``own``: ``cols`` is a scratch array that may be
    changed in place.

    The ``incremental`` products run on the columns less a shift (the first batch's
    column means, in the columns' float type): the moments' centred sums do not depend
    on it, and a layer whose output varies by less than float32's resolution of its mean
    (a head over near-constant features) keeps its variance; :func:`finish_layer` adds
    the shift's share back to the means."""
    if plan["mode"] == "gram":
        _fold_gram(plan, cols, own=own)
        return
    if plan.get("shift") is None:  # in the columns' own float type (float32 from ORT)
        dtype = cols.dtype if cols.dtype in (np.float32, np.float64) else np.float32
        plan["shift"] = cols.mean(axis=0, dtype=np.float64).astype(dtype)
    if own and cols.dtype == plan["shift"].dtype:
        cols = np.subtract(cols, plan["shift"], out=cols)
    else:
        cols = np.asarray(cols, plan["shift"].dtype) - plan["shift"]
    dense = centre_rows(apply_columns(cols, plan["dense"]).T)
    cols_t = np.ascontiguousarray(cols.reshape(cols.shape[0], -1).T)
    removed = np.zeros(dense[1].shape)  # (C, P) float64; exact 0 at s = 0
    for acc, step in zip(plan["acc"], plan["steps"]):
        if step is not None:
            removed += step @ cols_t
        acc.update_channels_first(dense, removed)


def _unshifted(plan: dict) -> list:
    """An ``incremental`` plan's moments with the means moved back by the shift's share
    (copies: the plan is left as folded): W·shift for y^d, R_l·shift for y^d − y^p
    (float64 products of the float32 weights and shift)."""
    shift = plan.get("shift")
    if shift is None:
        return plan["acc"]
    flat = shift.astype(np.float64)
    mean_a = apply_columns(flat[None], plan["dense"].astype(np.float64))[0]
    mean_b = np.zeros(len(mean_a))
    out = []
    for acc, step in zip(plan["acc"], plan["steps"]):
        if step is not None:
            mean_b = mean_b + step.astype(np.float64) @ flat.reshape(-1)
        moved = copy.copy(acc)
        moved.mean_a, moved.mean_b = acc.mean_a + mean_a, acc.mean_b + mean_b
        out.append(moved)
    return out
