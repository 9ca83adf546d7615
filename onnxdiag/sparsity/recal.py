"""BN recalibration inside a sequential pass and the tensors a pruning reaches
(docs/METHODS.md §C1), shared by the CR / BN repairs and the reconstruction repair (§E1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from ..graph._records import jsonable
from ..model.edit import ModelEditor
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
