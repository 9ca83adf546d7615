"""Structure of the two channel axes (METHODS §B4) and the test of the claim (§B5).

NumPy/SciPy.

k-means (Lloyd with k-means++ seeding) and the Adjusted Rand Index are implemented here so that
scikit-learn stays a test-only dependency.  Inputs are :class:`onnxdiag.channels.ChannelScores`
or plain ``(n_channels,)`` arrays; results are dicts of builtins (nan marks an undefined
statistic, always with a ``reason``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from ..errors import DataError
from .scores import ChannelScores

LOCAL_AXIS = ("input_capture", "peer_overlap")  # METHODS §B4: (I_X, R̄_X)
TARGET_AXIS = ("task_info", "synergy")  # METHODS §B4: (I(T;Y), Syn)
ALIGNMENTS = {"input_capture_vs_task_info": ("input_capture", "task_info"),
              "peer_overlap_vs_synergy": ("peer_overlap", "synergy")}
DAMAGE_SCORES = ("peer_r2", "task_info", "input_capture")


@dataclass(frozen=True, eq=False)
class KMeansResult:
    """``labels`` ``(n,)`` numbered by first appearance, ``centers`` ``(k, d)``, ``inertia``."""

    labels: np.ndarray
    centers: np.ndarray
    inertia: float
    n_iter: int


def zscore_columns(x) -> np.ndarray:
    """``(n, d)`` columns centred and scaled to unit std (ddof=0); a constant column → 0."""
    x = np.asarray(x, dtype=np.float64)
    std = x.std(axis=0)
    return (x - x.mean(axis=0)) / np.where(std > 0, std, 1.0)


def _sq_dist(x: np.ndarray, centers: np.ndarray) -> np.ndarray:
    return ((x[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2)


def _init_plusplus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding (Arthur & Vassilvitskii 2007): D² sampling, one candidate per step."""
    centers = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d2 = _sq_dist(x, np.array(centers)).min(axis=1)
        total = d2.sum()
        idx = rng.choice(len(x), p=d2 / total) if total > 0 else rng.integers(len(x))
        centers.append(x[idx])
    return np.array(centers)


def _lloyd(x, centers, max_iter: int, tol: float) -> KMeansResult:
    """Lloyd iterations; an empty cluster takes the point farthest from its center."""
    n_iter = 0
    while n_iter < max_iter:
        n_iter += 1
        d2 = _sq_dist(x, centers)
        labels = d2.argmin(axis=1)
        new = centers.copy()
        for c in range(len(centers)):
            members = labels == c
            if members.any():
                new[c] = x[members].mean(axis=0)
            else:
                far = int(d2[np.arange(len(x)), labels].argmax())
                new[c], labels[far] = x[far], c
        shift = float(((new - centers) ** 2).sum())
        centers = new
        if shift <= tol:
            break
    d2 = _sq_dist(x, centers)
    labels = d2.argmin(axis=1)
    return KMeansResult(labels, centers, float(d2[np.arange(len(x)), labels].sum()), n_iter)


def _relabel(result: KMeansResult) -> KMeansResult:
    """Number clusters by first appearance so equal partitions give equal labels."""
    _, first = np.unique(result.labels, return_index=True)
    order = result.labels[np.sort(first)]  # old label of new cluster 0, 1, ...
    mapping = np.zeros(len(result.centers), dtype=np.int64)
    mapping[order] = np.arange(len(order))
    return KMeansResult(mapping[result.labels], result.centers[order], result.inertia,
                        result.n_iter)


