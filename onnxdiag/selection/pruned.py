"""Selection for a pruned deployment (docs/METHODS.md §A5): the label-free criteria of a
checkpoint that will be pruned to S, their combined ranking, and their evaluation
against the oracle *pruned* checkpoint.

Criteria, one value per checkpoint:

- ``dense:<readout>``: a readout of the dense checkpoint (§A2): "select, then prune";
- ``pruned:<readout>``: the same readout of the pruned and repaired model;
- ``agreement``: top-1 agreement of the pruned model with its own dense model on the
  calibration data (§C4), higher = the checkpoint survives pruning better;
- ``combined``: the mean of the checkpoint's ranks by ``dense:<select_by>`` and by
  ``agreement`` (rank 0 = best; lower = better): dense quality and damage together.

With labels the baseline ``dense:accuracy`` ("best dense, then prune": the checkpoint of
highest dense accuracy) is evaluated like the criteria, on the pruned accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .readouts import HEAD_GRAD_NAMES, READOUTS

#: The labelled baseline: the best dense checkpoint, then pruned.
BEST_DENSE = "dense:accuracy"


def is_label_free(readout: str, targets: str) -> bool:
    """Whether ``readout`` was computed without labels (``targets``: the resolved
    head-gradient targets)."""
    spec = READOUTS[readout]
    if spec.needs_labels:
        return False
    return not (readout in HEAD_GRAD_NAMES.values() and targets == "labels")


def rank(values: Sequence[float], direction: str) -> np.ndarray:
    """Rank of each value, 0 = best (``direction`` "lower" / "higher"); ties share the
    mean rank; a non-finite value ranks last."""
    from scipy.stats import rankdata

    v = np.asarray(values, dtype=np.float64)
    key = np.where(np.isfinite(v), v if direction == "lower" else -v, np.inf)
    return rankdata(key, method="average") - 1.0


def combined(dense_values: Sequence[float], dense_direction: str,
             agreement: Sequence[float]) -> np.ndarray:
    """The ``combined`` criterion: mean of the ranks by the dense readout and by the
    agreement (lower = better)."""
    return (rank(dense_values, dense_direction) + rank(agreement, "higher")) / 2.0


def criteria(dense: Sequence[dict], pruned: Sequence[dict], agreement: Sequence[float], *,
             select_by: str, targets: str) -> tuple[dict, dict, dict]:
    """(name -> series, name -> direction, name -> label-free) of every criterion.

    ``dense`` / ``pruned``: each checkpoint's readout values (``readouts.values``);
    readouts missing from any checkpoint, and context readouts, are left out.
    """
    series, directions, label_free = {}, {}, {}
    for prefix, rows in (("dense", dense), ("pruned", pruned)):
        for name, spec in READOUTS.items():
            if spec.direction == "context" or not all(name in r for r in rows):
                continue
            key = f"{prefix}:{name}"
            series[key] = [float(r[name]) for r in rows]
            directions[key], label_free[key] = spec.direction, is_label_free(name, targets)
    series["agreement"] = [float(a) for a in agreement]
    directions["agreement"], label_free["agreement"] = "higher", True
    key = f"dense:{select_by}"
    if key in series:
        series["combined"] = combined(series[key], directions[key], agreement).tolist()
        directions["combined"], label_free["combined"] = "lower", label_free[key]
    return series, directions, label_free


def ranking(series: dict, directions: dict, name: str = "combined") -> list[int]:
    """Checkpoint indices from best to worst by the criterion ``name`` (the agreement when
    the series lacks it); ties go to the later checkpoint, as in selection."""
    name = name if name in series else "agreement"
    r = rank(series[name], directions[name])
    return sorted(range(len(r)), key=lambda i: (r[i], -i))
