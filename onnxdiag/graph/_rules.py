"""How each ONNX op moves channel spaces (see :mod:`onnxdiag.graph._spaces`).

A rule gets the spaces of a node's inputs and returns its output's space, or blocks
the spaces it cannot follow (conservative: an op not listed here blocks them).
"""

from __future__ import annotations

import math

import onnx

from ._spaces import Segment, Space, Tracker
from ._token_rules import constant_origin, embedding_source, gather, reshape_channels_last
from .index import get_attr
from .ops import CHANNEL_PRESERVING, ELEMENTWISE, PER_CHANNEL_PARAMS, REDUCTIONS, SHAPE_ONLY
from .shapes import reshape_target

_RESIDUAL_OPS = frozenset({"Add", "Sub", "Sum", "Mean", "Max", "Min"})


def visit(t: Tracker, node: onnx.NodeProto) -> None:
    """Propagate channel spaces through a non-layer node."""
    ins = [t.spaces.get(name) if name else None for name in node.input]
    if not any(ins) and node.op_type == "Gather" and node.domain in ("", "ai.onnx"):
        source = embedding_source(t, node)
        if source is not None:
            t.spaces[node.output[0]] = source
        return
    if not any(ins) or node.op_type in SHAPE_ONLY:
        return
    op = node.op_type
    handler = _HANDLERS.get(op)
    if handler is None and op in ELEMENTWISE:
        handler = _elementwise
    elif handler is None and op in REDUCTIONS:
        handler = _reduce
    elif handler is None and op in CHANNEL_PRESERVING:
        handler = _unary
    if node.domain not in ("", "ai.onnx") or handler is None:
        t.unknown(node, ins)
        return
    if ins[0] is None and handler not in (_elementwise, _concat):
        t.unknown(node, ins, "reads channels as a parameter")
        return
    out = handler(t, node, ins)
    if out is not None:
        t.spaces[node.output[0]] = out


def _unary(t: Tracker, node, ins) -> Space | None:
    space = t.only_first(node, ins)
    if space is None:
        t.unknown(node, ins, "reads channels as a parameter")
        return None
    for i in PER_CHANNEL_PARAMS.get(node.op_type, ()):
        if i < len(node.input) and node.input[i]:
            if space.block != 1:
                t.block(space, f"{node.op_type} {node.name!r} on flattened channels")
            t.add_param(space, node, i, 0)
    if node.op_type == "PRelu" and len(node.input) > 1:
        issue = _operand_issue(t, node, 1, space, space.rank)
        if issue:
            t.block(space, issue)
            return None
    rank = t.rank_of(node.output[0], space.rank)
    return space.moved(space.axis + rank - space.rank, rank)


def _operand_issue(t: Tracker, node, i: int, space: Space, out_rank: int) -> str | None:
    """Record operand ``i`` (not a layer's output) as a per-channel constant if it is one.

    Returns None when it broadcasts over channels or is a per-channel constant, else the
    reason it ties channels to something that cannot be pruned.
    """
    value = t.index.get_constant(node.input[i])
    origin = None if value is not None else constant_origin(t, node.input[i])
    shape = value.shape if value is not None else origin[2].shape if origin is not None \
        else t.index.shape(node.input[i])
    if shape is None or not all(isinstance(d, int) for d in shape):
        return f"{node.op_type} {node.name!r} has operand {node.input[i]!r} of unknown shape"
    k = space.axis + out_rank - space.rank - (out_rank - len(shape))
    if k < 0 or shape[k] == 1:
        return None
    if (value is not None or origin is not None) and shape[k] == space.n_channels \
            and space.block == 1:  # a per-channel constant (or one broadcast: a class token)
        t.add_param(space, *((node, i) if origin is None else origin[:2]), k)
        return None
    what = "constant" if value is not None else "tensor no layer produces"
    return f"{node.op_type} {node.name!r} applies a {what} {node.input[i]!r} across channels"


def _elementwise(t: Tracker, node, ins) -> Space | None:
    out_rank = t.rank_of(node.output[0], max(s.rank for s in ins if s is not None))
    mapped = [s for s in ins if s is not None]
    axes = {s.axis + out_rank - s.rank for s in mapped}
    n_out = max(s.n_channels for s in mapped)
    if len(axes) != 1 or len({s.block for s in mapped}) != 1:
        t.unknown(node, ins, "combines channels from different axes")
        return None
    full = [s for s in mapped if s.n_channels == n_out]
    for s in mapped:
        if s.n_channels != n_out:
            t.block(s, f"{node.op_type} {node.name!r} broadcasts it over {n_out} channels")
    base = full[0].moved(axes.pop(), out_rank)
    for i, s in enumerate(ins):
        issue = _operand_issue(t, node, i, base, out_rank) if s is None and node.input[i] \
            else None
        if issue:
            for other in mapped:
                t.block(other, issue)
            return None
    layout = [tuple((g.offset, g.length) for g in s.segments) for s in full]
    if len(set(layout)) != 1:
        t.unknown(node, ins, "combines differently concatenated tensors")
        return None
    kind = "residual" if node.op_type in _RESIDUAL_OPS else "mul"
    for other in full[1:]:
        _tie(t, base, other, kind, node)
    return base


