"""Scores → which channels to remove, as a replayable :class:`Plan` (docs/METHODS.md §B6).

Budgets (how many channels each group loses; which ones is always "lowest score first",
ties broken by a seeded random order):

- ``uniform`` (**our default**, FLOPs-matched across scores): ⌊ratio·n⌋ per group.
- ``reference``: per-group counts (or fractions) from a given allocation, e.g. another
  plan, so that every score prunes exactly the same number of channels per group.
- ``global``: one threshold over the per-group min–max-normalised scores, removing
  ⌊ratio·N⌋ of all N channels of the groups considered, at most ``caps`` of each group
  (default 0.9: keep ≥ 10 %).

Every group keeps at least one channel.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import onnx

from ..errors import OnnxDiagError
from ..graph import Structure, analyze_structure
from ..graph._records import jsonable
from ..model.io import check_output_path, model_hash, write_text_atomic
from .prune import PruneRecord, normalize_removed, prune_channels
from .scores import normalize_minmax, score_groups

PLAN_SCHEMA = "onnxdiag.plan/1"
BUDGETS = ("uniform", "reference", "global")
GLOBAL_CAP = 0.9
_EPS = 1e-9  # ⌊0.7·10⌋ must be 7 despite 0.7·10 = 6.999…


@dataclass(frozen=True, eq=False)
class Plan:
    """Channels to remove per group, with the model it was made for and its effect.

    Fields:
        model_hash: :func:`onnxdiag.model_io.model_hash` of the source model.
        score: name of the score used ("magnitude", "ix", …, "custom").
        budget: "uniform" | "reference" | "global"; ratio: the channel fraction asked for.
        head: the head node the structure was analysed with (None: no head).
        features: the features tensor named for that head (``--features``), or None.
        removed: group id -> removed channels (ascending; empty for groups left whole).
        n_channels: group id -> channels before pruning (checked on replay).
        params_before / params_after, flops_before / flops_after: from
            :func:`analyze_structure` on the source and the pruned model.
        settings: seed, caps, reference counts, groups considered.
    """

    model_hash: str
    score: str
    budget: str
    ratio: float | None
    head: str | None
    removed: dict[int, tuple[int, ...]]
    n_channels: dict[int, int]
    params_before: int
    params_after: int
    flops_before: int | None
    flops_after: int | None
    settings: dict = field(default_factory=dict)
    features: str | None = None
    schema: str = PLAN_SCHEMA

    @property
    def n_removed(self) -> int:
        return sum(len(v) for v in self.removed.values())

    def to_dict(self) -> dict:
        """JSON-able dict of every field (group ids become strings)."""
        return {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping) -> Plan:
        """Inverse of :meth:`to_dict`; raises OnnxDiagError on a malformed or foreign dict."""
        if not str(data.get("schema", "")).startswith("onnxdiag.plan/"):
            raise OnnxDiagError(f"Not an onnxdiag pruning plan (schema {data.get('schema')!r}); "
                                "make one with plan_pruning / `onnxdiag prune-channels`.")
        try:
            kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            kwargs["removed"] = {int(k): tuple(int(c) for c in v)
                                 for k, v in data["removed"].items()}
            kwargs["n_channels"] = {int(k): int(v) for k, v in data["n_channels"].items()}
            return cls(**kwargs)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise OnnxDiagError(f"Malformed pruning plan ({type(exc).__name__}: {exc}); "
                                "regenerate it.") from exc


def plan_pruning(model: onnx.ModelProto, structure: Structure, scores: Mapping,
                 ratio: float | None, *, budget: str = "uniform", reference=None,
                 caps: float | Mapping[int, float] | None = None, seed: int = 0,
                 score_name: str = "custom", groups: Iterable[int] | None = None,
                 round_to: int | None = None, features: str | None = None) -> Plan:
    """A :class:`Plan` removing the lowest-scored channels of each group (docs/METHODS.md §B6).

    Args:
        model, structure: the source model and its :func:`analyze_structure`.
        scores: layer-level ``{layer: (n_out,)}`` or group-level ``{group_id: (n,)}``
            (higher = keep); see :func:`score_groups`.
        ratio: fraction of channels to remove (0 ≤ ratio < 1); unused by ``reference``.
        budget: "uniform" | "reference" | "global" (module docstring).
        reference: for ``reference``: ``{group_id: count (int) or fraction (float)}`` or
            a :class:`Plan` (its removed counts).
        caps: most channels removable per group, as a fraction (one for all, or per group
            id); default 0.9 for ``global``, none otherwise.  A group always keeps one.
        seed: tie-breaking order.  score_name: recorded in the plan.
        groups: group ids to consider (default: every prunable group; for ``reference``,
            the groups it names).
        round_to: keep a multiple of this many channels in every group the budget
            narrows (the kept count rounded up, at most the group's size; the channels
            spared are the best-scored of those the budget chose; attention-head groups
            are not rounded: a head is head_dim features already). ONNX Runtime's blocked
            CPU convs run widths that are not a multiple of their block (16 with AVX-512,
            8 with AVX2) at the cost of the next multiple or slower. None / 1: exact.
        features: the features tensor ``structure``'s head was named with, recorded so
            that :func:`replay_plan` analyses the model the same way.

    Prunes a copy to measure params / FLOPs after.  Never modifies ``model``.

    Raises:
        OnnxDiagError: unknown budget, ratio outside [0, 1), missing reference, a group
            that is not prunable or has no scores.
    """
    counts = _reference_counts(structure, reference) if budget == "reference" else None
    _check_args(budget, ratio, counts)
    if round_to is not None:
        from ..sparsity.repairability import positive_int

        round_to = positive_int(round_to, f"round_to must be a positive integer; got "
                                          f"{round_to!r}.")
    considered = list(counts) if counts is not None else _considered(structure, groups)
    sizes = {g: structure.groups[g].n_channels for g in considered}
    removed = _choose(structure, scores, sizes, budget, ratio, counts, caps, seed, round_to)
    _, record = prune_planned(model, structure, removed)
    return Plan(
        model_hash=model_hash(model), score=score_name, budget=budget, ratio=ratio,
        head=structure.head.node_name if structure.head is not None else None,
        removed=dict(sorted(removed.items())), n_channels=dict(sorted(sizes.items())),
        params_before=record.params_before, params_after=record.params_after,
        flops_before=record.flops_before, flops_after=record.flops_after,
        settings={"seed": seed, "caps": jsonable(caps), "groups": sorted(considered),
                  "reference": None if counts is None else jsonable(counts),
                  "round_to": None if round_to in (None, 1) else round_to},
        features=features)


def _choose(structure, scores, sizes, budget, ratio, counts, caps, seed, round_to) -> dict:
    """{group id: channels to remove} of the groups ``sizes`` names, by the budget."""
    group_scores = score_groups(structure, scores, list(sizes))
    rng = np.random.default_rng(seed)
    limits = {g: _limit(n, _cap_of(caps, g, budget)) for g, n in sizes.items()}
    if budget == "global":
        removed = _select_global(group_scores, ratio, limits, rng)
    else:
        want = counts if counts is not None else \
            {g: math.floor(ratio * n + _EPS) for g, n in sizes.items()}
        removed = {g: _lowest(group_scores[g], min(want.get(g, 0), limits[g]), rng)
                   for g in sizes}
    if round_to is not None and round_to > 1:  # heads are blocks already: left as chosen
        removed = {g: chs if structure.groups[g].block_size > 1 else
                   _round_kept(chs, sizes[g], round_to, group_scores[g])
                   for g, chs in removed.items()}
    return removed


def prune_planned(model: onnx.ModelProto, structure: Structure,
                  removed) -> tuple[onnx.ModelProto, PruneRecord]:
    """:func:`~onnxdiag.structured.prune.prune_channels` of ``removed``, whatever the head.

    prune_channels measures the pruned model by analysing it again from the head's node
    name alone, which fails for a head whose features had to be named (``--features``).
    The widths, parameters and FLOPs it measures do not depend on which layer is the
    head, so the structure goes in without one. Never modifies ``model``.
    """
    return prune_channels(model, dataclasses.replace(structure, head=None), removed)


def replay_plan(model: onnx.ModelProto, plan: Plan) -> tuple[onnx.ModelProto, PruneRecord]:
    """Apply ``plan`` to the model it was made for: same channels, same output bytes.

    Never modifies ``model``.

    Raises:
        OnnxDiagError: the model's hash is not the plan's, or its groups differ.
    """
    return prune_planned(model, plan_structure(model, plan), plan.removed)


def plan_structure(model: onnx.ModelProto, plan: Plan) -> Structure:
    """The structure of ``model`` that ``plan`` was made on (its head and features),
    after checking the plan is this model's.

    Raises:
        OnnxDiagError: the model's hash is not the plan's, or its groups differ.
    """
    found = model_hash(model)
    if found != plan.model_hash:
        raise OnnxDiagError(f"The plan was made for model {plan.model_hash[:12]}…, not this "
                            f"one ({found[:12]}…); load the model the plan was made from.")
    structure = analyze_structure(model, head=plan.head, features=plan.features,
                                  require_head=plan.head is not None)
    for gid, n in plan.n_channels.items():
        if gid >= len(structure.groups) or structure.groups[gid].n_channels != n:
            raise OnnxDiagError(f"Channel group {gid} of this model does not match the plan "
                                f"({n} channels); the plan was made by another version.")
    return structure


def save_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Write ``plan`` as JSON (atomically); returns the path."""
    out = check_output_path(path)
    return write_text_atomic(out, json.dumps(plan.to_dict(), indent=1) + "\n")


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a plan written by :func:`save_plan`; raises OnnxDiagError if unreadable."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OnnxDiagError(f"Cannot read pruning plan '{path}' ({exc}); give the JSON file "
                            "written by save_plan.") from exc
    if not isinstance(data, dict):
        raise OnnxDiagError(f"Pruning plan '{path}' is not a JSON object; regenerate it.")
    return Plan.from_dict(data)


