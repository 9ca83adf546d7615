"""Sparsity grids and comma-separated choices as the sweep and rr verbs parse them."""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

from ..errors import OnnxDiagError

#: Most grid points a sparsity specification may expand to (guards against typos).
MAX_GRID_POINTS = 1000


def parse_sparsity_grid(spec) -> tuple[float, ...]:
    """Sparsities from ``"0.90:0.97:0.005"`` (start:stop:step, stop included), ``"0.9,0.95"``
    (pieces may mix both forms) or a number / list of numbers; sorted, unique, in [0, 1).

    Steps are exact decimals, so 0.90:0.97:0.005 gives 15 points without float drift.

    Raises:
        OnnxDiagError: a malformed piece, a value outside [0, 1), or too many points.
    """
    if isinstance(spec, (int, float)):
        spec = [spec]
    pieces = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    values: set[Decimal] = set()
    for piece in pieces:
        if isinstance(piece, str) and ":" in piece:
            values |= _expand_range(piece, spec)
        else:
            values.add(_decimal(piece, spec))
    if not values:
        raise OnnxDiagError(f"Sparsity grid {spec!r} is empty; give e.g. 0.90:0.97:0.005.")
    bad = [v for v in values if not 0 <= v < 1]
    if bad:
        raise OnnxDiagError(f"Sparsity {bad[0]} in {spec!r} is outside [0, 1); give fractions "
                            "such as 0.95 for 95 % of the prunable weights removed.")
    return tuple(float(v) for v in sorted(values))


def _decimal(text, spec) -> Decimal:
    try:
        value = Decimal(str(text).strip())
    except InvalidOperation:
        raise OnnxDiagError(f"Sparsity grid {spec!r}: {text!r} is not a number; give e.g. "
                            "0.90:0.97:0.005 or 0.9,0.95.") from None
    if not value.is_finite():
        raise OnnxDiagError(f"Sparsity grid {spec!r}: {text!r} is not a finite number.")
    return value


def _expand_range(piece: str, spec) -> set[Decimal]:
    parts = piece.split(":")
    if len(parts) != 3:
        raise OnnxDiagError(f"Sparsity range {piece!r} needs start:stop:step, e.g. "
                            "0.90:0.97:0.005.")
    start, stop, step = (_decimal(p, spec) for p in parts)
    if step <= 0 or stop < start:
        raise OnnxDiagError(f"Sparsity range {piece!r} needs step > 0 and stop >= start.")
    n = int((stop - start) / step) + 1
    if n > MAX_GRID_POINTS:
        raise OnnxDiagError(f"Sparsity range {piece!r} has {n} points (at most "
                            f"{MAX_GRID_POINTS}); use a larger step.")
    return {start + i * step for i in range(n)}


def parse_choices(spec, known: Sequence[str], what: str, *, all_means=None) -> list[str]:
    """Names from ``"a,b"`` (or a list); ``"all"`` gives ``all_means`` (default ``known``).

    Raises OnnxDiagError naming an unknown choice and listing the known ones.
    """
    if isinstance(spec, str):
        if spec.strip() == "all":
            return list(all_means or known)
        spec = [p.strip() for p in spec.split(",") if p.strip()]
    names = list(dict.fromkeys(spec))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise OnnxDiagError(f"Unknown {what} {unknown[0] if unknown else '(none)'!r}; choose "
                            f"from {', '.join(known)} (comma-separated) or 'all'.")
    return names