def _tie(t: Tracker, a: Space, b: Space, kind: str, node) -> None:
    for sa, sb in zip(a.segments, b.segments):
        if sa.group is not None and sb.group is not None:
            t.union(sa.group, sb.group, kind)
        elif sa.group is not None or sb.group is not None:
            t.block(Space((sa, sb), 0, 1), f"{node.op_type} {node.name!r} ties channels to "
                                           "channels no layer produces")


def _concat(t: Tracker, node, ins) -> Space | None:
    rank = t.rank_of(node.output[0], max(s.rank for s in ins if s is not None))
    axis = get_attr(node, "axis", 1) % rank
    mapped = [s for s in ins if s is not None]
    if any(s.block != 1 or s.rank != rank for s in mapped):
        t.unknown(node, ins, "concatenates flattened or reshaped channels")
        return None
    if all(s.axis != axis for s in mapped):  # along batch/space: channels tie like Add
        return _elementwise(t, node, ins)
    segments, offset = [], 0
    for name, space in zip(node.input, ins):
        if space is None:
            shape = t.index.shape(name)
            length = shape[axis] if shape is not None else None
            if not isinstance(length, int):
                t.unknown(node, ins, f"concatenates {name!r} of unknown size")
                return None
            segments.append(Segment(None, offset, length))
        elif space.axis != axis:
            t.unknown(node, ins, "concatenates along a channel axis of some inputs only")
            return None
        else:
            for seg in space.segments:
                segments.append(Segment(seg.group, offset + seg.offset, seg.length))
                if seg.group is not None:
                    t.info[t.find(seg.group)].kinds.add("concat")
        offset += space.n_channels if space is not None else length
    return Space(tuple(segments), axis, rank)


def _flatten(t: Tracker, node, ins) -> Space | None:
    space = t.only_first(node, ins)
    axis = get_attr(node, "axis", 1) % max(space.rank, 1)
    if space.axis == 1 and axis == 1 and space.rank == 2:
        return space
    shape = t.index.shape(node.input[0])
    inner = shape[2:] if shape is not None else None
    if (space.axis != 1 or axis != 1 or space.block != 1 or inner is None
            or not all(isinstance(d, int) for d in inner)):
        t.unknown(node, ins, "mixes channels (or spatial size unknown)")
        return None
    return space.moved(1, 2, math.prod(inner))


def _reshape(t: Tracker, node, ins) -> Space | None:
    space = t.only_first(node, ins)
    out = _reshape_axis1(t, node, space)
    if out is not None:
        return out
    if space.axis == space.rank - 1 and space.rank >= 2:
        return reshape_channels_last(t, node, space)
    t.unknown(node, ins, "reshapes across the channel axis")
    return None


def _reshape_axis1(t: Tracker, node, space: Space) -> Space | None:
    """(N, C, …) reshapes that keep the channels on axis 1 or flatten them to blocks."""
    src, dst = t.index.shape(node.input[0]), _dst_shape(t, node)
    ok = (src is not None and dst is not None and space.axis == 1 and space.block == 1
          and len(dst) >= 2 and all(isinstance(d, int) for d in src[1:])
          and (dst[0] == src[0] or dst[0] is None or src[0] is None))
    if ok and dst[1] == src[1] and all(isinstance(d, int) for d in dst[2:]) \
            and math.prod(dst[2:]) == math.prod(src[2:]):
        return space.moved(1, len(dst))  # channels stay on axis 1 (e.g. (N,C,1,1) -> (N,C))
    # (N, C, H, W) -> (N, C·H·W); a symbolic 2nd dim is accepted when the batch dim is the
    # same symbol (torch's x.view(x.size(0), -1) after shape inference)
    same_batch = ok and dst[0] is not None and dst[0] == src[0]
    if ok and len(dst) == 2 and (dst[1] == math.prod(src[1:])
                                 or (same_batch and not isinstance(dst[1], int))):
        return space.moved(1, 2, math.prod(src[2:]))
    return None


def _dst_shape(t: Tracker, node) -> tuple | None:
    """The inferred output shape, its unknown dims filled from the Reshape's target."""
    inferred, target = t.index.shape(node.output[0]), reshape_target(t.index, node)
    if inferred is None or target is None or len(inferred) != len(target):
        return inferred if inferred is not None else \
            (None if target is None else tuple(target))
    return tuple(d if isinstance(d, int) or not isinstance(v, int) or v < 0 else v
                 for d, v in zip(inferred, target))


