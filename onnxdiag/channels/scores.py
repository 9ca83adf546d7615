"""METHODS Part B: two axes of channel information from accumulated moments.  Pure NumPy/SciPy.

Inputs are one layer's finalised, unbiased (ddof=1) moments of the pre-BN Conv output (METHODS §B1):
``cov_yy`` (n_channels, n_channels), and for the target axis ``cov_yt`` (n_channels,) and ``var_t``.
Nothing here sees a sample, so memory and time are O(C²) per layer (C up to ~512 is instant).

Our conventions where METHODS §B2-B3 leave a detail open (echoed in ``ChannelScores.params``):
- Correlation: rho_ij = S_ij / (s_i s_j) with s_i = sqrt(max(S_ii, guard)); a dead channel has
  rho = 0 with everything.  Every rho-based score (R, R², I(T;Y), pair information) uses rho
  clipped to ±rho_clip so exact duplicates give finite logs (an exact duplicate's R² is then
  ≈ 0.997, not 1).
- Peers / partners of i: the j != i ordered by unclipped |rho_ij| descending, ties by lower index;
  k = min(k_peers, C-1) peers for R², min(syn_partners, C-1) partners for Syn / Red_T.
- Pair information is evaluated in correlation form, ½ ln(det R_ij / det R_Tij) with the ridge on
  the unit diagonal: the covariance form of METHODS §B3 with the scales cancelled, hence
  exactly invariant
  under per-channel affine maps (so are R̄_X, R², I(T;Y), Syn, Red_T; I_X and J are not).
- Substitution coefficients (:func:`peer_regression`, B5) solve the same ridge on the UNCLIPPED
  correlations and map back to y units: beta_j = gamma_j s_i / s_j, a = mu_i - sum_j beta_j mu_j,
  so an exact linear duplicate is reproduced exactly at ridge 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from ..errors import DataError

GUARD = 1e-12
PAIR_RIDGE = 1e-10  # METHODS §B3: ridge on the pair determinants
RQ_EPS = 1e-10  # METHODS §B2: RQ_i = J_i / (|w_i|² + 1e-10)

SCORES: dict[str, str] = {
    "signal_power": "J_i = Var(y_i) = w_i' S_X w_i (B2)",
    "rayleigh_quotient": "RQ_i = J_i / (|w_i|^2 + 1e-10) (B2; needs weight)",
    "input_capture": "I_X(i) = 1/2 ln(1 + J_i / sigma0^2), sigma0^2 = median J (B2)",
    "peer_overlap": "R_X(i) = (1/C) sum_{j!=i} -1/2 ln(1 - rho_ij^2) (B2)",
    "peer_r2": "R2_i = rho_iP' (R_PP + ridge I)^-1 rho_iP over k peers, in [0, 1] (B2)",
    "task_corr": "rho_{T,i}, signed correlation with the target (B3)",
    "task_info": "I(T;Y_i) = max(0, -1/2 ln(1 - rho_{T,i}^2)) (B3)",
    "synergy": "Syn(i) = mean of the top syn_top Syn_ij over syn_partners partners (B3)",
    "redundancy": "Red_T(i) = mean of min(I_i, I_j) over the same partners (B3)",
}
LOCAL_SCORES = ("signal_power", "rayleigh_quotient", "input_capture", "peer_overlap", "peer_r2")
TARGET_SCORES = ("task_corr", "task_info", "synergy", "redundancy")


@dataclass(frozen=True, eq=False)
class ChannelScores:
    """Per-channel scores of one layer (METHODS §B2-B3).

    ``scores`` maps names (keys of SCORES) to ``(n_channels,)`` float64 arrays;
    ``rayleigh_quotient`` needs ``weight``, the target scores need ``cov_yt``/``var_t``.
    ``peers`` ``(n_channels, k)`` are each channel's R² peers, most correlated first;
    ``peer_beta`` ``(n_channels, k)`` the substitution coefficients in y units and
    ``peer_intercept`` ``(n_channels,)`` the intercept (None without ``mean_y``), so that
    y_i ≈ peer_intercept[i] + peer_beta[i] @ y[peers[i]] (B5).  ``params`` echoes every setting.
    """

    layer: str
    n_channels: int
    scores: dict[str, np.ndarray]
    peers: np.ndarray
    peer_beta: np.ndarray
    peer_intercept: np.ndarray | None
    params: dict = field(default_factory=dict)

    @property
    def has_target(self) -> bool:
        return "task_info" in self.scores

    def to_dict(self) -> dict:
        """Builtins only (non-finite floats become None): JSON-safe."""
        return {
            "layer": self.layer,
            "n_channels": self.n_channels,
            "params": dict(self.params),
            "scores": {name: _json_list(v) for name, v in self.scores.items()},
            "peers": self.peers.tolist(),
            "peer_beta": _json_list(self.peer_beta),
            "peer_intercept": None if self.peer_intercept is None
            else _json_list(self.peer_intercept),
        }

    def to_rows(self) -> list[dict]:
        """One dict per channel: ``layer``, ``channel`` and every score (for CSV / tables)."""
        rows = []
        for c in range(self.n_channels):
            row: dict = {"layer": self.layer, "channel": c}
            row.update({name: _json_float(v[c]) for name, v in self.scores.items()})
            rows.append(row)
        return rows


def _json_float(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _json_list(a) -> list:
    a = np.asarray(a, dtype=np.float64)
    return [_json_list(r) for r in a] if a.ndim > 1 else [_json_float(x) for x in a]


def _as_cov(cov_yy) -> np.ndarray:
    cov = np.asarray(cov_yy, dtype=np.float64)
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1] or cov.shape[0] < 2:
        raise ValueError(f"cov_yy must be (C, C) with C >= 2, got shape {cov.shape}")
    return cov


def channel_std(cov_yy: np.ndarray, guard: float = GUARD) -> np.ndarray:
    """``(C,)`` guarded standard deviations s_i = sqrt(max(S_ii, guard))."""
    return np.sqrt(np.maximum(np.diag(cov_yy), guard))


def correlation_matrix(cov_yy, *, guard: float = GUARD, rho_clip: float | None = None):
    """``(C, C)`` correlation from a covariance (METHODS §B2), unit diagonal.

    Off-diagonals are clipped to ``±rho_clip`` when given; a channel with variance
    below ``guard`` is uncorrelated with every other.
    """
    cov = _as_cov(cov_yy)
    std = channel_std(cov, guard)
    corr = cov / np.outer(std, std)
    if rho_clip is not None:
        corr = np.clip(corr, -rho_clip, rho_clip)
    np.fill_diagonal(corr, 1.0)
    return corr


def rank_peers(corr: np.ndarray, n_peers: int) -> np.ndarray:
    """``(C, min(n_peers, C-1))`` int64: for each i, the j != i by |rho_ij| descending.

    Ties go to the lower index (stable sort), so the ranking is deterministic.
    """
    key = -np.abs(np.asarray(corr, dtype=np.float64))  # ascending key = descending |rho|
    np.fill_diagonal(key, np.inf)
    c = key.shape[0]
    n = max(min(int(n_peers), c - 1), 0)
    if n == 0 or 4 * n >= c:
        return np.argsort(key, axis=1, kind="stable")[:, :n]
    # a selection, then a sort of the n selected: the n-th smallest key t of each row; the
    # keys below t and the lowest-indexed ones equal to t are its n peers. A row with more
    # keys equal to t than the selection kept (ties across the cut) is sorted whole.
    part = np.argpartition(key, n - 1, axis=1)[:, :n]
    picked = np.take_along_axis(key, part, axis=1)
    t = picked.max(axis=1, keepdims=True)
    ties = np.count_nonzero(key == t, axis=1) != np.count_nonzero(picked == t, axis=1)
    part.sort(axis=1)  # index order, so the stable sort below breaks ties by index
    order = np.argsort(np.take_along_axis(key, part, axis=1), axis=1, kind="stable")
    out = np.take_along_axis(part, order, axis=1)
    if ties.any():
        out[ties] = np.argsort(key[ties], axis=1, kind="stable")[:, :n]
    return out


def ridge_gamma(corr: np.ndarray, peers: np.ndarray, ridge: float,
                rows: np.ndarray | None = None) -> np.ndarray:
    """``(n, k)`` standardised ridge coefficients gamma_i = (R_PP + ridge I)^-1 rho_iP (B2).

    ``peers`` is ``(n, k)``, one row per channel in ``rows`` (default: all C channels).
    The n systems are solved in one batched call; with ``ridge == 0`` (or a singular
    system) the minimum-norm solution (pseudo-inverse) keeps duplicate peers harmless.
    """
    rows = np.arange(corr.shape[0]) if rows is None else np.asarray(rows)
    r_pp = corr[peers[:, :, None], peers[:, None, :]] + ridge * np.eye(peers.shape[1])
    r_ip = corr[rows[:, None], peers][..., None]
    if ridge > 0:
        try:
            return np.linalg.solve(r_pp, r_ip)[..., 0]
        except np.linalg.LinAlgError:  # clipped correlations can be (rarely) indefinite
            pass
    return (np.linalg.pinv(r_pp) @ r_ip)[..., 0]


def peer_coefficients(cov_yy, mean_y, peers: np.ndarray, ridge: float = 1e-3, *,
                      rows: np.ndarray | None = None, guard: float = GUARD):
    """Substitution coefficients in y units for channels ``rows`` (default all) (METHODS §B5).

    Args:
        cov_yy: ``(C, C)`` covariance; mean_y: ``(C,)`` means or None.
        peers: ``(n, k)`` peer indices per channel of ``rows``.
    Returns:
        ``beta (n, k)`` and ``intercept (n,)`` (None without ``mean_y``), from the ridge on
        unclipped correlations: beta_j = gamma_j s_i / s_j, a = mu_i - sum_j beta_j mu_j.
    """
    cov = _as_cov(cov_yy)
    rows = np.arange(cov.shape[0]) if rows is None else np.asarray(rows)
    std = channel_std(cov, guard)
    gamma = ridge_gamma(correlation_matrix(cov, guard=guard), peers, ridge, rows)
    beta = gamma * std[rows][:, None] / std[peers]
    if mean_y is None:
        return beta, None
    mean_y = np.asarray(mean_y, dtype=np.float64)
    return beta, mean_y[rows] - (beta * mean_y[peers]).sum(axis=1)


def peer_regression(cov_yy, mean_y, i: int, k: int = 10, ridge: float = 1e-3, *,
                    guard: float = GUARD) -> tuple[np.ndarray, np.ndarray, float]:
    """Ridge reconstruction of channel ``i`` from its ``k`` peers in y units (METHODS §B2/B5).

    Args:
        cov_yy: ``(C, C)`` covariance; mean_y: ``(C,)`` means; i: the channel.
        k, ridge: peers (most |rho|-correlated first) and the ridge in correlation units.
    Returns:
        ``(peers (k,), beta (k,), intercept)`` with y_i ≈ intercept + beta @ y[peers].
        Unclipped correlations (module docstring): with ``ridge=0`` an exact linear
        duplicate among the peers is reproduced exactly.
    """
    cov = _as_cov(cov_yy)
    peers = rank_peers(correlation_matrix(cov, guard=guard), k)[i : i + 1]
    beta, intercept = peer_coefficients(cov, mean_y, peers, ridge, rows=np.array([i]),
                                        guard=guard)
    return peers[0], beta[0], float(intercept[0])


def task_correlation(cov_yy, cov_yt, var_t: float, *, rho_clip: float = 0.999,
                     guard: float = GUARD) -> np.ndarray:
    """``(C,)`` rho_{T,i} = cov(y_i, T) / (s_i s_T), clipped to ±rho_clip (METHODS §B3).

    Raises DataError when the target is constant (var_t <= guard).
    """
    cov = _as_cov(cov_yy)
    cov_yt = np.asarray(cov_yt, dtype=np.float64).reshape(-1)
    if cov_yt.shape != (cov.shape[0],):
        raise ValueError(f"cov_yt must be ({cov.shape[0]},), got {cov_yt.shape}")
    if not float(var_t) > guard:
        raise DataError(f"The target T is constant (variance {var_t!r}); task information "
                        "needs a target that varies over the calibration images.")
    rho = cov_yt / (channel_std(cov, guard) * math.sqrt(float(var_t)))
    return np.clip(rho, -rho_clip, rho_clip)


def gaussian_information(rho: np.ndarray) -> np.ndarray:
    """I = max(0, -1/2 ln(1 - rho²)) elementwise: Gaussian MI of a correlation (METHODS §B2/B3)."""
    return np.maximum(0.0, -0.5 * np.log1p(-np.square(rho)))


def pair_task_information(rho_ti, rho_tj, rho_ij, ridge: float = PAIR_RIDGE) -> np.ndarray:
    """I(T; Y_i, Y_j) = 1/2 ln(Var_T det S_ij / det S_Tij) in correlation form (METHODS §B3).

    Args broadcast together (any shape); the ridge is added to the unit diagonals of
    R_ij and R_Tij.  Where a determinant is <= 0 the result is 0, as METHODS §B3 says.
    """
    d = 1.0 + ridge
    rho_ti, rho_tj, rho_ij = np.broadcast_arrays(*(np.asarray(r, np.float64)
                                                   for r in (rho_ti, rho_tj, rho_ij)))
    det2 = d * d - rho_ij**2
    det3 = d**3 + 2 * rho_ti * rho_tj * rho_ij - d * (rho_ti**2 + rho_tj**2 + rho_ij**2)
    ok = (det2 > 0) & (det3 > 0)
    ratio = np.where(ok, det2 / np.where(ok, det3, 1.0), 1.0)
    return np.where(ok, 0.5 * np.log(ratio), 0.0)


def score_layer(cov_yy, cov_yt=None, var_t: float | None = None, *, layer: str = "",
                weight=None, mean_y=None, n_images: int | None = None, k_peers: int = 10,
                ridge: float = 1e-3, rho_clip: float = 0.999, guard: float = GUARD,
                syn_top: int = 10, syn_partners: int = 50,
                sigma0_floor: float = 1e-12) -> ChannelScores:
    """Both axes of channel information for one layer from its moments (METHODS §B2, B3).

    Args:
        cov_yy: ``(C, C)`` unbiased covariance of the pre-BN conv output, C >= 2.
        cov_yt, var_t: ``(C,)`` covariances with the target T and Var(T); both or neither.
        layer: name echoed in the result.  weight: ``(C, ...)`` filters (for RQ).
        mean_y: ``(C,)`` means (for the substitution intercepts).  n_images: echoed, and
            gives the analytic noise floor 1/(2 n_images) of I(T;Y) in ``params``.
        k_peers, ridge: R² peers and ridge.  rho_clip, guard: see the module docstring.
        syn_top, syn_partners: Syn(i) = mean of the top syn_top Syn_ij over the
            syn_partners most correlated partners.  sigma0_floor: floor of sigma0².
    Raises:
        ValueError on inconsistent shapes; DataError when T is constant.
    """
    cov = _as_cov(cov_yy)
    n_channels = cov.shape[0]
    if (cov_yt is None) != (var_t is None):
        raise ValueError("give both cov_yt and var_t, or neither")
    raw = correlation_matrix(cov, guard=guard)
    corr = correlation_matrix(cov, guard=guard, rho_clip=rho_clip)
    order = rank_peers(raw, max(k_peers, syn_partners))
    peers = order[:, : min(k_peers, n_channels - 1)]
    scores, sigma0_sq = _local_scores(cov, corr, peers, weight, ridge, sigma0_floor)
    if cov_yt is not None:
        rho_t = task_correlation(cov, cov_yt, var_t, rho_clip=rho_clip, guard=guard)
        partners = order[:, : min(syn_partners, n_channels - 1)]
        scores.update(_target_scores(rho_t, corr, partners, syn_top))
    beta, intercept = peer_coefficients(cov, mean_y, peers, ridge, guard=guard)
    params = {"k_peers": k_peers, "ridge": ridge, "rho_clip": rho_clip, "guard": guard,
              "syn_top": syn_top, "syn_partners": syn_partners, "sigma0_floor": sigma0_floor,
              "sigma0_sq": sigma0_sq, "pair_ridge": PAIR_RIDGE, "n_images": n_images,
              "task_info_floor_analytic": analytic_floor(n_images)}
    return ChannelScores(layer=layer, n_channels=n_channels, scores=scores, peers=peers,
                         peer_beta=beta, peer_intercept=intercept, params=params)


def _local_scores(cov, corr, peers, weight, ridge, sigma0_floor):
    """METHODS §B2: J, RQ, I_X, R̄_X and R² (dict of (C,) arrays) and the sigma0² used."""
    n_channels = cov.shape[0]
    power = np.maximum(np.diag(cov).copy(), 0.0)
    scores = {"signal_power": power}
    if weight is not None:
        w = np.asarray(weight, dtype=np.float64).reshape(n_channels, -1)
        scores["rayleigh_quotient"] = power / (np.einsum("ij,ij->i", w, w) + RQ_EPS)
    sigma0_sq = max(float(np.median(power)), sigma0_floor)
    scores["input_capture"] = 0.5 * np.log1p(power / sigma0_sq)
    off_diagonal = corr.copy()
    np.fill_diagonal(off_diagonal, 0.0)  # R(i, i) is excluded (and would be infinite)
    pair_info = gaussian_information(off_diagonal)
    scores["peer_overlap"] = pair_info.sum(axis=1) / n_channels
    gamma = ridge_gamma(corr, peers, ridge)
    r_ip = corr[np.arange(n_channels)[:, None], peers]
    scores["peer_r2"] = np.clip((gamma * r_ip).sum(axis=1), 0.0, 1.0)
    return scores, sigma0_sq


def _target_scores(rho_t, corr, partners, syn_top):
    """METHODS §B3: I(T;Y_i), Syn(i), Red_T(i) over ``partners`` (C, m), vectorised over pairs."""
    info = gaussian_information(rho_t)
    rho_ij = corr[np.arange(len(rho_t))[:, None], partners]
    joint = pair_task_information(rho_t[:, None], rho_t[partners], rho_ij)
    info_j = info[partners]
    syn = joint - np.maximum(info[:, None], info_j)
    red = np.minimum(info[:, None], info_j)
    top = -np.sort(-syn, axis=1)[:, : min(syn_top, syn.shape[1])]
    return {"task_corr": rho_t, "task_info": info, "synergy": top.mean(axis=1),
            "redundancy": red.mean(axis=1)}


def analytic_floor(n_eff: int | None) -> float | None:
    """E[-1/2 ln(1 - r²)] ≈ 1/(2 n_eff) for independent T and Y_i (None without n_eff)."""
    return None if not n_eff else 1.0 / (2.0 * n_eff)


@dataclass(frozen=True, eq=False)
class PermutationFloor:
    """Noise floor of I(T;Y_i) from a target shuffled across images (issue requirement, B3).

    ``null_task_info`` ``(C,)``: I(T_perm; Y_i) per channel; ``floor`` its ``quantile``;
    ``analytic_mean`` = 1/(2 n_eff) and ``analytic_floor`` = chi²_1(quantile) / (2 n_eff),
    the large-n law of -1/2 ln(1 - r²) under independence (None without n_eff).
    """

    null_task_info: np.ndarray
    quantile: float
    floor: float
    analytic_mean: float | None
    analytic_floor: float | None
    n_eff: int | None

    def count_above(self, task_info, *, analytic: bool = False) -> int:
        """How many channels' I(T;Y_i) exceed the empirical (or the analytic) floor."""
        floor = self.analytic_floor if analytic else self.floor
        if floor is None:
            raise ValueError("the analytic floor needs n_eff (pass n_images)")
        return int(np.sum(np.asarray(task_info) > floor))

    def to_dict(self) -> dict:
        return {"quantile": self.quantile, "floor": self.floor,
                "null_mean": float(self.null_task_info.mean()),
                "analytic_mean": self.analytic_mean, "analytic_floor": self.analytic_floor,
                "n_eff": self.n_eff}


