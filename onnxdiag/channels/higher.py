"""Higher-order channel structure by depth (docs/METHODS.md §B4).  Pure NumPy from moments.

Two questions per layer, both answered from one layer's streamed moments (the covariance of
the channels y and their covariances with the target T, §B1), never from samples:

- **Singleton vs distributed substitutability.**  R²_1(i): the ridge reconstruction of
  channel i from its single most correlated peer, ρ_ip² / (1 + λ); R²_k(i): from its k
  most correlated peers (the §B2 peer R²).  A channel is a *singleton duplicate* when one
  peer already reconstructs it (R²_1 ≈ R²_k), part of a *distributed shell* when only many
  peers do (R²_k ≫ R²_1).  Per layer: the medians of R²_1 and R²_k, the median share
  R²_1 / R²_k over channels with R²_k > 1e-6, and the median gain R²_k − R²_1.
- **Triplet synergy.**  For channel i and each pair (j, k) of its m most correlated
  partners, the Gaussian information I(T; Y_i, Y_j, Y_k) = ½ ln(Var_T · det Σ_ijk /
  det Σ_Tijk) (correlation form, ridge 1e-10 on the unit diagonals, 0 where a determinant
  is ≤ 0, as for pairs in §B3) minus the largest pair information among I(T; Y_i, Y_j),
  I(T; Y_i, Y_k), I(T; Y_j, Y_k).  Channel triplet synergy Syn3(i) = mean of its
  ``triplet_top`` largest values; per layer the median Syn3 next to the median pair
  synergy over the same m partners (the §B3 Syn_ij, top ``triplet_top`` averaged) and the
  median excess Syn3 − Syn.

Depth is the layer's position among the analysed layers in graph order; :func:`depth_trends`
gives the Spearman ρ of each per-layer value against depth.  Our defaults (echoed in the
reports): k = 10 peers (the §B2 R²), ridge 1e-3, m = 10 triplet partners, top 10 triplets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from .scores import (
    PAIR_RIDGE,
    correlation_matrix,
    gaussian_information,
    pair_task_information,
    rank_peers,
    ridge_gamma,
    task_correlation,
)

#: The per-layer values of :class:`HigherOrder` (report keys), in table order.
LAYER_KEYS = ("r2_single", "r2_multi", "single_share", "distributed_gain", "pair_synergy",
              "triplet_synergy", "triplet_excess")


@dataclass(frozen=True, eq=False)
class HigherOrder:
    """One layer's higher-order structure: per-channel arrays and their per-layer summary.

    ``channels``: "r2_single", "r2_multi" and, with a target, "pair_synergy",
    "triplet_synergy" ((n_channels,) float64 each); ``summary``: :data:`LAYER_KEYS` (None
    where undefined); ``params``: the settings used.
    """

    layer: str
    n_channels: int
    channels: dict[str, np.ndarray]
    summary: dict[str, float | None]
    params: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "n_channels": self.n_channels, "params": dict(self.params),
                **self.summary}


def triplet_task_information(rho_t, rho_pairs, ridge: float = PAIR_RIDGE) -> np.ndarray:
    """I(T; Y_i, Y_j, Y_k) = ½ ln(det R_ijk / det R_Tijk) in correlation form (§B4).

    ``rho_t`` (..., 3): ρ(T, Y_i), ρ(T, Y_j), ρ(T, Y_k); ``rho_pairs`` (..., 3): ρ_ij, ρ_ik,
    ρ_jk.  The ridge is added to the unit diagonals; 0 where a determinant is ≤ 0.
    """
    rho_t, rho_pairs = (np.asarray(a, dtype=np.float64) for a in (rho_t, rho_pairs))
    lead = np.broadcast_shapes(rho_t.shape[:-1], rho_pairs.shape[:-1])
    r = np.zeros(lead + (4, 4))
    r[..., 0, 1:] = r[..., 1:, 0] = np.broadcast_to(rho_t, lead + (3,))
    pairs = np.broadcast_to(rho_pairs, lead + (3,))
    for (a, b), col in zip(((1, 2), (1, 3), (2, 3)), range(3)):
        r[..., a, b] = r[..., b, a] = pairs[..., col]
    r[..., np.arange(4), np.arange(4)] = 1.0 + ridge
    det4, det3 = np.linalg.det(r), np.linalg.det(r[..., 1:, 1:])
    ok = (det3 > 0) & (det4 > 0)
    return np.where(ok, 0.5 * np.log(np.where(ok, det3, 1.0) / np.where(ok, det4, 1.0)), 0.0)


def gaussian_triplet_information(cov) -> float:
    """I(T; Y_i, Y_j, Y_k) = ½ ln(Var_T · det Σ_ijk / det Σ_Tijk) from a 4×4 covariance
    ordered (T, Y_i, Y_j, Y_k): the Gaussian formula itself (no ridge)."""
    cov = np.asarray(cov, dtype=np.float64)
    return 0.5 * math.log(cov[0, 0] * np.linalg.det(cov[1:, 1:]) / np.linalg.det(cov))


def _triplet_synergy(rho_t, corr, partners, top: int) -> tuple[np.ndarray, np.ndarray]:
    """(Syn3 (C,), pair Syn (C,)) over each channel's ``partners`` (C, m)."""
    c, m = partners.shape
    info = gaussian_information(rho_t)
    j, k = np.triu_indices(m, 1)
    pj, pk = partners[:, j], partners[:, k]  # (C, n_triplets)
    i = np.broadcast_to(np.arange(c)[:, None], pj.shape)
    r_ij, r_ik, r_jk = corr[i, pj], corr[i, pk], corr[pj, pk]
    triple = triplet_task_information(np.stack([rho_t[i], rho_t[pj], rho_t[pk]], -1),
                                      np.stack([r_ij, r_ik, r_jk], -1))
    pairs = np.stack([pair_task_information(rho_t[i], rho_t[pj], r_ij),
                      pair_task_information(rho_t[i], rho_t[pk], r_ik),
                      pair_task_information(rho_t[pj], rho_t[pk], r_jk)])
    syn3 = triple - pairs.max(axis=0)
    syn3_top = -np.sort(-syn3, axis=1)[:, :min(top, syn3.shape[1])].mean(axis=1)
    joint = pair_task_information(rho_t[:, None], rho_t[partners],
                                  corr[np.arange(c)[:, None], partners])
    syn2 = joint - np.maximum(info[:, None], info[partners])
    syn2_top = -np.sort(-syn2, axis=1)[:, :min(top, m)].mean(axis=1)
    return syn3_top, syn2_top


