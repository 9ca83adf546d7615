"""Per-position (dense) heads: one linear map applied at every position (docs/METHODS.md §A4).

A segmentation head is a 1×1 Conv (group 1, stride 1, no padding) on a feature map
(n_samples, D, *grid) with no pooling after it: U(p) = W z(p) + b at every position p.
A detection branch's classifier is a MatMul over the channel axis of per-anchor or
per-query features (n_samples, n_anchors, D) whose logits (n_samples, n_anchors, C) are
used for every anchor (no token is picked).  Either way positions are extra rows:
Z (n_samples·positions, D), U (n_samples·positions, C), rows sample-major, then
positions in row-major order (:func:`position_rows`).

The class (channel) axis is 1 for a Conv head and the last axis for a MatMul head
(:func:`class_axis`).  Found without data when the head's output reaches a graph output
unchanged or through a Softmax / LogSoftmax / Sigmoid over the class axis; through any
other ops the relation is checked on a batch (:func:`check_dense`).  Never modifies the
model.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx

from .index import GraphIndex, get_attr
from .linear import Linear, linear_weight

#: ``Head.features_reduce`` of a per-position head.
DENSE = "positions"
#: Largest relative error accepted for the linear map and the relation (§A1).
TOLERANCE = 1e-4
_EPS = 1e-12
_PLAIN_OPS = frozenset({"Identity", "Cast", "Dropout"})
_RELATION_OPS = {"Softmax": "softmax", "LogSoftmax": "log_softmax", "Sigmoid": "sigmoid"}


def class_axis(op_type: str) -> int:
    """The class / feature axis of a dense head's tensors: 1 (Conv, NCHW) or -1 (MatMul)."""
    return 1 if op_type == "Conv" else -1


def position_rows(values, axis: int) -> np.ndarray:
    """(n_samples·positions, width) float64 rows of ``values`` with ``axis`` as columns."""
    a = np.moveaxis(np.asarray(values, dtype=np.float64), axis, -1)
    return a.reshape(-1, a.shape[-1])


def position_grid(values, axis: int) -> tuple[int, ...]:
    """The per-sample grid of positions of ``values`` (its shape without batch and class axes)."""
    shape = list(np.shape(values))
    del shape[axis % len(shape)]
    return tuple(int(d) for d in shape[1:])


# -- finding the map -------------------------------------------------------------------------------
def _per_position_input(index: GraphIndex, node: onnx.NodeProto) -> str | None:
    """Why ``node``'s data input is not a known per-position input (None: it is one)."""
    shape = index.shape(node.input[0])
    if shape is None:
        return f"the rank of its input {node.input[0]!r} is unknown"
    if node.op_type == "Conv":
        if len(shape) < 3 or all(d == 1 for d in shape[2:]):
            return f"its input {node.input[0]!r} has no spatial positions"
        strides, pads = get_attr(node, "strides", [1]), get_attr(node, "pads", [0])
        auto = get_attr(node, "auto_pad", b"NOTSET")
        if any(s != 1 for s in strides) or any(pads) or auto not in (b"NOTSET", b"VALID",
                                                                       "NOTSET", "VALID"):
            return "it has a stride or padding (positions do not line up)"
        return None
    return None if len(shape) >= 3 else f"its input {node.input[0]!r} has no position axis"


def _class_bias(const, n_classes: int, axis: int, rank: int) -> np.ndarray | None:
    """A constant added to dense logits as a per-class bias (C,), or None when it is not one."""
    c = np.asarray(const, dtype=np.float64)
    if c.size == 1:
        return np.full(n_classes, float(c.ravel()[0]))
    if c.size != n_classes or c.ndim > rank:
        return None
    full = c.reshape((1,) * (rank - c.ndim) + c.shape)
    return c.ravel().copy() if full.shape[axis % rank] == n_classes else None


def _bias_add(index: GraphIndex, tensor: str, n_classes: int, axis: int):
    """(Add node, bias (C,)) when the only consumer of ``tensor`` adds a per-class constant."""
    users = index.consumers_of(tensor)
    if len(users) != 1 or users[0][0].op_type != "Add":
        return None, None
    add = users[0][0]
    other = add.input[1] if add.input[0] == tensor else add.input[0]
    const = index.get_constant(other)
    rank = index.rank(tensor) or (4 if axis == 1 else 3)
    bias = None if const is None else _class_bias(const, n_classes, axis, rank)
    return (add, bias) if bias is not None else (None, None)


def dense_linear(index: GraphIndex, node: onnx.NodeProto) -> Linear | str:
    """The per-position map of ``node`` (a 1×1 Conv or a MatMul with a constant 2-D weight on
    an input with position axes), with the bias Add that follows it; else a reason."""
    if node.op_type not in ("Conv", "MatMul"):
        return f"{node.op_type} is not a per-position linear map"
    wb = linear_weight(index, node)
    if isinstance(wb, str):
        return wb
    why = _per_position_input(index, node)
    if why is not None:
        return f"{node.op_type} {node.name!r} is not applied at every position: {why}"
    weight, bias = wb
    add, extra = _bias_add(index, node.output[0], weight.shape[0], class_axis(node.op_type))
    if add is None:
        return Linear(node, weight, bias, node.input[0], node.output[0], reduce=DENSE)
    return Linear(node, weight, bias + extra, node.input[0], add.output[0], reduce=DENSE,
                  bias_node=add.name)