def permutation_floor(cov_yy, cov_yt_null, var_t_null: float, *, n_images: int | None = None,
                      quantile: float = 0.95, rho_clip: float = 0.999,
                      guard: float = GUARD) -> PermutationFloor:
    """Null I(T;Y_i) from moments accumulated with a shuffled target (METHODS §B3 control).

    Args:
        cov_yy: ``(C, C)`` covariance of y; cov_yt_null ``(C,)`` and var_t_null: the
            moments of y with T permuted across images (seeded by the caller).
        n_images: n_eff for the analytic reference.  Positions of one image share one T,
            so n_eff = n_images (not n_images x positions); the empirical floor needs no n_eff.
        quantile: the floor reported, e.g. 0.95.
    """
    rho = task_correlation(cov_yy, cov_yt_null, var_t_null, rho_clip=rho_clip, guard=guard)
    null = gaussian_information(rho)
    q_floor = None if not n_images else float(stats.chi2.ppf(quantile, 1)) / (2.0 * n_images)
    return PermutationFloor(null_task_info=null, quantile=quantile,
                            floor=float(np.quantile(null, quantile)),
                            analytic_mean=analytic_floor(n_images), analytic_floor=q_floor,
                            n_eff=n_images)


def score_moments(moments, *, layer: str = "", weight=None, n_images: int | None = None,
                  **params) -> ChannelScores:
    """:func:`score_layer` from a ``stats.JointMoments`` (both axes) or ``stats.Moments``."""
    if hasattr(moments, "cov_yt"):
        return score_layer(moments.cov_yy, moments.cov_yt, moments.var_t, layer=layer,
                           weight=weight, mean_y=moments.mean_y, n_images=n_images, **params)
    return score_layer(moments.cov(), layer=layer, weight=weight, mean_y=moments.mean,
                       n_images=n_images, **params)
