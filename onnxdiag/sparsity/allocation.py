"""Per-layer sparsities under a global budget S (METHODS §C3).

Every rule returns an :class:`Allocation` that prunes exactly ``⌊S·N⌋`` of the N
prunable weights (layers in ``keep_dense`` count in N but stay dense).  Rules that
solve a real-valued density (uniform, erk, rr) solve it for the real budget S·N,
then round the per-layer counts by largest remainder onto the integer budget
(**our default**; it reproduces the METHODS §C3 ERK table to 4 decimals).  Magnitude
rules (global, lamp) count the weights below one global threshold; within a layer
that set equals :func:`magnitude_mask`, so ``make_masks`` rebuilds it exactly.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import OnnxDiagError
from ..report.json import to_jsonable as jsonable
from .budget import LayerInfo, exact_fraction, prune_count, round_counts
from .masks import check_layer_names, magnitude_order

RULES = ("global", "uniform", "erk", "lamp", "rr", "rr-greedy", "rr-marginal")
PRIORS = ("erk", "lamp")


@dataclass(frozen=True, eq=False)
class Allocation:
    """Per-layer sparsities of one rule at one budget.

    Fields:
        rule: one of ``RULES``; target: S; n_weights: N; n_pruned: ⌊S·N⌋ exactly.
        layers: layer names in the given order; n_params / n_kept: weights per layer,
            total and kept; sparsity: achieved fraction pruned per layer (1 − kept/n).
        params: the rule's settings and solved constants (ε, c, m_ℓ, densities …).
        prior: for ``rr``, the prior allocation it modulates (METHODS §C3: report both).
    """

    rule: str
    target: float
    n_weights: int
    n_pruned: int
    layers: tuple[str, ...]
    n_params: dict[str, int]
    n_kept: dict[str, int]
    sparsity: dict[str, float]
    params: dict = field(default_factory=dict)
    prior: Allocation | None = None

    def to_dict(self) -> dict:
        d = {k: jsonable(getattr(self, k)) for k in (
            "rule", "target", "n_weights", "n_pruned", "layers", "n_params", "n_kept",
            "sparsity", "params")}
        d["prior"] = None if self.prior is None else self.prior.to_dict()
        return d


def allocate_sparsity(rule: str, layers_info: Sequence[LayerInfo], S: float, *, rr_curves=None,
                      weights: Mapping[str, np.ndarray] | None = None,
                      keep_dense: Iterable[str] = (), prior: str = "erk", gamma: float = 1.0,
                      cap: float = 0.99, force_projection: bool = False,
                      step: float = 0.01) -> Allocation:
    """Allocate a global budget ``S`` over ``layers_info`` with ``rule`` (METHODS §C3).

    Args:
        rule: ``global`` / ``lamp`` (need ``weights``: ``{name: array}``), ``uniform``,
            ``erk`` (``force_projection``: 1×1 shortcuts fixed at s = S), ``rr`` (prior
            ``erk`` | ``lamp`` modulated by RR^-γ, per-layer ``cap``), ``rr-greedy`` /
            ``rr-marginal`` (steps of ``step`` up to ``cap``); rr rules need ``rr_curves``
            (:class:`~onnxdiag.sparsity.repairability.RRCurves`).
        keep_dense: layer names left dense (counted in N).

    Raises:
        OnnxDiagError: unknown rule / layer name, missing weights or curves, or a budget
            the dense layers and caps make impossible.
    """
    infos = list(layers_info)
    keep = tuple(dict.fromkeys(keep_dense))
    check_layer_names(keep, [i.name for i in infos], "keep_dense")
    if rule not in RULES:
        raise OnnxDiagError(f"Unknown allocation rule {rule!r}; choose one of {', '.join(RULES)}.")
    exact_fraction(S)
    if rule in ("global", "lamp"):
        _require(weights, infos, keep, "weights", rule)
        return (allocate_global if rule == "global" else allocate_lamp)(infos, S, weights, keep)
    if rule == "uniform":
        return allocate_uniform(infos, S, keep)
    if rule == "erk":
        return allocate_erk(infos, S, keep, force_projection=force_projection)
    _require(rr_curves, infos, keep, "rr_curves", rule)
    if rule == "rr":
        if prior not in PRIORS:
            raise OnnxDiagError(f"Unknown RR prior {prior!r}; choose one of {', '.join(PRIORS)}.")
        if prior == "lamp":
            _require(weights, infos, keep, "weights", "rr with prior lamp")
            base = allocate_lamp(infos, S, weights, keep)
        else:
            base = allocate_erk(infos, S, keep, force_projection=force_projection)
        return allocate_rr(infos, S, rr_curves, base, gamma=gamma, cap=cap)
    return allocate_rr_greedy(infos, S, rr_curves, keep, cap=cap, step=step,
                              marginal=rule == "rr-marginal")


def _require(obj, infos, keep, what: str, rule: str) -> None:
    if obj is None:
        raise OnnxDiagError(f"Rule {rule!r} needs {what}; none were given.")
    have = obj.layers if hasattr(obj, "layers") else list(obj)
    missing = [i.name for i in infos if i.name not in keep and i.name not in have]
    if missing:
        raise OnnxDiagError(f"Rule {rule!r}: {what} lack layer(s) {', '.join(missing[:5])} "
                            f"({len(missing)} in all); recompute them for this layer set.")


def finish_allocation(rule: str, infos: Sequence[LayerInfo], S: float, pruned, params: dict,
                      prior: Allocation | None = None) -> Allocation:
    """Build the record from per-layer prune counts, checking the budget to the weight."""
    pruned = [int(p) for p in pruned]
    n = {i.name: i.n_weights for i in infos}
    total = sum(n.values())
    if sum(pruned) != prune_count(total, S) or any(p < 0 for p in pruned):
        raise AssertionError(f"{rule}: pruned {sum(pruned)} != budget {prune_count(total, S)}")
    kept = {i.name: n[i.name] - p for i, p in zip(infos, pruned)}
    return Allocation(
        rule=rule, target=float(S), n_weights=total, n_pruned=sum(pruned),
        layers=tuple(i.name for i in infos), n_params=n, n_kept=kept,
        sparsity={k: 1.0 - kept[k] / n[k] if n[k] else 0.0 for k in n}, params=params,
        prior=prior)


def _budget(infos, S, keep) -> tuple[np.ndarray, np.ndarray, int]:
    """Sizes (L,), dense flags (L,) and the integer budget; raises when it cannot fit."""
    sizes = np.array([i.n_weights for i in infos], dtype=np.int64)
    dense = np.array([i.name in keep for i in infos])
    target = prune_count(int(sizes.sum()), S)
    if target > int(sizes[~dense].sum()):
        raise OnnxDiagError(
            f"S = {S} asks to prune {target} weights but the layers not kept dense hold only "
            f"{int(sizes[~dense].sum())}; keep fewer layers dense or lower S.")
    return sizes, dense, target


# -- uniform and ERK ------------------------------------------------------------------------
def allocate_uniform(infos: Sequence[LayerInfo], S: float, keep=()) -> Allocation:
    """``uniform``: s_ℓ = S, or S·N / N_free on the layers not kept dense (rebalanced)."""
    sizes, dense, target = _budget(infos, S, keep)
    s_free = float(exact_fraction(S) * int(sizes.sum()) / max(int(sizes[~dense].sum()), 1))
    real = np.where(dense, 0.0, s_free * sizes)
    pruned = round_counts(real, np.where(dense, 0, sizes), target)
    return finish_allocation("uniform", infos, S, pruned, {"sparsity_free": s_free})


def allocate_erk(infos: Sequence[LayerInfo], S: float, keep=(), *,
                 force_projection: bool = False) -> Allocation:
    """Capped ERK: d_ℓ = ε·Σshape/Πshape, ε solved for the real budget; layers with d_ℓ > 1
    are set dense and ε re-solved until none exceeds 1 (METHODS §C3).  ``force_projection``
    fixes 1×1 shortcut convs at s = S before solving."""
    sizes, dense, target = _budget(infos, S, keep)
    raw = np.array([i.erk_raw for i in infos])
    frac = exact_fraction(S)
    fixed = np.array([force_projection and i.is_projection for i in infos]) & ~dense
    keep_real = float((1 - frac) * int(sizes.sum()))
    budget = keep_real - sizes[dense].sum() - float(1 - frac) * sizes[fixed].sum()
    capped = np.zeros(len(infos), dtype=bool)
    free = ~dense & ~fixed
    eps = float("inf")
    while free.any():
        eps = (budget - sizes[capped].sum()) / float((raw * sizes)[free].sum())
        over = free & (eps * raw > 1)
        if not over.any():
            break
        capped |= over
        free &= ~over
    density = np.where(dense | capped, 1.0, np.where(fixed, float(1 - frac), eps * raw))
    pruned = round_counts((1 - density) * sizes, np.where(dense, 0, sizes), target)
    names = [i.name for i in infos]
    params = {"epsilon": eps, "density": dict(zip(names, density.tolist())),
              "capped": [n for n, c in zip(names, capped) if c],
              "force_projection": force_projection,
              "projections": [i.name for i in infos if i.is_projection]}
    return finish_allocation("erk", infos, S, pruned, params)


# -- magnitude rules ------------------------------------------------------------------------
def count_lowest(scores: Sequence[np.ndarray], n_prune: int) -> np.ndarray:
    """How many of each layer's ``n_prune`` globally lowest scores fall in that layer.

    Each ``scores[ℓ]`` is 1-D and sorted ascending in the layer's prune-first order.
    Ties at the threshold go to the later layers first (the later weight is pruned
    first, matching the in-layer rule "ties keep the lower index").
    """
    counts = np.zeros(len(scores), dtype=np.int64)
    if n_prune == 0:
        return counts
    flat = np.concatenate(scores) if scores else np.zeros(0)
    t = np.partition(flat, n_prune - 1)[n_prune - 1]
    below = [int(np.searchsorted(s, t, side="left")) for s in scores]
    ties = [int(np.searchsorted(s, t, side="right")) - b for s, b in zip(scores, below)]
    need = n_prune - sum(below)
    for i in range(len(scores) - 1, -1, -1):
        take = min(need, ties[i])
        counts[i] = below[i] + take
        need -= take
    return counts


def _free_scores(infos, weights, dense, score_fn) -> tuple[list, list]:
    idx, scores = [], []
    for i, info in enumerate(infos):
        if dense[i]:
            continue
        w = np.asarray(weights[info.name])
        if w.size != info.n_weights:
            raise OnnxDiagError(f"Weight of {info.name!r} has {w.size} values, the layer "
                                f"{info.n_weights}; pass the layer's own weight.")
        idx.append(i)
        scores.append(score_fn(w))
    return idx, scores


def allocate_global(infos: Sequence[LayerInfo], S: float, weights, keep=()) -> Allocation:
    """``global``: one magnitude threshold over every prunable weight not kept dense."""
    sizes, dense, target = _budget(infos, S, keep)

    def ascending(w):
        mag = np.abs(np.asarray(w, dtype=np.float64)).ravel()
        return mag[magnitude_order(w)[::-1]]

    idx, scores = _free_scores(infos, weights, dense, ascending)
    pruned = np.zeros(len(infos), dtype=np.int64)
    pruned[idx] = count_lowest(scores, target)
    t = max((float(s[c - 1]) for s, c in zip(scores, pruned[idx]) if c), default=0.0)
    return finish_allocation("global", infos, S, pruned, {"threshold": t})


def lamp_scores(weight: np.ndarray) -> np.ndarray:
    """LAMP scores in ascending-|w| order: score_u = w_u² / Σ_{v≥u} w_v² (METHODS §C3).

    The layer's largest weight gets +inf so that it always survives; 0/0 gives 0.
    Order: prune-first (|w| ascending, ties higher flat index first).
    """
    w2 = np.asarray(weight, dtype=np.float64).ravel() ** 2
    sq = w2[magnitude_order(weight)[::-1]]
    tail = np.cumsum(sq[::-1])[::-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        score = np.where(tail > 0, sq / np.where(tail > 0, tail, 1.0), 0.0)
    score[-1] = np.inf
    return np.maximum.accumulate(score)  # monotone in exact arithmetic; guard rounding


def allocate_lamp(infos: Sequence[LayerInfo], S: float, weights, keep=()) -> Allocation:
    """``lamp``: prune the ⌊S·N⌋ lowest LAMP scores over all layers not kept dense."""
    sizes, dense, target = _budget(infos, S, keep)
    if target > int((sizes[~dense] - 1).sum()):
        raise OnnxDiagError(f"LAMP keeps each layer's largest weight; S = {S} leaves no room "
                            "for that; lower S.")
    idx, scores = _free_scores(infos, weights, dense, lamp_scores)
    pruned = np.zeros(len(infos), dtype=np.int64)
    pruned[idx] = count_lowest(scores, target)
    return finish_allocation("lamp", infos, S, pruned, {})


# -- repairability rules --------------------------------------------------------------------
def allocate_rr(infos: Sequence[LayerInfo], S: float, rr_curves, prior: Allocation, *,
                gamma: float = 1.0, cap: float = 0.99) -> Allocation:
    """``rr`` (**our default**): s_ℓ = min(cap, c·m_ℓ·p_ℓ), m_ℓ = (mean_k RR_k(p_k) /
    RR_ℓ(p_ℓ))^γ, c solved so that the real budget S·N holds (METHODS §C3).  Layers the prior
    keeps dense stay dense; the mean runs over the layers the prior prunes (a constant
    factor, absorbed by c)."""
    sizes, _, target = _budget(infos, S, ())
    p = np.array([prior.sparsity[i.name] for i in infos])
    active = p > 0
    rr = np.array([rr_curves.rr_at(i.name, s) if a else 1.0 for i, s, a in zip(infos, p, active)])
    if not np.all(np.isfinite(rr[active])) or np.any(rr[active] <= 0):
        raise OnnxDiagError("RR curves hold non-finite or non-positive values; recompute them.")
    mean_rr = float(rr[active].mean()) if active.any() else 1.0
    m = np.where(active, (mean_rr / rr) ** gamma, 0.0)
    goal = float(exact_fraction(S) * int(sizes.sum()))
    c = _solve_scale(m * p, sizes, goal, cap)
    s = np.minimum(cap, c * m * p)
    upper = np.where(active, np.floor(cap * sizes + 1e-9), 0).astype(np.int64)
    pruned = round_counts(s * sizes, upper, target)
    names = [i.name for i in infos]
    params = {"prior": prior.rule, "gamma": gamma, "cap": cap, "c": c, "mean_rr": mean_rr,
              "rr_at_prior": dict(zip(names, rr.tolist())), "m": dict(zip(names, m.tolist()))}
    return finish_allocation("rr", infos, S, pruned, params, prior=prior)


def _solve_scale(base: np.ndarray, sizes: np.ndarray, goal: float, cap: float) -> float:
    """c with Σ n_ℓ·min(cap, c·base_ℓ) = goal (water-filling over the capping breakpoints)."""
    on = base > 0
    if goal <= 0:
        return 0.0
    if goal > cap * float(sizes[on].sum()) + 1e-6:
        raise OnnxDiagError(f"The budget needs {goal:.0f} pruned weights but the layers the "
                            f"prior prunes hold only {cap * sizes[on].sum():.0f} under cap {cap}; "
                            "raise the cap (--rr-cap) or lower S.")
    order = np.argsort(cap / base[on])
    b, n = base[on][order], sizes[on][order].astype(np.float64)
    capped_sum, c = 0.0, 0.0
    for k in range(len(b)):
        c = (goal - capped_sum) / float((b[k:] * n[k:]).sum())
        if c * b[k] <= cap:
            return c
        capped_sum += cap * n[k]
    return c


def allocate_rr_greedy(infos: Sequence[LayerInfo], S: float, rr_curves, keep=(), *,
                       cap: float = 0.99, step: float = 0.01,
                       marginal: bool = False) -> Allocation:
    """``rr-greedy`` / ``rr-marginal``: the literal greedy of METHODS §C3 (kept for reproduction).

    All layers start at 0; repeatedly the layer whose RR at its next step (``marginal``:
    increase of D_repair per removed weight) is lowest (ties: the larger layer, then the
    earlier) moves up by ``step`` sparsity, capped at ``cap``; the last move is partial so
    the budget holds exactly.  METHODS §C3 measured both collapsing at high S.
    """
    sizes, dense, target = _budget(infos, S, keep)
    top = int(round(cap / step))
    pruned = np.zeros(len(infos), dtype=np.int64)
    level = np.zeros(len(infos), dtype=np.int64)

    def key(i):
        s0, s1 = round(level[i] * step, 10), round((level[i] + 1) * step, 10)
        if not marginal:
            return rr_curves.rr_at(infos[i].name, s1)
        gain = prune_count(sizes[i], s1) - prune_count(sizes[i], s0)
        rise = rr_curves.d_repair_at(infos[i].name, s1) - rr_curves.d_repair_at(infos[i].name, s0)
        return rise / max(gain, 1)

    heap = [(key(i), -int(sizes[i]), i) for i in range(len(infos)) if not dense[i] and top > 0]
    heapq.heapify(heap)
    need, moves = target, 0
    while need > 0:
        if not heap:
            raise OnnxDiagError(f"{'rr-marginal' if marginal else 'rr-greedy'}: every layer is "
                                f"at the cap {cap} before the budget holds; raise the cap.")
        _, _, i = heapq.heappop(heap)
        level[i] += 1
        add = min(need, prune_count(sizes[i], round(level[i] * step, 10)) - pruned[i])
        pruned[i] += add
        need -= add
        moves += 1
        if level[i] < top:
            heapq.heappush(heap, (key(i), -int(sizes[i]), i))
    rule = "rr-marginal" if marginal else "rr-greedy"
    return finish_allocation(rule, infos, S, pruned, {"cap": cap, "step": step, "moves": moves})
