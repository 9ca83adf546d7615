"""Exact weight budgets (SPEC C1, C3): prune counts, layer descriptions, integer rounding.

A sparsity ``s`` is read as the decimal it prints as (``0.95`` is 19/20), so
``prune_count(n, s) = ⌊s·n⌋`` is exact: no float rounding decides whether a weight
is pruned.  Every allocation prunes exactly ``prune_count(N, S)`` weights over the
``N`` prunable weights (**our default** rounding: floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from fractions import Fraction

import numpy as np

from ..errors import OnnxDiagError


def exact_fraction(s: float) -> Fraction:
    """``s`` as the exact decimal fraction it prints as; OnnxDiagError outside [0, 1]."""
    try:
        frac = Fraction(str(float(s)))
    except (TypeError, ValueError) as exc:
        raise OnnxDiagError(f"Sparsity {s!r} is not a number; give a value in [0, 1].") from exc
    if not 0 <= frac <= 1:
        raise OnnxDiagError(f"Sparsity {s} is outside [0, 1]; give e.g. 0.9 for 90 % pruned.")
    return frac


def prune_count(n: int, s: float) -> int:
    """Weights to prune out of ``n`` at sparsity ``s``: ⌊s·n⌋, computed exactly."""
    return math.floor(exact_fraction(s) * int(n))


@dataclass(frozen=True)
class LayerInfo:
    """What an allocation needs to know about one prunable layer (no model required).

    Fields:
        name: the layer's node name.
        shape: the weight shape in ERK order, ``(n_out, n_in / groups, *kernel)`` for a
            conv, ``(n_out, n_in)`` for a linear layer (whatever the stored layout).
        is_projection: a 1×1 shortcut conv (``force_projection``, SPEC C3).
        is_head: the classifier head.
    """

    name: str
    shape: tuple[int, ...]
    is_projection: bool = False
    is_head: bool = False

    @classmethod
    def conv(cls, name: str, n_in: int, n_out: int, kernel=(3, 3), *, groups: int = 1,
             is_projection: bool = False) -> LayerInfo:
        """A conv layer from its channel counts and kernel (``kernel`` int or tuple)."""
        kernel = (kernel, kernel) if isinstance(kernel, int) else tuple(kernel)
        return cls(name, (int(n_out), int(n_in) // int(groups), *map(int, kernel)),
                   is_projection=is_projection)

    @classmethod
    def linear(cls, name: str, n_in: int, n_out: int, *, is_head: bool = True) -> LayerInfo:
        """A Gemm / MatMul layer with ``n_in`` inputs and ``n_out`` outputs."""
        return cls(name, (int(n_out), int(n_in)), is_head=is_head)

    @property
    def n_weights(self) -> int:
        return int(np.prod(self.shape))

    @property
    def kernel(self) -> tuple[int, ...]:
        return tuple(self.shape[2:])

    @property
    def erk_raw(self) -> float:
        """ERK's density per unit ε: (n_in + n_out + Σ kernel) / (n_in·n_out·Π kernel)."""
        return float(sum(self.shape)) / float(self.n_weights)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["shape"] = list(self.shape)
        d["n_weights"] = self.n_weights
        return d


def round_counts(real: np.ndarray, upper: np.ndarray, total: int) -> np.ndarray:
    """Integers ``k`` with ``0 ≤ k ≤ upper`` and ``Σk = total``, closest to ``real``.

    Largest-remainder rounding: floor every value, then give one more to the
    largest fractional parts (ties: the earlier layer), then to any layer with
    room left.  ``real`` ``(n_layers,)`` should sum to within ``n_layers`` of ``total``.

    Raises:
        OnnxDiagError: ``total`` does not fit under ``upper``.
    """
    real = np.asarray(real, dtype=np.float64)
    upper = np.asarray(upper, dtype=np.int64)
    if total > int(upper.sum()) or total < 0:
        raise OnnxDiagError(f"Cannot place {total} pruned weights under the per-layer caps "
                            f"(room for {int(upper.sum())}); lower the sparsity or raise the cap.")
    k = np.clip(np.floor(real + 1e-9).astype(np.int64), 0, upper)
    need = int(total - k.sum())
    order = np.lexsort((np.arange(real.size), -(real - np.floor(real + 1e-9))))
    step = 1 if need > 0 else -1
    if step < 0:  # too many: take back from the smallest fractional parts first
        order = order[::-1]
    for pool in (order, np.argsort(-(upper - k) if step > 0 else -k, kind="stable")):
        for i in pool:
            if need == 0:
                return k
            if (step > 0 and k[i] < upper[i]) or (step < 0 and k[i] > 0):
                k[i] += step
                need -= step
    while need:  # large gaps (rare): fill the roomiest layers repeatedly
        room = upper - k if need > 0 else k
        i = int(np.argmax(room))
        move = min(abs(need), int(room[i])) * step
        k[i] += move
        need -= move
    return k
