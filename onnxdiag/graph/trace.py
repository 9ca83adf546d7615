"""Walks from a graph output back to the classifier head (docs/METHODS.md §A1).

- :func:`trace_output` — the static walk: through ops known to keep one score per class
  (Softmax, LogSoftmax, Sigmoid, shape ops, a softmax written out as Exp / ReduceSum / Div
  in any of the exporters' forms, a Gather/GatherND/Slice picking one token) to the tensor
  the head must produce.  Used without data.
- :func:`walk_back` — the loose walk: through *any* ops, to the last node(s) with constant
  weights on every float path to the output.  Used when the relation is checked on data.

Neither modifies the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from .index import GraphIndex

#: Ops between the logits and the scores that turn logits into scores, per class.
RELATION_OPS = {"Softmax": "softmax", "LogSoftmax": "log_softmax", "Sigmoid": "sigmoid"}
#: Ops that keep the scores' values (layout or type only; a QuantizeLinear/DequantizeLinear
#: pair up to its rounding, which the data check models).
SHAPE_OPS = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast",
                       "Dropout", "ZipMap", "QuantizeLinear", "DequantizeLinear"})
#: Ops that pick one token's row of a per-token head's output (decoder-style classifiers).
PICK_OPS = frozenset({"Gather", "GatherND", "GatherElements", "Slice"})
#: Ops that turn scores into labels; outputs reached through them are label outputs.
LABEL_OPS = frozenset({"ArgMax", "ArgMin", "ArrayFeatureExtractor", "TopK", "LabelEncoder"})
#: Ops the loose walk never crosses: their outputs do not carry the input's values.
OPAQUE_OPS = frozenset({"Shape", "Size", "NonZero", "ConstantOfShape", "Range", "EyeLike",
                        "RandomNormalLike", "RandomUniformLike"})
#: Nodes with constant weights: the loose walk stops at each (a candidate or not).
WEIGHTED_OPS = frozenset({"Gemm", "MatMul", "Conv", "ConvTranspose", "ConvInteger",
                          "MatMulInteger", "QLinearConv", "QLinearMatMul", "Einsum"})
#: Ops that only move a value around on the way to a softmax's max or sum.
_CARRY_OPS = frozenset({"Identity", "Cast", "Reshape", "Expand", "Unsqueeze", "Squeeze",
                        "Max", "ReduceMax", "StopGradient"})


@dataclass(frozen=True)
class Trace:
    """A static backward walk from ``output``.

    Fields:
        output: the graph output; scores: the dense tensor nearest to it (the output, or a
            ZipMap's input), None for a non-tensor output without one.
        tensor: where the walk stopped (the head's output tensor, if it is one).
        path: op types from ``tensor`` to ``output`` (written-out softmax as one entry).
        relation: "identity" | "softmax" | "log_softmax" | "sigmoid" (from the ops passed).
        logits: the tensor the relation is applied to (``scores`` for "identity").
        picked: a Gather/GatherND/GatherElements/Slice was passed (one token picked).
        relation_per_token: the relation op comes before the pick (applied to every token).
        label: the output holds labels (integer, or reached through an ArgMax …).
    """

    output: str
    scores: str | None
    tensor: str
    path: tuple[str, ...]
    relation: str
    logits: str
    picked: bool
    relation_per_token: bool
    label: bool


def _strip(index: GraphIndex, tensor: str, ops=_CARRY_OPS) -> tuple[str, onnx.NodeProto | None]:
    """Follow the single non-constant input through ``ops``; (tensor, its producer)."""
    node = index.producer.get(tensor)
    while node is not None and node.op_type in ops:
        data = [t for t in node.input if t and index.get_constant(t) is None]
        if node.op_type != "Max":  # shape ops: the data is input 0, the rest is a shape
            data = data[:1] if data and data[0] == node.input[0] else []
        if len(data) != 1:
            break
        tensor, node = data[0], index.producer.get(data[0])
    return tensor, node


def written_out_softmax(index: GraphIndex, node: onnx.NodeProto) -> str | None:
    """Input x of a softmax written out as Exp(x[−max]) / ReduceSum(Exp(…)), else None.

    Accepts Div(e, s) and Mul(e, Reciprocal(s)) in either order, with any of Reshape /
    Expand / Unsqueeze / Squeeze / Identity / Cast around the sum or the reciprocal
    (jax2tf) and an optional max subtraction (ReduceMax, then Max / Reshape / Expand).
    The sum must read the same Exp output as the numerator (ReduceSum(|x|) is no softmax)
    over the class axis (1 or −1) when its axes are known.  A shape test only: the data
    check (:mod:`onnxdiag.graph.verify`) decides.
    """
    if node.op_type == "Div":
        pairs = [(node.input[0], node.input[1])]
    elif node.op_type == "Mul":
        pairs = [(node.input[i], r.input[0]) for i in (0, 1)
                 if (r := _strip(index, node.input[1 - i])[1]) is not None
                 and r.op_type == "Reciprocal"]
    else:
        return None
    for num, den in pairs:
        num, exp = _strip(index, num, frozenset({"Identity", "Cast"}))
        _, total = _strip(index, den)
        if (exp is None or total is None or exp.op_type != "Exp" or total.op_type != "ReduceSum"
                or _strip(index, total.input[0], frozenset({"Identity", "Cast"}))[0] != num
                or not _over_classes(index, total)):
            continue
        return _unshifted(index, exp.input[0])
    return None


def _over_classes(index: GraphIndex, reduce: onnx.NodeProto) -> bool:
    """Whether a ReduceSum/ReduceMax sums over axis 1 or the last axis (True if unknown)."""
    axes = next((list(a.ints) for a in reduce.attribute if a.name == "axes"), None)
    if axes is None and len(reduce.input) > 1 and reduce.input[1]:
        value = index.get_constant(reduce.input[1])
        if value is None:
            return True
        axes = [int(a) for a in value.ravel()]
    rank = index.rank(reduce.input[0])
    if axes is None:  # all axes: a softmax only when the batch axis is not among them
        return rank == 1
    return len(axes) == 1 and (axes[0] in (1, -1) or (rank is not None
                                                       and axes[0] % rank in (1, rank - 1)))


def _unshifted(index: GraphIndex, x: str) -> str:
    """``a`` when ``x`` = a − max(a) (the max carried through reshapes), else ``x``."""
    sub = index.producer.get(x)
    if sub is None or sub.op_type != "Sub":
        return x
    a = sub.input[0]
    _, peak = _strip(index, sub.input[1], _CARRY_OPS - {"ReduceMax"})
    if peak is not None and peak.op_type == "ReduceMax" and _strip(index, peak.input[0])[0] == \
            _strip(index, a)[0]:
        return a
    return x


def _step(index: GraphIndex, node: onnx.NodeProto) -> tuple[str, str, str] | None:
    """(kind, input tensor, path entry) for one static step back through ``node``."""
    if node.op_type in RELATION_OPS:
        return RELATION_OPS[node.op_type], node.input[0], node.op_type
    if node.op_type in SHAPE_OPS:
        return "shape", node.input[0], node.op_type
    if node.op_type in PICK_OPS:
        return "pick", node.input[0], node.op_type
    x = written_out_softmax(index, node)
    return None if x is None else ("softmax", x, "Softmax(Exp/ReduceSum/Div)")


def trace_output(index: GraphIndex, output: str) -> Trace:
    """Walk back from ``output`` through score-preserving ops to the head candidate."""
    tensor, path = output, []
    scores = output if index.type_kind(output) in (None, "tensor_type") else None
    relation, logits, picked, per_token = "identity", scores, False, False
    while (node := index.producer.get(tensor)) is not None:
        step = _step(index, node)
        if step is None:
            break
        kind, tensor, entry = step
        path.append(entry)
        if node.op_type == "ZipMap" and scores is None:
            scores = logits = node.input[0]
        if kind == "pick":
            picked = True
        elif kind != "shape":
            per_token = per_token or picked
            if relation == "identity" and not picked:
                relation, logits = kind, tensor
    label = index.is_float(output) is False or (
        (node := index.producer.get(tensor)) is not None and node.op_type in LABEL_OPS)
    return Trace(output, scores, tensor, tuple(reversed(path)), relation, logits or tensor,
                 picked, per_token, label)


def walk_back(index: GraphIndex, output: str) -> tuple[list[onnx.NodeProto], list[str]]:
    """The last weighted node(s) on every float path into ``output``, and the tensors seen.

    Crosses any op except :data:`OPAQUE_OPS`; follows only non-constant float (or untyped)
    inputs, and a DequantizeLinear's quantized input; stops at each node in
    :data:`WEIGHTED_OPS`.
    Returns (nodes in discovery order, float tensors passed from ``output`` back).
    """
    found, seen, order, stack = [], set(), [], [output]
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        order.append(tensor)
        node = index.producer.get(tensor)
        if node is None or node.op_type in OPAQUE_OPS:
            continue
        if node.op_type in WEIGHTED_OPS:
            if all(n is not node for n in found):
                found.append(node)
            continue
        if node.op_type == "DequantizeLinear":
            stack.extend(t for t in node.input[:1] if index.get_constant(t) is None)
            continue
        inputs = node.input[:1] if node.op_type in PICK_OPS else node.input
        stack.extend(reversed([t for t in inputs if t and index.get_constant(t) is None
                               and index.is_float(t) is not False]))
    return found, order
