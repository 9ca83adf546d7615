"""LayerNorm and RMSNorm in an ONNX graph: the ops and the patterns exporters write out.

``docs/METHODS.md §D``: LayerNorm and RMSNorm normalise each token across its channels.
Exporters write them as one op (``LayerNormalization``, ``RMSNormalization``, ORT's
``SimplifiedLayerNormalization``) or spelled out, as torch and HF exports do below
opset 17:

- LayerNorm: m = ReduceMean(x); d = x − m; n = d / Sqrt(ReduceMean(d²) + ε), then · γ + β;
- RMSNorm:   n = x · 1/Sqrt(ReduceMean(x²) + ε) (or x / Sqrt(…)), then · γ.

A :class:`Norm` names every node of one occurrence, its normalised input and output,
and the constants holding one value per channel (γ, β).  Never modifies the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from .index import GraphIndex, get_attr

_OPS = {"LayerNormalization": "layernorm", "RMSNormalization": "rmsnorm",
        "SimplifiedLayerNormalization": "rmsnorm"}


@dataclass(frozen=True)
class Norm:
    """One LayerNorm / RMSNorm over the last axis of ``input``.

    ``nodes``: its nodes, the last one writing ``output`` (after γ and β); ``params``:
    ``(node name, input index, tensor)`` of each per-channel constant (γ, β); ``axis``:
    the first normalised axis as written (-1 or rank − 1 for a per-token norm).
    """

    kind: str
    input: str
    output: str
    nodes: tuple[str, ...]
    params: tuple[tuple[str, int, str], ...]
    axis: int = -1

    def to_dict(self) -> dict:
        return {"kind": self.kind, "input": self.input, "output": self.output,
                "nodes": list(self.nodes), "params": [list(p) for p in self.params],
                "axis": self.axis}


def find_norms(index: GraphIndex) -> dict[str, Norm]:
    """Every LayerNorm / RMSNorm of the graph, keyed by its normalised input tensor."""
    found: dict[str, Norm] = {}
    claimed: set[str] = set()  # a LayerNorm's variance is not an RMSNorm of x − mean
    for node in index.nodes:
        norm = None
        if node.name in claimed:
            continue
        if node.op_type in _OPS and len(node.input) > 1:
            norm = _op_norm(node)
        elif node.op_type == "ReduceMean" and _reduces_last_axis(index, node):
            norm = _layernorm(index, node) or _rmsnorm_from_mean(index, node)
        if norm is not None and norm.input not in found and not claimed & set(norm.nodes):
            found[norm.input] = norm
            claimed |= set(norm.nodes)
    return found


def _op_norm(node: onnx.NodeProto) -> Norm:
    params = tuple((node.name, i, node.input[i]) for i in (1, 2)
                   if i < len(node.input) and node.input[i])
    return Norm(_OPS[node.op_type], node.input[0], node.output[0], (node.name,), params,
                int(get_attr(node, "axis", -1)))


def _reduces_last_axis(index: GraphIndex, node: onnx.NodeProto) -> bool:
    axes = get_attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = index.get_constant(node.input[1])
        axes = None if value is None else value.ravel().tolist()
    rank = index.rank(node.input[0])
    if axes is None or len(axes) != 1 or not get_attr(node, "keepdims", 1):
        return False
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


def _user(index: GraphIndex, tensor: str, ops, *, reads=None) -> onnx.NodeProto | None:
    """The one consumer of ``tensor`` with an op in ``ops`` (that also reads ``reads``)."""
    users = [n for n, _ in index.consumers_of(tensor) if n.op_type in ops
             and (reads is None or reads in n.input)]
    return users[0] if len(users) == 1 else None


def _squares(node: onnx.NodeProto | None, index: GraphIndex, x: str) -> bool:
    if node is None:
        return False
    if node.op_type == "Mul":
        return list(node.input) == [x, x]
    exponent = index.get_constant(node.input[1]) if node.op_type == "Pow" else None
    return node.input[0] == x and exponent is not None and float(np.ravel(exponent)[0]) == 2.0


def _inverse_sqrt(index: GraphIndex, mean: onnx.NodeProto) -> list | None:
    """ReduceMean → (+ ε) → Sqrt: the nodes, or None."""
    chain, tensor = [mean], mean.output[0]
    add = _user(index, tensor, ("Add",))
    if add is not None and any(index.get_constant(t) is not None for t in add.input):
        chain.append(add)
        tensor = add.output[0]
    sqrt = _user(index, tensor, ("Sqrt",))
    return None if sqrt is None else chain + [sqrt]


def _divided(index: GraphIndex, value: str, sqrt: onnx.NodeProto) -> list | None:
    """``value`` / Sqrt(…), written as Div or as Mul by a Reciprocal (or 1 / Sqrt)."""
    s = sqrt.output[0]
    div = _user(index, s, ("Div",), reads=value)
    if div is not None and list(div.input) == [value, s]:
        return [div]
    inv = _user(index, s, ("Reciprocal", "Div"))
    if inv is None or (inv.op_type == "Div" and (inv.input[1] != s or not _is_one(
            index, inv.input[0]))):
        return None
    mul = _user(index, inv.output[0], ("Mul",), reads=value)
    return None if mul is None else [inv, mul]


def _is_one(index: GraphIndex, tensor: str) -> bool:
    value = index.get_constant(tensor)
    return value is not None and value.size == 1 and float(value.ravel()[0]) == 1.0


def _affine(index: GraphIndex, tensor: str, *, beta: bool) -> tuple[list, list]:
    """An optional Mul by γ then Add of β (per-channel constants) after ``tensor`` (past
    a Cast back to the model's type, as HF's RMSNorm writes)."""
    nodes, params = [], []
    cast = _user(index, tensor, ("Cast",))
    if cast is not None and len(index.consumers_of(tensor)) == 1 \
            and _user(index, cast.output[0], ("Mul",)) is not None:
        nodes.append(cast)
        tensor = cast.output[0]
    for op in ("Mul", "Add") if beta else ("Mul",):
        user = _user(index, tensor, (op,))
        if user is None or len(index.consumers_of(tensor)) != 1:
            break
        const = [i for i, t in enumerate(user.input) if t != tensor
                 and index.get_constant(t) is not None]
        if len(const) != 1:
            break
        nodes.append(user)
        params.append((user.name, const[0], user.input[const[0]]))
        tensor = user.output[0]
    return nodes, params


def _layernorm(index: GraphIndex, mean: onnx.NodeProto) -> Norm | None:
    x = mean.input[0]
    sub = _user(index, mean.output[0], ("Sub",), reads=x)
    if sub is None or list(sub.input) != [x, mean.output[0]]:
        return None
    d = sub.output[0]
    square = next((n for n, _ in index.consumers_of(d) if _squares(n, index, d)), None)
    var = _user(index, square.output[0], ("ReduceMean",)) if square is not None else None
    if var is None or not _reduces_last_axis(index, var):
        return None
    root = _inverse_sqrt(index, var)
    scaled = None if root is None else _divided(index, d, root[-1])
    if scaled is None:
        return None
    affine, params = _affine(index, scaled[-1].output[0], beta=True)
    nodes = [mean, sub, square, *root, *scaled, *affine]
    return Norm("layernorm", x, nodes[-1].output[0], tuple(n.name for n in nodes),
                tuple(params))


def _rmsnorm_from_mean(index: GraphIndex, mean: onnx.NodeProto) -> Norm | None:
    square = index.producer.get(mean.input[0])
    x = square.input[0] if square is not None else None
    if x is None or not _squares(square, index, x):
        return None
    root = _inverse_sqrt(index, mean)
    scaled = None if root is None else _divided(index, x, root[-1])
    if scaled is None:
        return None
    affine, params = _affine(index, scaled[-1].output[0], beta=False)
    nodes = [square, *root, *scaled, *affine]
    return Norm("rmsnorm", x, nodes[-1].output[0], tuple(n.name for n in nodes),
                tuple(params))


#: Ops between a layer and the norm of its output or input (the channel axis untouched).
_PASS = ("Dropout", "Identity", "Cast", "Reshape")


def norm_around(index: GraphIndex, norms: dict[str, Norm], node: onnx.NodeProto,
                post: str) -> tuple[Norm | None, str | None]:
    """``(Norm, "output" | "input")``: the norm reached from the layer's output ``post``
    (through Dropout / Identity / Cast / Reshape and at most one residual Add), else the
    norm that produced its input (through the same ops); ``(None, None)`` when neither."""
    tensor, residual = post, False
    for _ in range(6):
        if tensor in norms:
            return norms[tensor], "output"
        users = [n for n, _ in index.consumers_of(tensor)]
        nxt = next((n for n in users if n.op_type in _PASS), None) if len(users) == 1 else None
        if nxt is None and not residual:
            nxt = next((n for n in users if n.op_type in ("Add", "Sum")), None)
            residual = nxt is not None
        if nxt is None:
            break
        tensor = nxt.output[0]
    by_output = {n.output: n for n in norms.values()}
    tensor = node.input[0]
    for _ in range(6):
        if tensor in by_output:
            return by_output[tensor], "input"
        prev = index.producer.get(tensor)
        if prev is None or prev.op_type not in _PASS:
            break
        tensor = prev.input[0]
    return None, None