# -- budgets ---------------------------------------------------------------------------------
def _check_args(budget: str, ratio, counts) -> None:
    if budget not in BUDGETS:
        raise OnnxDiagError(f"Unknown budget {budget!r}; use one of {', '.join(BUDGETS)}.")
    if counts is None and (ratio is None or not 0 <= ratio < 1):
        raise OnnxDiagError(f"Pruning ratio {ratio!r} must be in [0, 1) (fraction of channels "
                            "removed), e.g. 0.5.")


def _considered(structure: Structure, groups) -> list[int]:
    if groups is None:
        return [g.group_id for g in structure.groups if g.prunable]
    ids = sorted({int(g) for g in groups})
    normalize_removed(structure, {g: [] for g in ids})  # unknown ids raise
    blocked = [g for g in ids if not structure.groups[g].prunable]
    if blocked:
        g = structure.groups[blocked[0]]
        raise OnnxDiagError(f"Channel group {g.group_id} cannot be pruned: {g.reason}.")
    return ids


def _reference_counts(structure: Structure, reference) -> dict[int, int]:
    if reference is None:
        raise OnnxDiagError("budget='reference' needs a reference allocation: a plan or "
                            "{group_id: channels to remove}.")
    if isinstance(reference, Plan):
        reference = {g: len(v) for g, v in reference.removed.items()}
    counts = {}
    for key, value in reference.items():
        gid = int(key)
        n = structure.groups[_considered(structure, [gid])[0]].n_channels
        counts[gid] = int(value) if isinstance(value, (int, np.integer)) \
            else math.floor(float(value) * n + _EPS)
    return dict(sorted(counts.items()))


