"""Exact weight budgets (METHODS §C1, C3): prune counts, layer descriptions, integer rounding.

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
        is_projection: a 1×1 shortcut conv (``force_projection``, METHODS §C3).
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


def count_sparsity(k: int, n: int) -> float:
    """The shortest decimal ``s`` with ``prune_count(n, s) == k`` (``0 ≤ k ≤ n``), as a
    float that prints as that decimal: a sparsity that prunes exactly ``k`` of ``n``."""
    if not 0 <= k <= n or n <= 0:
        raise ValueError(f"k={k} outside [0, n={n}]")
    digits = 0
    while True:
        scale = 10 ** digits
        d = Fraction(math.ceil(Fraction(k * scale, n)), scale)
        if d * n < k + 1:  # ⌊d·n⌋ = k (d ≥ k/n by construction)
            return float(d)
        digits += 1


@dataclass(frozen=True)
class ModelBudget:
    """A global sparsity S of the whole model, placed on the layers the pruner supports.

    Fields:
        target: S, a fraction of every conv / linear weight the model computes with.
        n_model: N, those weights; n_supported: the weights of the layers the pruner
            supports (Conv, Gemm, MatMul, docs/METHODS.md §C1), kept-dense ones included;
            n_dense: of those, the weights of the layers kept dense.
        n_pruned: ⌊S·N⌋, exactly.
        sparsity_supported: S' with ⌊S'·n_supported⌋ = n_pruned (S itself when every layer
            is supported): the budget the allocation spreads over the supported layers.
        unsupported: ``{layer, op_type, n_weights, reason}`` of every other layer.
    """

    target: float
    n_model: int
    n_supported: int
    n_dense: int
    n_pruned: int
    sparsity_supported: float
    unsupported: tuple = ()

    @property
    def room(self) -> int:
        """Weights the supported layers that are not kept dense can give."""
        return self.n_supported - self.n_dense

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["unsupported"] = [dict(u) for u in self.unsupported]  # copies
        return d


def plan_model_budget(S: float, layers, supported, keep_dense=()) -> ModelBudget:
    """The budget of ``S`` over the whole model (docs/METHODS.md §C3: S is a fraction of every
    conv / linear weight).

    ``layers``: every weighted layer of the model (:class:`~onnxdiag.graph.Layer` records
    of ``structure.layers``); ``supported``: those the pruner edits
    (:func:`~onnxdiag.sparsity.find_prunable`: every Conv, Gemm and MatMul with a constant
    weight); ``keep_dense``: names among them left dense. The other layers (ConvTranspose,
    computed weights, Gemm with transA) count in N but stay dense.

    Raises:
        OnnxDiagError: no supported layer, or ⌊S·N⌋ exceeds what the supported layers not
            kept dense hold.
    """
    if not supported:
        raise OnnxDiagError(no_prunable_message(layers))
    names = {la.node_name for la in supported}
    size = {la.node_name: int(np.prod(la.weight_shape)) for la in layers}
    others = tuple({"layer": la.node_name, "op_type": la.op_type,
                    "n_weights": size[la.node_name], "reason": _why_unsupported(la)}
                   for la in layers if la.node_name not in names)
    n_sup = sum(int(np.prod(la.weight_shape)) for la in supported)
    n_dense = sum(int(np.prod(la.weight_shape)) for la in supported
                  if la.node_name in set(keep_dense))
    n_model = n_sup + sum(o["n_weights"] for o in others)
    k = prune_count(n_model, S)
    budget = ModelBudget(float(S), n_model, n_sup, n_dense, k,
                         float(S) if not others else count_sparsity(min(k, n_sup), n_sup),
                         others)
    if k > budget.room:
        raise OnnxDiagError(_unmet_message(budget, others))
    return budget


#: The refusal when a model has no layer the pruner edits.
NO_PRUNABLE = ("The model has no prunable layer (a Conv, Gemm or MatMul with a constant "
               "weight); `onnxdiag inspect MODEL` shows its layers.")


def no_prunable_message(layers) -> str:
    """:data:`NO_PRUNABLE`, with why the first weighted layer is not prunable and, when its
    weight is dequantized (a QDQ model), the fix: prune the float model, then quantize."""
    if not layers:
        return NO_PRUNABLE
    why = _why_unsupported(layers[0])
    fix = (" Prune the float model, then quantize it." if "DequantizeLinear" in why else "")
    head, tail = NO_PRUNABLE.split("; ", 1)
    return f"{head}: {layers[0].node_name!r}: {why}.{fix} {tail[0].upper()}{tail[1:]}"


def _why_unsupported(layer) -> str:
    if layer.note and "not supported for pruning" in layer.note:
        return [p for p in layer.note.split("; ") if "not supported" in p][0]
    return f"{layer.op_type} is not prunable"


def _layer_list(others) -> str:
    shown = ", ".join(f"{o['op_type']} {o['layer']!r} with {o['n_weights']:,} weights"
                      for o in others[:3])
    return shown + (f" and {len(others) - 3} more" if len(others) > 3 else "")


def _unmet_message(budget: ModelBudget, others) -> str:
    most = math.floor(1000 * budget.room / budget.n_model) / 1000
    where = f"; not prunable: {_layer_list(others)}" if others else ""
    dense = f", {budget.n_dense:,} more kept dense" if budget.n_dense else ""
    return (f"Sparsity {budget.target:g} asks for {budget.n_pruned:,} of the model's "
            f"{budget.n_model:,} conv/linear weights, but the layers that can be pruned "
            f"hold {budget.room:,}{dense}{where}. Give a sparsity of at most {most:g}"
            + (" or keep fewer layers dense." if budget.n_dense else "."))
