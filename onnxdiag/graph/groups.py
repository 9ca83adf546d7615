"""Coupled output channels (METHODS §B6; Torch-Pruning's DepGraph idea on ONNX).

Each layer's output channels open a channel space.  Spaces are tied index by index
(union-find) through element-wise ops between tensors (residual Add, gating Mul),
depthwise convs, and channel-preserving ops (BN, activations, pooling, Dropout,
per-channel constants).  Concat does not tie spaces: it lays them side by side, so
a consumer of a concat reads each space at an offset.  Flatten/Reshape before a
Gemm/MatMul maps channel c to a block of ``block_size`` consecutive features.
Anything not understood makes the spaces it touches not prunable, naming the op.
Never modifies the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import onnx

from ._records import jsonable
from ._rules import visit
from ._spaces import Space, Tracker
from .index import GraphIndex
from .layers import Layer


@dataclass(frozen=True)
class ChannelConsumer:
    """A node reading a group's channels: input feature/channel of group channel c is
    ``(channel_offset + c) * block_size + j`` for ``j < block_size``."""

    node_name: str
    op_type: str
    input_index: int
    channel_offset: int
    block_size: int = 1


@dataclass(frozen=True)
class ChannelParam:
    """A constant indexed by a group's channels (BN statistics, per-channel Mul/Add,
    PRelu slope, a separate bias Add): entry ``channel_offset + c`` along ``axis`` of
    ``tensor_name``.  ``source`` is the initializer behind it (through Identity nodes;
    exporters share identical initializers this way), None if computed otherwise."""

    node_name: str
    input_index: int
    tensor_name: str
    axis: int
    channel_offset: int = 0
    source: str | None = None


@dataclass(frozen=True)
class ChannelGroup:
    """Output channels of ``members`` that must be pruned together, index by index.

    Fields:
        group_id: position in :func:`find_channel_groups`' list.
        members: layers whose output channel ``member_offsets[k] + c`` is group channel c
            (offsets are non-zero only for a depthwise conv reading a concat).
        n_channels: size of the group.
        kinds: how it was formed: chain, residual, depthwise, concat, flatten, mul.
        consumers: layers reading the channels (their input side shrinks when pruned).
        params: constants that must be sliced with the channels.
        prunable: False when the group reaches the head's output (classes), a graph
            output, or an op not understood; ``reason`` says which (";"-joined).
    """

    group_id: int
    members: tuple[str, ...]
    member_offsets: tuple[int, ...]
    n_channels: int
    kinds: tuple[str, ...]
    consumers: tuple[ChannelConsumer, ...]
    params: tuple[ChannelParam, ...]
    prunable: bool
    reason: str

    def to_dict(self) -> dict:
        """JSON-able dict of every field."""
        return {f.name: jsonable([c.__dict__ for c in getattr(self, f.name)]
                                 if f.name in ("consumers", "params") else getattr(self, f.name))
                for f in fields(self)}


def find_channel_groups(model: onnx.ModelProto | GraphIndex,
                        layers: list[Layer]) -> list[ChannelGroup]:
    """Channel groups of ``layers`` (from :func:`find_layers`), ordered by first member.

    Every layer's output belongs to exactly one group (a layer can be in several only
    as a depthwise conv over a concat).  Never modifies ``model``.
    """
    index = model if isinstance(model, GraphIndex) else GraphIndex(model)
    by_name = {layer.node_name: layer for layer in layers}
    tracker = Tracker(index)
    for node in index.nodes:
        layer = by_name.get(node.name)
        if layer is not None:
            _visit_layer(tracker, node, layer)
        else:
            visit(tracker, node)
    for name in index.outputs:
        space = tracker.spaces.get(name)
        if space is not None:
            tracker.block(space, f"reaches graph output {name!r}")
    return _records(tracker)


def get_group(groups: list[ChannelGroup], node_name: str) -> ChannelGroup:
    """The group whose members include layer ``node_name``; raises KeyError otherwise."""
    for group in groups:
        if node_name in group.members:
            return group
    names = sorted({m for g in groups for m in g.members})
    raise KeyError(f"No channel group holds layer {node_name!r}; layers (first 5 of "
                   f"{len(names)}): {', '.join(names[:5])}")


def _visit_layer(tracker: Tracker, node: onnx.NodeProto, layer: Layer) -> None:
    index = tracker.index
    space = tracker.spaces.get(layer.input)
    rank_in = index.rank(layer.input) or (len(layer.kernel) + 2 if layer.kernel else 2)
    channel_axis = 1 if layer.op_type.startswith("Conv") else rank_in - 1
    if space is not None and (space.axis != channel_axis):
        tracker.block(space, f"{layer.op_type} {layer.node_name!r} reads another axis")
        space = None
    rank_out = index.rank(layer.output) or rank_in
    out_axis = 1 if layer.op_type.startswith("Conv") else rank_out - 1
    if layer.depthwise and layer.n_out == layer.n_in and layer.op_type == "Conv":
        if space is not None and space.block == 1:
            for seg in space.segments:
                tracker.add_member(seg, layer.node_name, "depthwise")
            tracker.spaces[layer.output] = Space(space.segments, out_axis, rank_out)
            return
    if space is not None:
        tracker.add_consumer(space, node, 0)
        if layer.groups > 1:
            tracker.block(space, f"grouped conv {layer.node_name!r} (groups={layer.groups})")
        if not layer.prunable:
            tracker.block(space, f"read by {layer.node_name!r}: {layer.note}")
    out = tracker.new_space(layer.node_name, layer.n_out, out_axis, rank_out)
    if layer.is_head:
        tracker.block(out, f"head {layer.node_name!r} output channels are the classes")
    if not layer.prunable:
        tracker.block(out, f"{layer.node_name!r}: {layer.note}")
    elif layer.groups > 1:
        tracker.block(out, f"grouped conv {layer.node_name!r} (groups={layer.groups})")
    tracker.spaces[layer.output] = out


def _records(tracker: Tracker) -> list[ChannelGroup]:
    roots = sorted({tracker.find(g) for g in range(len(tracker.parent))},
                   key=lambda r: tracker.order[r])
    groups = []
    for gid, root in enumerate(roots):
        info = tracker.info[root]
        reasons = list(dict.fromkeys(info.reasons))
        if info.n_channels < 2 and not reasons:
            reasons.append("a single channel cannot be pruned")
        kinds = tuple(sorted(info.kinds)) or ("chain",)
        groups.append(ChannelGroup(
            group_id=gid, members=tuple(m for m, _ in info.members),
            member_offsets=tuple(o for _, o in info.members), n_channels=info.n_channels,
            kinds=kinds, consumers=tuple(ChannelConsumer(*c) for c in info.consumers),
            params=tuple(ChannelParam(*p) for p in info.params), prunable=not reasons,
            reason="; ".join(reasons)))
    return groups