def _cap_of(caps, gid: int, budget: str) -> float:
    if caps is None:
        return GLOBAL_CAP if budget == "global" else 1.0
    return float(caps.get(gid, 1.0)) if isinstance(caps, Mapping) else float(caps)


def _limit(n: int, cap: float) -> int:
    """Most channels a group of ``n`` may lose: ⌊cap·n⌋, keeping at least one."""
    return max(0, min(n - 1, math.floor(cap * n + _EPS)))


def _round_kept(removed: tuple[int, ...], n: int, multiple: int,
                scores: np.ndarray) -> tuple[int, ...]:
    """``removed`` shrunk so that the kept count is a multiple of ``multiple`` (rounded
    up, at most ``n``): the best-scored of the removed channels are spared (stable)."""
    if not removed:
        return removed
    kept = min(n, -(-(n - len(removed)) // multiple) * multiple)
    order = sorted(removed, key=lambda c: scores[c])  # stable: ties keep channel order
    return tuple(sorted(order[:n - kept]))


def _lowest(scores: np.ndarray, k: int, rng: np.random.Generator) -> tuple[int, ...]:
    """Indices of the ``k`` lowest scores (ties in a seeded random order), ascending."""
    order = np.lexsort((rng.permutation(scores.size), scores))
    return tuple(sorted(int(i) for i in order[:max(k, 0)]))


def _select_global(group_scores: dict[int, np.ndarray], ratio: float, limits: dict[int, int],
                   rng: np.random.Generator) -> dict[int, tuple[int, ...]]:
    """One threshold over per-group min–max-normalised scores, within each group's limit."""
    if not group_scores:
        return {}
    gids = np.concatenate([np.full(s.size, g) for g, s in group_scores.items()])
    chans = np.concatenate([np.arange(s.size) for s in group_scores.values()])
    norm = np.concatenate([normalize_minmax(s) for s in group_scores.values()])
    budget = math.floor(ratio * norm.size + _EPS)
    chosen: dict[int, list[int]] = {g: [] for g in group_scores}
    for i in np.lexsort((rng.permutation(norm.size), norm)):
        if budget == 0:
            break
        g = int(gids[i])
        if len(chosen[g]) < limits[g]:
            chosen[g].append(int(chans[i]))
            budget -= 1
    return {g: tuple(sorted(v)) for g, v in chosen.items()}
