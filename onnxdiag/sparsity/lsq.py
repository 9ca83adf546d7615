"""Least-squares reconstruction of one pruned layer (docs/METHODS.md §E1), in NumPy.

A layer computes y = W x + b, x a column of its input (a conv's im2col patch, C_in/g·k·k
values per group; a linear layer's input row, every leading axis a position). On the
calibration data the layer's input in the dense model is x_d and, with the upstream layers
pruned and repaired, x_p. :class:`TargetMoments` streams, per group, the float64 sums the
row solves read (mergeable: the result does not depend on the batch split).

Per output row i with kept support S_i (the mask), with H_pp = E[x_p x_pᵀ],
H_pd = E[x_p x_dᵀ] and the ridge λ = ridge · mean diag(H_pp) (**our default** ridge 0.01):
(the solves read H_pd only through H_pd w_i = E[x_p y_d,i], y_d = W x_d the dense layer's
output before its bias: :class:`TargetMoments` streams that K × C_out product directly,
a factor K / C_out fewer FLOPs than the K × K cross Gram x_p x_dᵀ)

- ``prior="weights"`` (**our default**): w'_S = (H_pp[S,S] + λI)⁻¹ (H_pd[S,:] w_i + λ w_i,S),
  the ridge pulling toward the layer's own kept weights, so that with nothing pruned
  (x_p = x_d, S = everything) the repair is the identity;
- ``prior="zero"``: w'_S = (H_pp[S,S] + λI)⁻¹ H_pd[S,:] w_i (ridge toward zero: it shrinks
  every weight a little even when nothing was pruned);

then b'_i = b_i + E[w_iᵀ x_d] − E[w'_iᵀ x_p]. Exact per-row solves cost Σ_i |S_i|³;
above ``exact_max`` the layer uses the one-sweep column update of SparseGPT
(:func:`sparsegpt_rows`), an approximation the layer's record names.
"""

from __future__ import annotations

import numpy as np

RIDGE = 0.01
PRIORS = ("weights", "zero")
#: Σ_i |S_i|³ above which a layer's rows are solved by the SparseGPT sweep (**our default**).
EXACT_MAX = 1e9


