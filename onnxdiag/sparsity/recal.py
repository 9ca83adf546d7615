"""BN recalibration inside a sequential pass and the tensors a pruning reaches
(docs/METHODS.md §C1), shared by the CR / BN repairs and the reconstruction repair (§E1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from ..graph._records import jsonable
from ..model.edit import ModelEditor
from ..model.optimize import bn_affine
from ..stats import Moments


@dataclass(frozen=True, eq=False)
class BNRepair:
    """New running statistics of one BatchNormalization: (C,) mean and unbiased var."""

    bn_node: str
    mean: np.ndarray
    var: np.ndarray
    n_samples: int

    def to_dict(self, *, arrays: bool = False) -> dict:
        d = {"bn_node": self.bn_node, "n_samples": self.n_samples}
        if arrays:
            d.update(mean=jsonable(self.mean), var=jsonable(self.var))
        return d


def recalibrate_bn(frontier: dict, editor: ModelEditor, bn, known=None) -> BNRepair:
    """Set ``bn``'s running mean / variance in ``editor`` to the batch statistics of its
    input cached in ``frontier`` (unbiased variance), or to ``known`` = (mean, var, n):
    those statistics when the caller already has them (e.g. a CR-scaled conv output,
    :func:`scaled_moments`), which saves the pass over the cached input."""
    if known is None:
        acc = Moments(bn_channels(frontier[bn.input[0]]), full=False)
        for x in frontier[bn.input[0]]:
            acc.update_channels(x)  # = update(channel_rows(x)) to float32 rounding
        known = acc.mean, acc.var(), acc.n
    mean, var, n = known
    for pos, value in ((3, mean), (4, var)):
        old = editor.value(bn.input[pos])
        if old is None:
            raise OnnxDiagError(f"Tensor {bn.input[pos]!r} is not a constant; cannot "
                                f"recalibrate BatchNormalization {bn.name!r}.")
        editor.set_input(bn.name, pos, value.reshape(old.shape).astype(old.dtype))
    return BNRepair(bn.name, mean, var, n)


def scaled_moments(repair) -> tuple:
    """(mean, var, n) of a conv output after a "scale" fold (a CR α, no shift) from the
    moments measured before it (a :class:`~onnxdiag.sparsity.fold.LayerRepair`): the cached
    output became α₃₂·y (α rounded to float32, as the patch multiplies), so its moments are
    α₃₂·μ^p and α₃₂²·σ^p², equal to a pass over the patched batches to float32 rounding."""
    a = np.asarray(repair.alpha, np.float32).astype(np.float64)
    n = repair.n_samples
    return a * repair.mean_pruned, (a * repair.sigma_pruned) ** 2, n


def deferred_bn(editor: ModelEditor, tensor: str, outputs=()) -> onnx.NodeProto | None:
    """The inference BatchNormalization that alone reads ``tensor`` (a conv output), with
    constant per-channel parameters: the sequential pass may then leave the cached
    tensor as measured after a "scale" fold and run that BN as :func:`bn_stand_in`
    (None otherwise, and when ``tensor`` is one of the pass's ``outputs``)."""
    if tensor in outputs or editor.uses(tensor) != 1:
        return None
    bn = editor.index.sole_consumer(tensor)
    if bn is None or bn.input[0] != tensor or bn_affine(bn, editor.index.get_constant) is None:
        return None
    return bn


def bn_stand_in(editor: ModelEditor, bn: onnx.NodeProto, alpha: np.ndarray
                ) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """What a segment runs instead of ``bn`` when its cached input y was not patched after
    its conv's weights were scaled by α: a BatchNormalization of y with scale s·α₃₂, bias
    b, mean 0, variance 1 and ε = 0, where ``bn`` (its parameters in ``editor`` now) is
    y ↦ s·y + b (:func:`~onnxdiag.model.optimize.bn_affine`) — ``bn`` applied to α₃₂·y
    (the patched cache, α rounded to float32 as the patch multiplies) to float32
    rounding, without a pass over the cache.
    Returns the node (same name, input and output) and the initializers it reads."""
    s, b = bn_affine(bn, editor.value)
    a32 = np.asarray(alpha, np.float32).astype(np.float64)
    values = (s * a32, b, np.zeros_like(b), np.ones_like(b))
    dtype = editor.value(bn.input[1]).dtype
    names = [editor.unique(f"{bn.name}_stand_in_{part}") for part in ("scale", "B", "mean",
                                                                       "var")]
    node = onnx.NodeProto()
    node.CopyFrom(bn)
    del node.input[1:]
    node.input.extend(names)
    kept = [a for a in node.attribute if a.name != "epsilon"]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute("epsilon", 0.0)])
    return node, [numpy_helper.from_array(v.astype(dtype), n) for v, n in zip(values, names)]


def bn_channels(arrays) -> int:
    """The channel count (axis 1) of a BatchNormalization's input batches."""
    return int(np.shape(arrays[0])[1])


def affected_tensors(index: GraphIndex, pruned_layers: list[str]) -> set[str]:
    """Tensors downstream of (and including) the outputs of the pruned layers."""
    todo = [t for name in pruned_layers for t in index.get_node(name).output]
    seen = set(todo)
    while todo:
        for node, _ in index.consumers_of(todo.pop()):
            for t in node.output:
                if t and t not in seen:
                    seen.add(t)
                    todo.append(t)
    return seen