def fit_kmeans(x, k: int = 4, *, n_init: int = 10, seed: int = 0, max_iter: int = 300,
               tol: float = 1e-10) -> KMeansResult:
    """k-means on ``x`` ``(n, d)``: best inertia of ``n_init`` seeded k-means++ restarts.

    One ``numpy.random.default_rng(seed)`` drives all restarts, so a seed fixes the
    result.  Raises DataError when n < k.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) < k:
        raise DataError(f"k-means with k={k} needs at least {k} points, got shape {x.shape}")
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(max(1, n_init)):
        result = _lloyd(x, _init_plusplus(x, k, rng), max_iter, tol)
        if best is None or result.inertia < best.inertia:
            best = result
    return _relabel(best)


def _comb2(n: np.ndarray) -> float:
    return float((n * (n - 1) / 2.0).sum())


def adjusted_rand_index(labels_a, labels_b) -> float:
    """Adjusted Rand Index (Hubert & Arabie 1985) of two labelings of the same n items.

    Invariant to renaming labels; 1.0 for identical partitions, ≈ 0 for independent ones.
    Like scikit-learn, returns 1.0 when both labelings are a single cluster or all singletons.
    """
    a, b = np.asarray(labels_a).reshape(-1), np.asarray(labels_b).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"labelings differ in length: {a.size} vs {b.size}")
    ia = np.unique(a, return_inverse=True)[1].reshape(-1)
    ib = np.unique(b, return_inverse=True)[1].reshape(-1)
    n_b = int(ib.max()) + 1 if ib.size else 1
    table = np.bincount(ia * n_b + ib, minlength=(int(ia.max()) + 1 if ia.size else 1) * n_b)
    table = table.reshape(-1, n_b).astype(np.float64)
    index = _comb2(table)
    sum_a, sum_b = _comb2(table.sum(axis=1)), _comb2(table.sum(axis=0))
    total = _comb2(np.array([a.size], dtype=np.float64))
    expected = sum_a * sum_b / total if total > 0 else 0.0
    maximum = (sum_a + sum_b) / 2.0
    if maximum == expected:
        return 1.0
    return float((index - expected) / (maximum - expected))


def spearman(x, y) -> dict:
    """Spearman rho (scipy) over finite pairs: ``{"spearman", "p", "n", "reason"}``.

    Fewer than 3 pairs or a constant series gives nan with a reason, never a warning.
    """
    x, y = np.asarray(x, np.float64).reshape(-1), np.asarray(y, np.float64).reshape(-1)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y, n = x[ok], y[ok], int(ok.sum())
    reason = ("fewer than 3 finite pairs" if n < 3 else "first series is constant"
              if np.ptp(x) == 0 else "second series is constant" if np.ptp(y) == 0 else "")
    if reason:
        return {"spearman": math.nan, "p": math.nan, "n": n, "reason": reason}
    rho, p = stats.spearmanr(x, y)
    return {"spearman": float(rho), "p": float(p), "n": n, "reason": ""}


def _require_target(scores: ChannelScores) -> None:
    if not scores.has_target:
        raise DataError(f"Layer {scores.layer!r} has no target-axis scores (task_info, "
                        "synergy); they need a target T (labels or --targets pseudo).")


def axis_alignment(scores: ChannelScores) -> dict:
    """Per-layer Spearman of I_X vs I(T;Y) and of R̄_X vs Syn (METHODS §B4).

    Returns ``{"layer", "n_channels", name: spearman-dict}`` for each name in ALIGNMENTS;
    nan with a reason when a score is constant.  Raises DataError without the target axis.
    """
    _require_target(scores)
    out: dict = {"layer": scores.layer, "n_channels": scores.n_channels}
    for name, (a, b) in ALIGNMENTS.items():
        out[name] = spearman(scores.scores[a], scores.scores[b])
    return out


def cluster_axes(scores: ChannelScores, k: int = 4, n_init: int = 10,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """k-means on z-scored (I_X, R̄_X) and on z-scored (I(T;Y), Syn); ARI between (METHODS §B4).

    Returns ``(labels_local (C,), labels_target (C,), ari)``; both clusterings use ``seed``.
    Raises DataError without the target axis or with fewer than k channels.
    """
    _require_target(scores)
    labels = []
    for axis in (LOCAL_AXIS, TARGET_AXIS):
        x = zscore_columns(np.column_stack([scores.scores[name] for name in axis]))
        labels.append(fit_kmeans(x, k, n_init=n_init, seed=seed).labels)
    return labels[0], labels[1], adjusted_rand_index(labels[0], labels[1])


def summarize_layers(layers: Sequence[ChannelScores], *, k: int = 4, n_init: int = 10,
                     seed: int = 0) -> dict:
    """Alignment and clustering per layer, and their medians over layers (METHODS §B4).

    Layers without the target axis or with fewer than ``k`` channels are listed with a
    ``reason`` and left out of the medians.  Returns ``{"n_layers", "layers": [...],
    "median": {statistic: float}, "n_used": {statistic: int}, "params"}``.
    """
    rows = [_summarize_layer(s, k, n_init, seed) for s in layers]
    names = [*ALIGNMENTS, "ari"]
    median, used = {}, {}
    for name in names:
        values = np.array([r[name] for r in rows if name in r], dtype=np.float64)
        values = values[np.isfinite(values)]
        median[name] = float(np.median(values)) if values.size else math.nan
        used[name] = int(values.size)
    return {"n_layers": len(rows), "layers": rows, "median": median, "n_used": used,
            "params": {"k": k, "n_init": n_init, "seed": seed}}


def _summarize_layer(scores: ChannelScores, k: int, n_init: int, seed: int) -> dict:
    row: dict = {"layer": scores.layer, "n_channels": scores.n_channels, "reason": ""}
    if not scores.has_target:
        row["reason"] = "no target axis"
        return row
    alignment = axis_alignment(scores)
    for name in ALIGNMENTS:
        row[name] = alignment[name]["spearman"]
        row[f"{name}_reason"] = alignment[name]["reason"]
    if scores.n_channels < k:
        row["reason"] = f"fewer than k={k} channels: not clustered"
        return row
    row["ari"] = cluster_axes(scores, k, n_init, seed)[2]
    return row


def _quantile_bins(values: np.ndarray, n_bins: int) -> np.ndarray:
    """``(n,)`` bin of each value by rank; ties share the lowest bin their rank reaches
    (e.g. many channels with I(T;Y) = 0 form one large first bin, later bins may be empty)."""
    ranks = stats.rankdata(values, method="min") - 1.0
    return np.minimum((ranks * n_bins / len(values)).astype(np.int64), n_bins - 1)


def _r_squared(design: np.ndarray, y: np.ndarray) -> float:
    """R² of the least-squares fit of ``y`` on ``design`` (which spans the constant)."""
    sst = float(((y - y.mean()) ** 2).sum())
    if sst == 0:
        return math.nan
    coef = np.linalg.lstsq(design, y, rcond=None)[0]
    return 1.0 - float(((y - design @ coef) ** 2).sum()) / sst


def damage_test(damage, task_info, peer_r2, i_x, n_bins: int = 4) -> dict:
    """Does peer support predict lesion damage at matched task relevance? (METHODS §B5).

    Args:
        damage, task_info, peer_r2, i_x: ``(n,)`` per channel (layers may be pooled):
            lesion damage Δ_i, I(T;Y_i), R²_i and I_X(i); non-finite rows are dropped.
        n_bins: quantile bins of task_info (equal counts up to ties, which share a bin).
    Returns:
        ``{"n", "n_bins", "bins": [{"bin", "n", "task_info_range", "spearman": {score: ...}}],
        "pooled": {score: spearman-dict}, "explained_variance": {"base_r2",
        score: {"r2", "gain"}}, "expected_sign"}``.  ``gain`` = R² of damage ~ bin dummies +
        score minus R² of damage ~ bin dummies.  The claim predicts a negative Spearman
        for peer_r2 (more peer support, less damage) and ≈ 0 for task_info and input_capture.
    """
    cols = [np.asarray(v, np.float64).reshape(-1) for v in (damage, task_info, peer_r2, i_x)]
    if len({c.size for c in cols}) != 1:
        raise ValueError(f"inputs differ in length: {[c.size for c in cols]}")
    ok = np.logical_and.reduce([np.isfinite(c) for c in cols])
    damage, task_info, peer_r2, i_x = (c[ok] for c in cols)
    if damage.size < 2 * n_bins:
        raise DataError(f"damage_test needs at least {2 * n_bins} channels with finite "
                        f"values for {n_bins} bins, got {damage.size}.")
    named = dict(zip(DAMAGE_SCORES, (peer_r2, task_info, i_x)))
    bins = _quantile_bins(task_info, n_bins)
    per_bin = [_bin_row(b, bins == b, damage, task_info, named) for b in range(n_bins)]
    dummies = (bins[:, None] == np.arange(n_bins)[None, :]).astype(np.float64)
    base = _r_squared(dummies, damage)
    explained: dict = {"base_r2": base}
    for name, score in named.items():
        r2 = _r_squared(np.column_stack([dummies, score]), damage)
        explained[name] = {"r2": r2, "gain": r2 - base}
    return {"n": int(damage.size), "n_bins": n_bins, "bins": per_bin,
            "pooled": {name: spearman(s, damage) for name, s in named.items()},
            "explained_variance": explained,
            "expected_sign": {"peer_r2": "negative", "task_info": "none",
                              "input_capture": "none"}}


def _bin_row(b: int, members: np.ndarray, damage, task_info, named) -> dict:
    lo, hi = (float(task_info[members].min()), float(task_info[members].max())) \
        if members.any() else (math.nan, math.nan)
    return {"bin": b, "n": int(members.sum()), "task_info_range": [lo, hi],
            "spearman": {name: spearman(s[members], damage[members])
                         for name, s in named.items()}}
