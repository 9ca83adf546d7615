"""Repair-aware channel choice (docs/METHODS.md §E3): which channels to remove when the
consumers will be reconstructed (:mod:`.reconstruct`) afterwards, and the Wanda-style
comparison score.

For a consumer with input covariance Σ and input-channel weight Gram G = Σ_{o,taps} w wᵀ,
removing R and regressing it on the kept S leaves the output error

    err(R) = tr(G_RR (Σ_RR − Σ_RS Σ_SS⁻¹ Σ_SR)) = tr(G Σ) − tr(Q_S K_SS),

with Q_S = Σ_SS⁻¹ and K = Σ G Σ: exactly the error the reconstruction leaves (at
dense inputs; a k×k conv's taps as if independent).  With a ridge, Q_S = (Σ_SS + λI)⁻¹
(λ = ridge · mean diag Σ, fixed for the whole elimination) and the criterion is the
increase of tr(G Σ) − tr(Q_S K_SS) over its value with every input kept.
Greedy backward elimination removes, one group channel at a time, the channel whose
removal raises err least: dropping the features B from S raises it by
tr((Q_BB)⁻¹ (Q K Q)_BB), and Q and M = Q K are downdated in O(|S|²·|B|) (rank-|B|
Schur complement), so a whole elimination order costs O(n³).  A group's channels are
scored by their elimination rank (first eliminated = lowest), summed over the group's
consumers' errors at every step; "the lowest k" is then the greedy set for every k.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..graph import Structure
from ..stats import Moments
from .reconstruct import DEFAULT_RIDGE, consumer_sites, weight_gram


class _Consumer:
    """One consumer's downdated state over its current kept features."""

    def __init__(self, cov: np.ndarray, gram: np.ndarray, features: np.ndarray, ridge: float):
        n = cov.shape[0]
        # a floor of 1e-10: exactly collinear inputs (duplicated channels) stay invertible
        lam = max(float(ridge), 1e-10) * float(np.mean(np.diag(cov)))
        self.q = np.linalg.inv(cov + lam * np.eye(n))
        self.m = self.q @ (cov @ gram @ cov)
        self.base = float(np.sum(gram * cov))  # tr(G Σ): the error with nothing kept
        self.alive = np.ones(n, dtype=bool)
        self.pos = np.arange(n)  # feature -> row of q (−1 once removed)
        self.features = features  # (n_channels, block) features of each group channel

    def error(self) -> float:
        """err of the features removed so far (module docstring)."""
        return self.base - float(np.trace(self.m))

    def increases(self, channels: np.ndarray) -> np.ndarray:
        """err increase of removing each of ``channels`` next."""
        rows = self.pos[self.features[channels]]  # (k, block)
        if rows.shape[1] == 1:
            r = rows[:, 0]
            qkq = np.einsum("ij,ji->i", self.m[r], self.q[:, r])
            return qkq / self.q[r, r]
        out = np.empty(len(channels))
        for i, b in enumerate(rows):
            qkq = self.m[b] @ self.q[:, b]
            out[i] = np.trace(np.linalg.solve(self.q[np.ix_(b, b)], qkq))
        return out

    def remove(self, channel: int) -> None:
        b = self.pos[self.features[channel]]
        qb, inv = self.q[:, b], np.linalg.inv(self.q[np.ix_(b, b)])
        self.q = self.q - qb @ inv @ qb.T
        self.m = self.m - qb @ inv @ self.m[b]
        keep = np.setdiff1d(np.arange(self.q.shape[0]), b)
        self.q, self.m = self.q[np.ix_(keep, keep)], self.m[np.ix_(keep, keep)]
        self.alive[self.features[channel]] = False
        self.pos = np.where(self.alive, np.cumsum(self.alive) - 1, -1)


