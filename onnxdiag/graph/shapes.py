"""Shape tensors read without running the model, and layer shapes measured on one batch.

Exporters build the target of a Reshape from the shapes of other tensors (``Shape`` →
``Gather`` → ``Unsqueeze`` → ``Concat`` with a few literal constants).  :func:`shape_value`
evaluates such a tensor element by element: an int where it is known (a literal, or a
static dimension), the dimension's symbol (str) where it copies a symbolic dimension,
None where it is computed otherwise.  :func:`literal_position` says where a literal
element lives (the constant to rewrite when a channel count changes).

:func:`measured_shapes` runs one batch to resolve what shape inference leaves open
(tokens, a batch × tokens row count) for the FLOPs of ``docs/METHODS.md §D``.
Never modifies the model.
"""

from __future__ import annotations

import numpy as np
import onnx

from .index import GraphIndex, get_attr

_MAX_DEPTH = 16


def shape_value(index: GraphIndex, tensor: str, depth: int = 0) -> list | None:
    """The elements of a 1-D integer tensor (int / symbol str / None each), or None when
    even its length is unknown."""
    value = index.get_constant(tensor)
    if value is not None:
        return [int(v) for v in np.ravel(value)] if value.ndim <= 1 else None
    node = index.producer.get(tensor)
    if node is None or depth > _MAX_DEPTH or node.domain not in ("", "ai.onnx"):
        return _unknown(index, tensor)
    reader = _READERS.get(node.op_type)
    found = None if reader is None else reader(index, node, depth + 1)
    return found if found is not None else _unknown(index, tensor)


def _unknown(index: GraphIndex, tensor: str) -> list | None:
    shape = index.shape(tensor)
    if shape is None or len(shape) > 1:
        return None
    if not shape:  # a scalar
        return [None]
    return [None] * shape[0] if isinstance(shape[0], int) else None


def _shape(index, node, depth):
    shape = index.shape(node.input[0])
    if shape is None:
        return None
    start, end = get_attr(node, "start", 0), get_attr(node, "end", None)
    return list(shape)[start:end]


def _same(index, node, depth):
    return shape_value(index, node.input[0], depth)


def _scalar_like(index, node, depth):
    found = shape_value(index, node.input[0], depth)
    return found if found is not None and len(found) == 1 else None


def _concat(index, node, depth):
    parts = [shape_value(index, t, depth) for t in node.input]
    return None if any(p is None for p in parts) else [v for p in parts for v in p]


def _gather(index, node, depth):
    data, idx = shape_value(index, node.input[0], depth), index.get_constant(node.input[1])
    if data is None or idx is None:
        return None
    try:
        return [data[int(i)] for i in np.ravel(idx)]
    except IndexError:
        return None


def _slice(index, node, depth):
    data = shape_value(index, node.input[0], depth)
    args = [index.get_constant(t) if t else None for t in (list(node.input) + [""] * 5)[1:5]]
    if data is None or args[0] is None or args[1] is None:
        return None
    if args[2] is not None and int(np.ravel(args[2])[0]) not in (0, -1):
        return None
    step = 1 if args[3] is None else int(np.ravel(args[3])[0])
    start, stop = (int(np.clip(np.ravel(a)[0], -2**62, 2**62)) for a in args[:2])
    return data[start:stop:step]


_READERS = {"Shape": _shape, "Cast": _same, "Identity": _same, "Unsqueeze": _scalar_like,
            "Squeeze": _scalar_like, "Concat": _concat, "Gather": _gather, "Slice": _slice}


def reshape_target(index: GraphIndex, node: onnx.NodeProto) -> list | None:
    """The output dims of a Reshape as far as they are known (0 copies resolved, a -1
    resolved when everything else is static), or None."""
    target = shape_value(index, node.input[1]) if len(node.input) > 1 else None
    if target is None:
        return None
    src = index.shape(node.input[0])
    if not get_attr(node, "allowzero", 0) and src is not None:
        target = [src[i] if v == 0 and i < len(src) else v for i, v in enumerate(target)]
    if target.count(-1) == 1 and src is not None:
        target[target.index(-1)] = _inferred_dim(src, [d for d in target if d != -1])
    return target


def _inferred_dim(src: tuple, rest: list):
    """The -1 of a Reshape: elements of ``src`` over those of ``rest``, symbols that
    appear on both sides cancelling; -1 when that cannot be computed."""
    if any(d is None for d in (*src, *rest)):
        return -1
    symbols = sorted(str(d) for d in src if not isinstance(d, int))
    if symbols != sorted(str(d) for d in rest if not isinstance(d, int)):
        return -1
    total = int(np.prod([d for d in src if isinstance(d, int)]))
    known = int(np.prod([d for d in rest if isinstance(d, int)]))
    return total // known if known > 0 and total % known == 0 else -1


def literal_position(index: GraphIndex, tensor: str, position: int, depth: int = 0
                     ) -> tuple[str, int] | None:
    """``(constant tensor, element index)`` holding element ``position`` of the 1-D tensor
    ``tensor`` as a literal, through Concat / Cast / Identity; None if it is computed."""
    if index.get_constant(tensor) is not None:
        return tensor, position
    node = index.producer.get(tensor)
    if node is None or depth > _MAX_DEPTH:
        return None
    if node.op_type in ("Cast", "Identity"):
        return literal_position(index, node.input[0], position, depth + 1)
    if node.op_type != "Concat":
        return None
    offset = 0
    for part in node.input:
        values = shape_value(index, part)
        if values is None:
            return None
        if position < offset + len(values):
            return literal_position(index, part, position - offset, depth + 1)
        offset += len(values)
    return None


def measured_shapes(model: onnx.ModelProto, tensors, feeds: dict, *, providers=None) -> dict:
    """``{tensor: shape}`` of ``tensors`` on one batch ``feeds`` (one ONNX Runtime run)."""
    from .verify import run_exposed

    values = run_exposed(model, feeds, list(dict.fromkeys(tensors)), providers=providers)
    return {name: tuple(int(d) for d in np.shape(v)) for name, v in values.items()}


def batch_size(feeds: dict) -> int:
    """The batch size of one batch of feeds (the first dimension of its inputs)."""
    sizes = [np.shape(v)[0] for v in feeds.values() if np.ndim(v) >= 1]
    return int(sizes[0]) if sizes else 1
