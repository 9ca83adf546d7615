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


def recalibrate_bn(frontier: dict, editor: ModelEditor, bn) -> BNRepair:
    """Set ``bn``'s running mean / variance in ``editor`` to the batch statistics of its
    input cached in ``frontier`` (unbiased variance)."""
    acc = Moments(bn_channels(frontier[bn.input[0]]), full=False)
    for x in frontier[bn.input[0]]:
        acc.update_axis(x, 1)  # = update(channel_rows(x)), without the transposed copy
    mean, var = acc.mean, acc.var()
    for pos, value in ((3, mean), (4, var)):
        old = editor.value(bn.input[pos])
        if old is None:
            raise OnnxDiagError(f"Tensor {bn.input[pos]!r} is not a constant; cannot "
                                f"recalibrate BatchNormalization {bn.name!r}.")
        editor.set_input(bn.name, pos, value.reshape(old.shape).astype(old.dtype))
    return BNRepair(bn.name, mean, var, acc.n)


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
