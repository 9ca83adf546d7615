"""Unstructured pruning, allocation, repair and repairability (METHODS §C).

- :mod:`.masks` (C1): :func:`magnitude_mask`, :func:`find_prunable`, :func:`apply_masks`.
- :mod:`.allocation` (C3): :func:`allocate_sparsity` → :class:`Allocation` (global,
  uniform, erk, lamp, rr, rr-greedy, rr-marginal), exact to the weight.
- :mod:`.repairability` (C2): :func:`compute_rr_curves` → :class:`RRCurves` (one capture
  pass, single layers evaluated offline in NumPy).
- :mod:`.repair` (C1): :func:`repair_model` (CR variants, BN recalibration, folded-BN
  affine) → repaired copy + :class:`RepairRecord`; :func:`recalibrate_batchnorm` (every
  BN of any model, e.g. after structured pruning).
- :mod:`.transition` (C4): :func:`agreement`, :func:`transition_band`, :func:`cts`.
- :mod:`.sweep` (C3–C4): :class:`~.sweep.Pruner` (a dense model prepared once) and
  :func:`~.sweep.run_sweep` over sparsity × allocation × repair; grid parsing, bands, winners.

No function modifies its input model; edits happen on copies.
"""

from .allocation import RULES, Allocation, allocate_sparsity
from .budget import LayerInfo, prune_count
from .masks import (
    apply_masks,
    describe_layers,
    find_prunable,
    magnitude_mask,
    make_masks,
    read_weights,
)
from .repair import (
    METHODS,
    BNRepair,
    LayerRepair,
    RepairRecord,
    recalibrate_batchnorm,
    repair_model,
)
from .repairability import DEFAULT_GRID, RRCurves, compute_rr_curves
from .transition import TransitionBand, agreement, cts, cts_band, transition_band

__all__ = [
    "DEFAULT_GRID", "METHODS", "RULES", "Allocation", "BNRepair", "LayerInfo", "LayerRepair",
    "RRCurves", "RepairRecord", "TransitionBand", "agreement", "allocate_sparsity",
    "apply_masks", "compute_rr_curves", "cts", "cts_band", "describe_layers", "find_prunable",
    "magnitude_mask", "make_masks", "prune_count", "read_weights", "recalibrate_batchnorm",
    "repair_model", "transition_band",
]
