"""Channel-space rules for token models (docs/METHODS.md §D), used by :mod:`._rules`.

In a transformer the channels are the last axis of (N, T, D) tensors: Reshapes regroup
the leading axes (GPT-2's Gemm on N·T rows) or split the channels into heads; a Gather
picks tokens; embedding tables and class tokens are constants indexed by the channels;
LayerNorm / RMSNorm normalise each token across them (one value per channel in γ, β).
"""

from __future__ import annotations

import numpy as np
import onnx

from ._spaces import Space, Tracker
from .index import get_attr
from .shapes import literal_position, reshape_target, shape_value

_FOLLOWED = ("Expand", "Identity", "Cast", "Tile")


def reshape_channels_last(t: Tracker, node: onnx.NodeProto, space: Space) -> Space | None:
    """A Reshape of a tensor whose channels are its last axis: leading axes regrouped
    (the space moves to the new last axis) or the channels split into heads (the space
    ends here: :mod:`onnxdiag.graph.attention` forms the heads' groups); else None,
    having blocked the space."""
    target = reshape_target(t.index, node)
    n = space.n_channels
    if target is None or space.block != 1 or not target:
        t.unknown(node, [space], "reshapes across the channel axis")
        return None
    shape = t.index.shape(node.input[0])
    if target[-1] == n or (target[-1] is not None and shape and target[-1] == shape[-1]):
        _literal(t, node, space, len(target) - 1, "channels")
        return Space(space.segments, len(target) - 1, len(target))
    tail = [d for d in target[space.rank - 1:]]
    if len(tail) in (2, 3) and all(isinstance(d, int) and d > 0 for d in tail) \
            and int(np.prod(tail)) == n:
        t.block(space, f"Reshape {node.name!r} splits the {n} channels into "
                       f"{' x '.join(map(str, tail))} (attention heads)")
        return None
    t.unknown(node, [space], "reshapes across the channel axis")
    return None


def _literal(t: Tracker, node: onnx.NodeProto, space: Space, position: int,
             meaning: str) -> None:
    """Record a shape constant holding the channel count literally (to rewrite)."""
    raw = shape_value(t.index, node.input[1])
    if raw is None or position >= len(raw) or raw[position] != space.n_channels:
        return  # copied (0) or inferred (-1): nothing to rewrite
    source = literal_position(t.index, node.input[1], position)
    if source is None:
        return  # computed from another tensor's shape: follows it
    record = (node.name, 1, position, space.n_channels, meaning, *source)
    t.add_reshape(space, record)


def gather(t: Tracker, node: onnx.NodeProto, ins) -> Space | None:
    """Gather along a non-channel axis (a token picked, e.g. the class token)."""
    space = t.only_first(node, ins)
    axis = int(get_attr(node, "axis", 0)) % space.rank
    idx_rank = t.index.rank(node.input[1])
    if axis == space.axis or idx_rank is None or space.block != 1:
        t.unknown(node, ins, "gathers along the channel axis (or unknown indices)")
        return None
    new_axis = space.axis if space.axis < axis else space.axis - 1 + idx_rank
    return space.moved(new_axis, space.rank - 1 + idx_rank)


def embedding_source(t: Tracker, node: onnx.NodeProto) -> Space | None:
    """Rows of a constant 2-D table picked by indices (a token / position embedding):
    its columns are channels no layer produces, a group without members."""
    if node.op_type != "Gather" or int(get_attr(node, "axis", 0)) != 0:
        return None
    table = t.index.get_constant(node.input[0])
    rank = t.index.rank(node.output[0])
    if table is None or table.ndim != 2 or table.dtype.kind != "f" or rank is None \
            or table.shape[1] < 2:
        return None
    space = t.new_source(int(table.shape[1]), rank - 1, rank, "embedding")
    t.add_param(space, node, 0, 1)
    return space


def constant_origin(t: Tracker, tensor: str) -> tuple[onnx.NodeProto, int, np.ndarray] | None:
    """``(node, input index, value)`` of the constant a tensor broadcasts (Expand /
    Tile / Identity / Cast of a constant, e.g. a class token expanded to the batch)."""
    node = t.index.producer.get(tensor)
    for _ in range(4):
        if node is None or node.op_type not in _FOLLOWED:
            return None
        value = t.index.get_constant(node.input[0])
        if value is not None:
            return node, 0, value
        node = t.index.producer.get(node.input[0])
    return None


def norm(t: Tracker, found, space: Space | None) -> Space | None:
    """A LayerNorm / RMSNorm (:class:`onnxdiag.graph.norms.Norm`) over the channel axis:
    its γ and β are per-channel constants; over another axis it mixes channels."""
    if space is None:
        return None
    node = t.index.node_by_name[found.nodes[-1]]
    fake = onnx.helper.make_node(found.kind, [found.input], [found.output], name=found.nodes[0])
    if space.axis != space.rank - 1 or found.axis not in (-1, space.rank - 1) \
            or space.block != 1:
        t.unknown(fake, [space], "normalises across other axes than the channels")
        return None
    for name, i, tensor in found.params:
        value = t.index.get_constant(tensor)
        if value is None or value.size != space.n_channels:
            t.unknown(fake, [space], f"has a parameter {tensor!r} that is not per channel")
            return None
        t.add_param(space, t.index.node_by_name[name], i, max(value.ndim - 1, 0))
    t.add_kind(space, found.kind)
    rank = t.rank_of(node.output[0], space.rank)
    return space.moved(rank - 1, rank)
