"""Label-free transition detection from agreement curves (METHODS §C4).

Agr_X(S): the fraction of calibration images whose prediction after pruning to S and
repair X equals the dense model's.  ``agreement`` (**our default**): the transition is
where Agr_CR+BN falls from ``hi`` = 0.9 to ``lo`` = 0.5, interpolated linearly on the
grid.  ``cts``: CTS(S) = (Agr_CR+BN − Agr_BN) / (1 − Agr_BN + 1e-8), band {S : CTS ≥ ½ max}
— METHODS §C4 measured it as noise when every conv feeds a BN; report it, do not rely on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import OnnxDiagError


@dataclass(frozen=True)
class TransitionBand:
    """A range of S.  ``start`` / ``end``: where the curve crosses ``hi`` / ``lo`` (None: it
    never does on the grid); ``censored_start``: the curve is already below ``hi`` at the
    first grid point (``start`` is then that point); ``rule``: "agreement" or "cts"."""

    rule: str
    start: float | None
    end: float | None
    censored_start: bool = False
    hi: float | None = None
    lo: float | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def agreement(pred_a, pred_b) -> float:
    """Fraction of samples on which two predictions agree.

    Each argument is class labels ``(n,)`` or scores / logits ``(n, n_classes)`` (argmax).
    """
    a, b = _labels(pred_a), _labels(pred_b)
    if a.shape != b.shape or a.size == 0:
        raise OnnxDiagError(f"Predictions to compare have {a.size} and {b.size} samples; "
                            "give the same, non-empty calibration set to both.")
    return float(np.mean(a == b))


def _labels(pred) -> np.ndarray:
    pred = np.asarray(pred)
    return pred.argmax(axis=1) if pred.ndim == 2 else pred.reshape(-1)


def _check_grid(S_grid, values) -> tuple[np.ndarray, np.ndarray]:
    S, v = np.asarray(S_grid, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if S.shape != v.shape or S.ndim != 1 or S.size == 0:
        raise OnnxDiagError(f"Grid ({S.size}) and curve ({v.size}) differ in length.")
    if np.any(np.diff(S) <= 0):
        raise OnnxDiagError("The sparsity grid must be strictly increasing.")
    return S, v


def crossing(S_grid: Sequence[float], values: Sequence[float], level: float) -> float | None:
    """The first S where ``values`` falls below ``level``, linearly interpolated (None if never).

    A value equal to ``level`` counts as not yet below; the crossing lies between the
    last grid point at or above ``level`` and the next one below it.
    """
    S, v = _check_grid(S_grid, values)
    below = np.nonzero(v < level)[0]
    if below.size == 0:
        return None
    j = int(below[0])
    if j == 0:
        return float(S[0])
    s0, s1, v0, v1 = S[j - 1], S[j], v[j - 1], v[j]
    return float(s0 + (v0 - level) / (v0 - v1) * (s1 - s0))


def transition_band(S_grid: Sequence[float], agreement_crb: Sequence[float], hi: float = 0.9,
                    lo: float = 0.5) -> TransitionBand:
    """METHODS §C4 ``agreement``: the S range over which Agr_CR+BN falls from ``hi`` to ``lo``."""
    if not lo < hi:
        raise OnnxDiagError(f"Band levels need lo < hi, got lo={lo}, hi={hi}.")
    S, v = _check_grid(S_grid, agreement_crb)
    return TransitionBand("agreement", crossing(S, v, hi), crossing(S, v, lo),
                          censored_start=bool(v[0] < hi), hi=hi, lo=lo)


def cts(agr_crbn: Sequence[float], agr_bn: Sequence[float]) -> np.ndarray:
    """CTS(S) = (Agr_CR+BN − Agr_BN) / (1 − Agr_BN + 1e-8), elementwise (METHODS §C4)."""
    a, b = np.asarray(agr_crbn, dtype=np.float64), np.asarray(agr_bn, dtype=np.float64)
    if a.shape != b.shape:
        raise OnnxDiagError(f"Agreement curves differ in length ({a.size} vs {b.size}).")
    return (a - b) / (1.0 - b + 1e-8)


def cts_band(S_grid: Sequence[float], cts_values: Sequence[float]) -> TransitionBand:
    """{S : CTS(S) ≥ ½ max CTS} as its smallest and largest grid points (None when max ≤ 0).

    The set may have gaps; ``start`` / ``end`` span it.  Use :func:`cts_members` for the set.
    """
    members = cts_members(S_grid, cts_values)
    if members.size == 0:
        return TransitionBand("cts", None, None)
    return TransitionBand("cts", float(members[0]), float(members[-1]))


def cts_members(S_grid: Sequence[float], cts_values: Sequence[float]) -> np.ndarray:
    """The grid points with CTS ≥ ½ max CTS (empty when max CTS ≤ 0)."""
    S, v = _check_grid(S_grid, cts_values)
    top = float(np.max(v))
    return S[v >= 0.5 * top] if top > 0 else S[:0]