def _median(values) -> float | None:
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    return float(np.median(values)) if values.size else None


def higher_order_layer(cov_local, cov_yy=None, cov_yt=None, var_t=None, *, layer: str = "",
                       k_peers: int = 10, ridge: float = 1e-3, triplet_partners: int = 10,
                       triplet_top: int = 10, rho_clip: float = 0.999) -> HigherOrder:
    """Singleton vs distributed R² and triplet synergy of one layer (module docstring).

    ``cov_local`` (C, C): the channels' covariance for the local axis; ``cov_yy``,
    ``cov_yt`` (C,), ``var_t``: the target-axis moments (None: local axis only; ``cov_yy``
    defaults to ``cov_local``).  Raises ValueError for C < 3 (no triplet)."""
    cov_local = np.asarray(cov_local, dtype=np.float64)
    n = cov_local.shape[0]
    if n < 3:
        raise ValueError(f"higher-order structure needs at least 3 channels, got {n}")
    corr = correlation_matrix(cov_local, rho_clip=rho_clip)
    peers = rank_peers(correlation_matrix(cov_local), k_peers)
    r_ip = corr[np.arange(n)[:, None], peers]
    r2 = {kind: np.clip((ridge_gamma(corr, p, ridge) * r_ip[:, :p.shape[1]]).sum(1), 0, 1)
          for kind, p in (("r2_single", peers[:, :1]), ("r2_multi", peers))}
    channels = dict(r2)
    if cov_yt is not None:
        cov_t = cov_local if cov_yy is None else np.asarray(cov_yy, dtype=np.float64)
        rho_t = task_correlation(cov_t, cov_yt, var_t, rho_clip=rho_clip)
        corr_t = correlation_matrix(cov_t, rho_clip=rho_clip)
        partners = rank_peers(correlation_matrix(cov_t), triplet_partners)
        channels["triplet_synergy"], channels["pair_synergy"] = _triplet_synergy(
            rho_t, corr_t, partners, triplet_top)
    params = {"k_peers": int(min(k_peers, n - 1)), "ridge": ridge,
              "triplet_partners": int(min(triplet_partners, n - 1)),
              "triplet_top": triplet_top, "rho_clip": rho_clip, "pair_ridge": PAIR_RIDGE}
    return HigherOrder(layer, n, channels, summarize_channels(channels), params)


def summarize_channels(channels: dict) -> dict:
    """Per-layer medians of the per-channel arrays (:data:`LAYER_KEYS`)."""
    single, multi = channels["r2_single"], channels["r2_multi"]
    ok = multi > 1e-6
    out = {"r2_single": _median(single), "r2_multi": _median(multi),
           "single_share": _median(single[ok] / multi[ok]) if ok.any() else None,
           "distributed_gain": _median(multi - single)}
    syn3, syn2 = channels.get("triplet_synergy"), channels.get("pair_synergy")
    out.update(pair_synergy=None if syn2 is None else _median(syn2),
               triplet_synergy=None if syn3 is None else _median(syn3),
               triplet_excess=None if syn3 is None else _median(syn3 - syn2))
    return out


def depth_trends(rows: list[dict], keys=LAYER_KEYS) -> dict:
    """Spearman ρ of each per-layer value of ``rows`` (in depth order) against depth
    (None with fewer than 3 finite values or a constant one)."""
    out = {}
    for key in keys:
        pairs = [(d, r[key]) for d, r in enumerate(rows) if r.get(key) is not None
                 and math.isfinite(r[key])]
        values = [v for _, v in pairs]
        if len(pairs) < 3 or np.ptp(values) == 0:
            out[key] = None
            continue
        out[key] = float(stats.spearmanr([d for d, _ in pairs], values).statistic)
    return out