def _axes_of(t: Tracker, node) -> list[int] | None:
    axes = get_attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = t.index.get_constant(node.input[1])
        axes = None if value is None else value.ravel().tolist()
    return None if axes is None else [int(a) for a in axes]


def _squeeze(t: Tracker, node, ins) -> Space | None:
    space = t.only_first(node, ins)
    axes = _axes_of(t, node)
    if axes is None:
        shape = t.index.shape(node.input[0])
        axes = None if shape is None else [i for i, d in enumerate(shape) if d == 1]
    if axes is None or space.axis in [a % space.rank for a in axes]:
        t.unknown(node, ins, "may squeeze the channel axis")
        return None
    axes = [a % space.rank for a in axes]
    return space.moved(space.axis - sum(a < space.axis for a in axes), space.rank - len(axes))


def _unsqueeze(t: Tracker, node, ins) -> Space | None:
    space = t.only_first(node, ins)
    axes = _axes_of(t, node)
    if axes is None:
        t.unknown(node, ins, "has unknown axes")
        return None
    rank = space.rank + len(axes)
    kept = [i for i in range(rank) if i not in {a % rank for a in axes}]
    return space.moved(kept[space.axis], rank)


def _transpose(t: Tracker, node, ins) -> Space | None:
    space = t.only_first(node, ins)
    perm = list(get_attr(node, "perm", list(range(space.rank))[::-1]))
    return space.moved(perm.index(space.axis), space.rank)


def _reduce(t: Tracker, node, ins) -> Space | None:
    space = t.only_first(node, ins)
    axes = _axes_of(t, node)
    if not axes:
        t.unknown(node, ins, "reduces over all axes")
        return None
    axes = [a % space.rank for a in axes]
    if space.axis in axes:
        t.unknown(node, ins, "reduces over channels")
        return None
    if get_attr(node, "keepdims", 1):
        return space
    return space.moved(space.axis - sum(a < space.axis for a in axes), space.rank - len(axes))


def _softmax(t: Tracker, node, ins) -> Space | None:
    space = t.only_first(node, ins)
    default = -1 if t.index.opset >= 13 else 1
    axis = get_attr(node, "axis", default) % space.rank
    mixes = space.axis == axis if t.index.opset >= 13 else space.axis >= axis
    if mixes:
        t.unknown(node, ins, "normalises over channels")
        return None
    return space


def _along(t: Tracker, node, ins, axes: list[int] | None) -> Space | None:
    """Ops acting along ``axes`` only (Slice, Split, Pad): fine unless channels are among them."""
    space = t.only_first(node, ins)
    if axes is None or space.axis in [a % space.rank for a in axes]:
        t.unknown(node, ins, "acts along the channel axis (or on unknown axes)")
        return None
    return space


def _slice(t: Tracker, node, ins) -> Space | None:
    if get_attr(node, "starts") is not None:  # opset < 10: attributes
        axes = get_attr(node, "axes") or list(range(len(get_attr(node, "starts"))))
    elif len(node.input) > 3 and node.input[3]:
        value = t.index.get_constant(node.input[3])
        axes = None if value is None else value.ravel().tolist()
    else:
        starts = t.index.get_constant(node.input[1])
        axes = None if starts is None else list(range(starts.size))
    return _along(t, node, ins, axes)


def _split(t: Tracker, node, ins) -> Space | None:
    out = _along(t, node, ins, [get_attr(node, "axis", 0)])
    for name in node.output[1:]:
        if out is not None and name:
            t.spaces[name] = out
    return out


def _pad(t: Tracker, node, ins) -> Space | None:
    pads = get_attr(node, "pads")
    if pads is None and len(node.input) > 1:
        value = t.index.get_constant(node.input[1])
        pads = None if value is None else value.ravel().tolist()
    axes = None
    if pads is not None:
        half = len(pads) // 2
        padded = sorted({i % half for i, p in enumerate(pads) if p})
        named = t.index.get_constant(node.input[3]) if len(node.input) > 3 and node.input[3] \
            else None
        if named is not None:
            axes = [int(named.ravel()[i]) for i in padded]
        elif not (len(node.input) > 3 and node.input[3]):
            axes = padded
    return _along(t, node, ins, axes)


_HANDLERS = {
    "Concat": _concat, "Flatten": _flatten, "Reshape": _reshape, "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze, "Transpose": _transpose, "Softmax": _softmax,
    "LogSoftmax": _softmax, "Hardmax": _softmax, "Slice": _slice, "Split": _split, "Pad": _pad,
    "Gather": gather,
}