class TargetMoments:
    """Float64 sums of one layer's pruned input columns x_p against the dense layer's
    outputs y_d = W x_d (before the bias), per group: Σ x_p, Σ x_p x_pᵀ, Σ x_p y_dᵀ,
    Σ y_d and Σ y_d² — what the row solves read (:meth:`row_moments`), without the
    K × K cross Gram. ``update(cols_p, y_d)``: columns ``(m, groups, K)``, outputs
    ``(m, groups, rows per group)``; ``y_d`` None: the input no pruning reached
    (x_p = x_d), whose projections are taken from H_pp in float64 when solving.
    ``per`` = 0: an accumulator for x_p = x_d only (inputs shared by layers of
    different widths). Products in ``dtype`` (float32), summed into float64; the sums
    merge, so the result does not depend on the batch split.
    """

    def __init__(self, groups: int, k: int, per: int, dtype=np.float32):
        self.n = 0
        self.dtype = dtype
        self.same = True
        self.sum_p = np.zeros((groups, k))
        self.pp = np.zeros((groups, k, k))
        self.py = np.zeros((groups, k, per))
        self.sum_y = np.zeros((groups, per))
        self.yy = np.zeros((groups, per))

    def update(self, cols_p: np.ndarray, y_d: np.ndarray | None) -> TargetMoments:
        cp = np.asarray(cols_p, self.dtype)
        ones = np.ones(cp.shape[0], self.dtype)
        self.same = self.same and y_d is None
        for g in range(cp.shape[1]):
            a = cp[:, g, :]
            self.pp[g] += a.T @ a
            self.sum_p[g] += ones @ a
            if y_d is not None:
                y = np.asarray(y_d[:, g, :], self.dtype)
                self.py[g] += a.T @ y
                self.sum_y[g] += ones @ y
                self.yy[g] += np.einsum("ij,ij->j", y, y, dtype=np.float64)
        self.n += cp.shape[0]
        return self

    def update_gram(self, n: int, sums: np.ndarray, gram: np.ndarray) -> TargetMoments:
        """Add one batch of ``n`` columns of a one-group input no pruning reached (x_p =
        x_d) from their sums (K,) and Gram (K, K), computed elsewhere (float32)."""
        self.pp[0] += gram
        self.sum_p[0] += sums
        self.n += n
        return self

    def merge(self, other: TargetMoments) -> TargetMoments:
        for name in ("sum_p", "pp", "py", "sum_y", "yy"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.same = self.same and other.same
        self.n += other.n
        return self

    def row_moments(self, g: int, w: np.ndarray) -> tuple:
        """What the row solves of group ``g``'s rows ``w`` (rows, K) read: (H_pp,
        H_pd wᵀ (K, rows), μ_p, W μ_d (rows,)); ``w`` is used only when x_p = x_d."""
        n = max(self.n, 1)
        h_pp, mu_p = self.pp[g] / n, self.sum_p[g] / n
        if self.same:
            w = np.asarray(w, np.float64)
            return h_pp, h_pp @ w.T, mu_p, w @ mu_p
        return h_pp, self.py[g] / n, mu_p, self.sum_y[g] / n

    def output_sq(self, g: int, w: np.ndarray) -> np.ndarray:
        """E[y_d,i²] per row of group ``g`` (``w`` its rows, read when x_p = x_d)."""
        if self.same:
            w = np.asarray(w, np.float64)
            return np.sum((w @ (self.pp[g] / max(self.n, 1))) * w, axis=1)
        return self.yy[g] / max(self.n, 1)


def ridge_of(h_pp: np.ndarray, ridge: float = RIDGE) -> float:
    """λ = ridge · mean diag(H_pp) (a tiny floor keeps an all-zero input solvable)."""
    return float(ridge * np.mean(np.diag(h_pp))) + 1e-12


def exact_work(mask: np.ndarray) -> float:
    """Σ_i |S_i|³ of a (rows, K) mask: the cost of the exact per-row solves."""
    return float(np.sum(np.sum(mask, axis=1, dtype=np.float64) ** 3))


def solve_rows(w: np.ndarray, mask: np.ndarray, h_pp: np.ndarray, hw: np.ndarray,
               lam: float, prior: str = "weights") -> np.ndarray:
    """Exact per-row solves: ``w`` (rows, K) dense weights, ``mask`` (rows, K) kept,
    ``hw`` = H_pd wᵀ (K, rows); returns w' (rows, K) float64, zero off the support."""
    w = np.asarray(w, np.float64)
    mask = np.asarray(mask, bool)
    rhs = _rhs(w, mask, hw, lam, prior)  # (rows, K)
    out = np.zeros_like(w)
    sizes = mask.sum(axis=1)
    order = np.argsort(sizes, kind="stable")
    order = order[sizes[order] > 0]
    start = 0
    while start < order.size:  # rows of similar support size, solved as one batch
        end = start + 1
        while end < order.size and (end + 1 - start) * sizes[order[end]] ** 2 <= SOLVE_BATCH:
            end += 1
        _solve_batch(out, order[start:end], mask, h_pp, rhs, lam, int(sizes[order[end - 1]]))
        start = end
    return out


#: Matrix entries per batch of padded row systems in :func:`solve_rows` (32 MB of float64).
SOLVE_BATCH = 4 * 2 ** 20


def _solve_batch(out, rows, mask, h_pp, rhs, lam, size) -> None:
    """Solve ``rows``' systems (H_pp[S,S] + λI) w'_S = rhs_S at once, each padded to
    ``size`` with an identity block (block diagonal: the padded solution is exact, 0)."""
    support = np.argsort(~mask[rows], axis=1, kind="stable")[:, :size]  # S_i first, in order
    valid = np.take_along_axis(mask[rows], support, axis=1)
    a = h_pp[support[:, :, None], support[:, None, :]]
    a = np.where(valid[:, :, None] & valid[:, None, :], a, 0.0)
    diag = np.arange(size)
    a[:, diag, diag] += np.where(valid, lam, 1.0)
    b = np.where(valid, np.take_along_axis(rhs[rows], support, axis=1), 0.0)
    x = np.linalg.solve(a, b[..., None])[..., 0]
    r, c = np.nonzero(valid)
    out[rows[r], support[r, c]] = x[r, c]


def sparsegpt_rows(w: np.ndarray, mask: np.ndarray, h_pp: np.ndarray, hw: np.ndarray,
                   lam: float, prior: str = "weights") -> np.ndarray:
    """The one-sweep approximation (SparseGPT's OBS column sweep for a fixed mask).

    The objective E[(w'ᵀx_p − wᵀx_d)²] + λ‖w' − w_S‖² equals (w' − w̃)ᵀA(w' − w̃) + const
    with A = H_pp + λI and w̃ = A⁻¹(H_pd w + λ w_S) the unconstrained optimum. Starting from
    w̃, columns are eliminated left to right: a pruned entry's error e = w_ij / U_jj moves
    onto the later columns of its row (w_i,j: −= e·U_j,j:), U the upper Cholesky factor of
    A⁻¹. Exact when nothing is pruned (w' = w̃) and for a row whose pruned entries all come
    before its kept ones; otherwise earlier kept columns never readjust, which is the
    approximation (measured in docs/METHODS.md §E1). Cost O(rows·K²) for any mask.
    ``hw`` = H_pd wᵀ (K, rows).
    """
    w = np.asarray(w, np.float64)
    k = w.shape[1]
    a = h_pp + lam * np.eye(k)
    cur = np.linalg.solve(a, _rhs(w, np.ones_like(mask), hw, lam, prior,
                                  prior_mask=mask).T).T
    u = np.linalg.cholesky(np.linalg.inv(a)).T  # A⁻¹ = Uᵀ U, U upper
    for j in range(k):
        drop = ~mask[:, j]
        if not drop.any():
            continue
        err = cur[drop, j] / u[j, j]
        cur[np.ix_(drop, np.arange(j, k))] -= np.outer(err, u[j, j:])
        cur[drop, j] = 0.0
    return np.where(mask, cur, 0.0)


def _rhs(w, mask, hw, lam, prior, prior_mask=None) -> np.ndarray:
    """H_pd w_i (+ λ w_i,S for the ``weights`` prior), per row: (rows, K)."""
    rhs = np.asarray(hw, np.float64).T  # row i: (H_pd w_i)ᵀ
    if prior == "weights":
        keep = mask if prior_mask is None else prior_mask
        rhs = rhs + lam * np.where(keep, w, 0.0)
    elif prior != "zero":
        raise ValueError(f"prior must be one of {PRIORS}")
    return rhs


def reconstruct_rows(w: np.ndarray, mask: np.ndarray, moments: tuple, *, ridge: float = RIDGE,
                     prior: str = "weights", exact_max: float = EXACT_MAX,
                     method: str = "auto") -> tuple[np.ndarray, str, float]:
    """(w' (rows, K) float64, the solver used ("exact" / "sparsegpt"), λ) for one group.

    ``moments``: (H_pp, H_pd wᵀ, μ_p, W μ_d) (``row_moments``); ``method``: "auto"
    (exact up to ``exact_max`` Σ|S_i|³, else SparseGPT), "exact" or "sparsegpt".
    """
    h_pp, hw = moments[0], moments[1]
    lam = ridge_of(h_pp, ridge)
    if method == "auto":
        method = "exact" if exact_work(mask) <= exact_max else "sparsegpt"
    solver = solve_rows if method == "exact" else sparsegpt_rows
    return solver(w, mask, h_pp, hw, lam, prior), method, lam


def output_errors(w: np.ndarray, w_new: np.ndarray, w_masked: np.ndarray, b: np.ndarray,
                  moments: tuple, yd_sq: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                               np.ndarray, np.ndarray]:
    """Per row (new bias b', E‖y_repaired − y_d‖², E‖y_unrepaired − y_d‖², E‖y_d‖²) from the
    ``row_moments`` of ``w`` (quadratic forms; ``yd_sq`` = E[(w_iᵀx_d)²] measured directly)."""
    h_pp, hw, mu_p, my = moments
    shift = my - w_new @ mu_p
    err_new = _sq_err(w_new, h_pp, hw, yd_sq, mu_p, my, shift)
    err_old = _sq_err(w_masked, h_pp, hw, yd_sq, mu_p, my, np.zeros_like(shift))
    dense = yd_sq + 2 * b * my + b * b
    return b + shift, np.maximum(err_new, 0.0), np.maximum(err_old, 0.0), dense


def _sq_err(a, h_pp, hw, yd_sq, mu_p, my, delta) -> np.ndarray:
    """E[(aᵀx_p − y_d + δ)²] per row (y_d = w_iᵀx_d; ``hw`` = H_pd wᵀ, ``my`` = E[y_d])."""
    # two matrix products, not a three-operand einsum (which loops: 4x the whole LS fit)
    quad = np.sum((a @ h_pp) * a, axis=1) - 2 * np.sum(a * hw.T, axis=1)
    return quad + yd_sq + 2 * delta * (a @ mu_p - my) + delta * delta