def dense_linear_at(index: GraphIndex, tensor: str) -> Linear | str:
    """The per-position map whose result (after its bias Add) is ``tensor``, or a reason."""
    node = index.producer.get(tensor)
    if node is None:
        return f"{tensor!r} is a graph input"
    if node.op_type == "Add":
        inner = [index.producer.get(t) for t in node.input if index.get_constant(t) is None]
        node = inner[0] if len(inner) == 1 and inner[0] is not None else node
    found = dense_linear(index, node)
    if isinstance(found, Linear) and found.logits != tensor:
        return f"{tensor!r} is not the output of a per-position head"
    return found


def static_relation(index: GraphIndex, lin: Linear, output: str) -> str | None:
    """The relation output = relation(U) read from the ops between ``lin``'s logits and
    ``output`` when they are only Identity / Cast / Dropout and at most one Softmax /
    LogSoftmax / Sigmoid over the class axis (opset ≥ 13 for the softmaxes); else None."""
    relation, tensor = "identity", output
    axis = class_axis(lin.node.op_type)
    while tensor != lin.logits:
        node = index.producer.get(tensor)
        if node is None or len(node.input) < 1:
            return None
        if node.op_type in _RELATION_OPS and relation == "identity":
            if node.op_type != "Sigmoid" and not _over_class_axis(index, node, axis):
                return None
            relation = _RELATION_OPS[node.op_type]
        elif node.op_type not in _PLAIN_OPS:
            return None
        tensor = node.input[0]
    return relation


def _over_class_axis(index: GraphIndex, node: onnx.NodeProto, axis: int) -> bool:
    rank = index.rank(node.input[0])
    opset = next((o.version for o in index.model.opset_import if o.domain in ("", "ai.onnx")),
                 13)
    if rank is None or opset < 13:
        return False
    return get_attr(node, "axis", -1) % rank == axis % rank


# -- checking it on data ---------------------------------------------------------------------------
def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + _EPS))


def _log_softmax(u: np.ndarray) -> np.ndarray:
    shifted = u - u.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


_RELATIONS = {"identity": lambda u: u, "softmax": lambda u: np.exp(_log_softmax(u)),
              "log_softmax": _log_softmax, "sigmoid": lambda u: 1.0 / (1.0 + np.exp(-u))}


def _output_rows(out: np.ndarray, logits_shape: tuple, axis: int, n_rows: int, width: int):
    """Candidate row layouts of an output: the logits' own layout, or channels-last."""
    options = []
    if tuple(out.shape) == tuple(logits_shape):
        options.append(position_rows(out, axis))
    if out.size == n_rows * width:
        options.append(np.asarray(out, np.float64).reshape(n_rows, width))
    return options


def _relation_errors(u_rows, out, logits_shape, axis, label: bool) -> dict | str:
    n, c = u_rows.shape
    if label:
        if np.size(out) != n:
            return f"label output has {np.size(out)} values for {n} positions"
        return {"argmax": float(np.mean(np.asarray(out).reshape(n) != u_rows.argmax(axis=1)))}
    options = _output_rows(np.asarray(out), logits_shape, axis, n, c)
    if not options:
        return f"output shape {tuple(np.shape(out))} does not hold {c} scores per position"
    with np.errstate(over="ignore"):
        return {name: min(_rel(f(u_rows), y) for y in options)
                for name, f in _RELATIONS.items()}


def check_dense(head, values: dict, index: GraphIndex):
    """``head`` (a per-position Head) verified on the batch ``values``, or the mismatch.

    Checks U(p) = W z(p) + b at every position (relative error ≤ 1e-4) and, when the head
    reaches an output, output = relation(U) per position (the output in the logits'
    layout or channels-last; for a label output, argmax over the class axis)."""
    axis = class_axis(head.op_type)
    what = f"node {head.node_name!r} ({head.op_type}, per position)"
    z, u = position_rows(values[head.features], axis), position_rows(values[head.logits], axis)
    if z.shape != (u.shape[0], head.n_features) or u.shape[1] != head.n_classes:
        return (f"{what}: features {tuple(np.shape(values[head.features]))} and logits "
                f"{tuple(np.shape(values[head.logits]))} do not fit {head.n_features} "
                f"features and {head.n_classes} classes per position")
    err = _rel(z @ head.weight.T + head.bias, u)
    if err > TOLERANCE:
        return f"{what}: Z Wᵀ + b differs from {head.logits!r} by relative error {err:.3g}"
    if head.output is None:
        return replace(head, rel_error=err, note=f"{head.note}; linear map verified per "
                                                 "position (reaches no output)".lstrip("; "))
    label = index.is_float(head.output) is False
    out = values[head.output if label else head.scores or head.output]
    errors = _relation_errors(u, out, np.shape(values[head.logits]), axis, label)
    if isinstance(errors, str):
        return f"{what}: {errors}"
    relation = min(errors, key=errors.get)
    if errors[relation] > TOLERANCE:
        measured = ", ".join(f"{k} {v:.3g}" for k, v in errors.items())
        return f"{what}: no relation maps {head.logits!r} to output {head.output!r} ({measured})"
    note = f"{head.note}; verified per position on {u.shape[0]} rows".lstrip("; ")
    return replace(head, relation=relation, rel_error=err, relation_error=errors[relation],
                   note=note)