def greedy_elimination(consumers: list[tuple[Moments, np.ndarray, str, np.ndarray]],
                       n_channels: int, *, ridge: float = DEFAULT_RIDGE,
                       steps: int | None = None) -> tuple[list[int], list[float]]:
    """(channels in elimination order, predicted err after each removal) for one group.

    ``consumers``: (input Moments, weight, layout, features (n_channels, block) of each
    group channel in that input) per consumer; err is summed over them.  ``steps``: how
    many to eliminate (default n_channels − 1: a full order).
    """
    state = [_Consumer(mo.cov(), weight_gram(w, layout)[0], feats, ridge)
             for mo, w, layout, feats in consumers]
    left = list(range(n_channels))
    order, errors = [], []
    base = sum(c.error() for c in state)
    for _ in range(n_channels - 1 if steps is None else steps):
        cand = np.asarray(left)
        inc = sum(c.increases(cand) for c in state)
        best = int(cand[int(np.argmin(inc))])
        for c in state:
            c.remove(best)
        left.remove(best)
        order.append(best)
        errors.append(sum(c.error() for c in state) - base)
    return order, errors


def _group_consumers(structure: Structure, gid: int, model_values, moments):
    """The consumers of group ``gid`` that can be reconstructed, as greedy_elimination
    takes them."""
    group = structure.groups[gid]
    sites = consumer_sites(structure, [gid])
    out = []
    for c in group.consumers:
        site = sites[c.node_name]
        if site.skip is not None or site.tensor not in moments:
            continue
        feats = (c.channel_offset + np.arange(group.n_channels))[:, None] * c.block_size \
            + np.arange(c.block_size)[None, :]
        layer = structure.get_layer(c.node_name)
        out.append((moments[site.tensor], model_values(layer.weight), site.layout, feats))
    return out


def recon_scores(model, structure: Structure, moments: Mapping[str, Moments], *,
                 ridge: float = DEFAULT_RIDGE) -> tuple[dict[int, np.ndarray], list[str]]:
    """Group-level scores ({group id: (n,)}, higher = keep): each channel's rank in the
    greedy elimination order of its group; groups without a reconstructible consumer are
    left out (named in the notes)."""
    out, missing = {}, []
    for group, consumers in _reconstructible_groups(model, structure, moments, missing):
        order, _ = greedy_elimination(consumers, group.n_channels, ridge=ridge)
        score = np.full(group.n_channels, float(len(order)))  # the survivor
        score[order] = np.arange(len(order), dtype=float)
        out[group.group_id] = score
    return out, missing


def wanda_scores(model, structure: Structure, moments: Mapping[str, Moments]
                 ) -> tuple[dict[int, np.ndarray], list[str]]:
    """Wanda-style group scores: Σ over the consumers' weights reading each channel of
    |W| · ‖X‖ (‖X‖ = the input's root mean square), higher = keep."""
    out, missing = {}, []
    for group, consumers in _reconstructible_groups(model, structure, moments, missing):
        score = np.zeros(group.n_channels)
        for mo, w, layout, feats in consumers:
            w = np.abs(np.asarray(w, np.float64))
            w = w.T if layout == "io" else w
            per_input = w.reshape(w.shape[0], w.shape[1], -1).sum(axis=(0, 2))
            rms = np.sqrt(np.maximum(mo.var() * (mo.n - 1) / mo.n + mo.mean ** 2, 0.0))
            score += (per_input * rms)[feats].sum(axis=1)
        out[group.group_id] = score
    return out, missing


def _reconstructible_groups(model, structure: Structure, moments, missing: list):
    """(group, its consumers) of every prunable group with a reconstructible consumer;
    the ids of the others are appended to ``missing``."""
    from ..graph import GraphIndex

    index = GraphIndex(model)
    for group in structure.groups:
        if not group.prunable:
            continue
        consumers = _group_consumers(structure, group.group_id, index.get_constant, moments)
        if consumers:
            yield group, consumers
        else:
            missing.append(str(group.group_id))
