"""Coupled output channels (METHODS §B6; Torch-Pruning's DepGraph idea on ONNX).

Each layer's output channels open a channel space.  Spaces are tied index by index
(union-find) through element-wise ops between tensors (residual Add, gating Mul),
depthwise convs, and channel-preserving ops (BN, activations, pooling, Dropout,
per-channel constants).  Concat does not tie spaces: it lays them side by side, so
a consumer of a concat reads each space at an offset.  Flatten/Reshape before a
Gemm/MatMul maps channel c to a block of ``block_size`` consecutive features.
Anything not understood makes the spaces it touches not prunable, naming the op.

Token models (docs/METHODS.md §D): channels-last Reshapes that regroup leading axes,
token Gathers, LayerNorm / RMSNorm (γ, β per channel), embedding tables and broadcast
class tokens keep the residual stream one group across blocks (``role``
"residual_stream"); an MLP's hidden units are "mlp_hidden"; attention heads
(:mod:`onnxdiag.graph.attention`) are "attention_heads" groups of ``block_size`` =
head_dim features.  Groups record the Reshape constants that count their channels.
Never modifies the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import onnx

from ._records import jsonable
from ._rules import visit
from ._spaces import Space, Tracker
from ._token_rules import norm as visit_norm
from .attention import AttentionBlock, find_attention_blocks
from .index import GraphIndex
from .layers import Layer
from .norms import find_norms

_LINEAR = ("Gemm", "MatMul")
#: Why the residual stream stays unprunable for now (its slicing is not implemented).
NOT_YET = {"residual_stream": "the residual stream (docs/METHODS.md §D): structured pruning "
                              "of it is not implemented yet (removing a channel changes what "
                              "every LayerNorm normalises over)"}


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
class ChannelReshape:
    """A Reshape (or Split) whose shape (sizes) constant counts a group's channels:
    element ``position`` of input ``input_index`` of ``node_name`` is the literal
    ``value``, ``per_channel`` × the group's channel count; ``meaning`` "channels"
    (features) or "heads" (the head count); ``source`` / ``source_index``: the
    constant (initializer or Constant node output) holding it.  ``input_index`` −1: a
    Split's ``split`` attribute (opset < 13; ``source`` None).  Pruning k channels makes
    the literal ``value − k·per_channel`` (:mod:`onnxdiag.structured.counts`)."""

    node_name: str
    input_index: int
    position: int
    value: int
    meaning: str
    per_channel: int
    source: str | None = None
    source_index: int | None = None


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
        role: "residual_stream", "mlp_hidden", "attention_heads" or None.
        block_size: output features of every member (and entries of every param) per
            group channel: entry ``(offset + c) * block_size + j``; head_dim for heads.
        reshapes: the Reshape constants that count the channels (to rewrite).
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
    role: str | None = None
    block_size: int = 1
    reshapes: tuple[ChannelReshape, ...] = ()

    def to_dict(self) -> dict:
        """JSON-able dict of every field."""
        return {f.name: jsonable([c.__dict__ for c in getattr(self, f.name)]
                                 if f.name in ("consumers", "params", "reshapes")
                                 else getattr(self, f.name))
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
    norms = {name: norm for norm in find_norms(index).values() for name in norm.nodes}
    for node in index.nodes:
        layer = by_name.get(node.name)
        if layer is not None:
            _visit_layer(tracker, node, layer)
        elif node.name in norms:  # a LayerNorm / RMSNorm, as one op
            norm = norms[node.name]
            out = visit_norm(tracker, norm, tracker.spaces.get(norm.input)) \
                if node.name == norm.nodes[-1] else None
            if out is not None:
                tracker.spaces[norm.output] = out
        else:
            visit(tracker, node)
    for name in index.outputs:
        space = tracker.spaces.get(name)
        if space is not None:
            tracker.block(space, f"reaches graph output {name!r}")
    for block in find_attention_blocks(index, layers):
        _claim_heads(tracker, block, by_name)
    return _records(tracker, by_name)


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


def _claim_heads(tracker: Tracker, block: AttentionBlock, layers: dict) -> None:
    """Replace the groups of an attention block's projections by one group of heads."""
    members = block.members()
    names = {m for m, _ in members}
    old = {tracker.find(g) for g, info in enumerate(tracker.info)
           if any(m in names for m, _ in info.members)}
    if any({m for m, _ in tracker.info[r].members} - names for r in old):
        return  # a projection's channels are tied to other layers: leave them be
    gid = tracker.new_group(block.n_heads, "attention_heads")
    info = tracker.info[gid]
    info.members, info.block_size, info.role = members, block.head_dim, "attention_heads"
    out = layers[block.output_layer]
    info.consumers.append((out.node_name, out.op_type, 0, 0, block.head_dim))
    index = tracker.index
    for name, offset in members:
        la = layers[name]
        if la.bias_node:  # a separate bias Add: its entries of the heads
            slot = list(index.node_by_name[la.bias_node].input).index(la.bias)
            value = index.get_constant(la.bias)
            info.params.append((la.bias_node, slot, la.bias, max(value.ndim - 1, 0), offset,
                                index.source_initializer(la.bias)))
    for split in block.splits:
        info.reshapes += list(split.reshapes)
    info.reshapes += list(block.reshapes)
    info.reasons += [f"{la.node_name!r}: {la.note}" for la in
                     (layers[n] for n in (*names, out.node_name)) if not la.prunable]
    tracker.order[gid] = min(tracker.order[r] for r in old)
    tracker.dissolved |= old


def _role(info, layers: dict) -> str | None:
    if info.role:
        return info.role
    if "residual" in info.kinds and info.kinds & {"layernorm", "rmsnorm"}:
        return "residual_stream"
    ops = [layers[m].op_type for m, _ in info.members] + [c[1] for c in info.consumers]
    if info.members and info.consumers and all(op in _LINEAR for op in ops) \
            and not info.kinds & {"residual", "concat", "depthwise", "flatten", "embedding"}:
        return "mlp_hidden"
    return None


def _records(tracker: Tracker, layers: dict) -> list[ChannelGroup]:
    roots = sorted({tracker.find(g) for g in range(len(tracker.parent))} - tracker.dissolved,
                   key=lambda r: tracker.order[r])
    groups = []
    for gid, root in enumerate(roots):
        info = tracker.info[root]
        role = _role(info, layers)
        reasons = list(dict.fromkeys(info.reasons + ([NOT_YET[role]] if role in NOT_YET
                                                     else [])))
        if info.n_channels < 2 and not reasons:
            reasons.append("a single channel cannot be pruned")
        if not info.members:
            reasons.append("no layer produces these channels (embedding table columns)")
        kinds = tuple(sorted(info.kinds)) or ("chain",)
        groups.append(ChannelGroup(
            group_id=gid, members=tuple(m for m, _ in info.members),
            member_offsets=tuple(o for _, o in info.members), n_channels=info.n_channels,
            kinds=kinds, consumers=tuple(ChannelConsumer(*c) for c in info.consumers),
            params=tuple(ChannelParam(*p) for p in info.params), prunable=not reasons,
            reason="; ".join(reasons), role=role, block_size=info.block_size,
            reshapes=_reshapes(info)))
    return groups


def _reshapes(info) -> tuple[ChannelReshape, ...]:
    out = []
    for node, slot, position, value, meaning, source, element in dict.fromkeys(info.reshapes):
        per = 1 if meaning == "heads" else max(value // max(info.n_channels, 1), 1)
        out.append(ChannelReshape(node, slot, position, value, meaning, per, source, element))
    return tuple(out)
