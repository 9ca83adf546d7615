"""The activation applied to a layer's output: one op, or the element-wise patterns
exporters write for GELU (its erf and tanh forms), SiLU and HardSwish.

A written-out activation is the element-wise region fed by the tensor alone (every node
whose non-constant inputs all come from the tensor or from the region) that ends in one
tensor; its ops say what it computes: Erf → GELU (erf form), Tanh with a cube → GELU
(tanh form), Sigmoid and Mul → SiLU, or GELU's sigmoid form x·σ(1.702x).  Never modifies
the model.
"""

from __future__ import annotations

from collections import Counter

from .index import GraphIndex
from .ops import ACTIVATIONS

_POINTWISE = ACTIVATIONS | frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Erf", "Sqrt", "Neg",
                                      "Exp", "Reciprocal", "Abs", "Cast"})
_MAX_NODES = 12


def find_activation(index: GraphIndex, tensor: str) -> tuple[str | None, str | None]:
    """``(activation, node_name)`` applied to ``tensor``, or ``(None, None)``; the node is
    the one producing the activation's output."""
    users = [n for n, _ in index.consumers_of(tensor)]
    ops = sorted(n.op_type for n in users)
    if ops in (["Mul", "Sigmoid"], ["HardSigmoid", "Mul"]):
        gate = next(n for n in users if n.op_type != "Mul")
        mul = next(n for n in users if n.op_type == "Mul")
        if gate.output[0] in mul.input:
            return ("SiLU" if gate.op_type == "Sigmoid" else "HardSwish"), mul.name
    if len(users) == 1 and users[0].op_type in ACTIVATIONS:
        return users[0].op_type, users[0].name
    return written_activation(index, tensor)


def written_activation(index: GraphIndex, tensor: str) -> tuple[str | None, str | None]:
    """A GELU / SiLU written out in element-wise ops (see the module docstring)."""
    region = _region(index, tensor)
    if region is None:
        return None, None
    nodes, last = region
    ops = Counter(n.op_type for n in nodes)
    if ops["Erf"]:
        name = "GELU"
    elif ops["Tanh"] and (ops["Pow"] or ops["Mul"] >= 4):
        name = "GELU"
    elif ops["Sigmoid"] and ops["Mul"] >= 2 and set(ops) <= {"Sigmoid", "Mul"}:
        name = "GELU"  # x·σ(1.702·x), the sigmoid form
    elif set(ops) == {"Sigmoid", "Mul"}:
        name = "SiLU"
    else:
        return None, None
    return name, last


def _region(index: GraphIndex, tensor: str) -> tuple[list, str] | None:
    """(nodes, name of the node writing the region's one exit) or None."""
    inside, nodes, names = {tensor}, [], set()
    pending = {n.name: n for n, _ in index.consumers_of(tensor) if n.op_type in _POINTWISE}
    grew = True
    while grew and len(nodes) < _MAX_NODES:
        grew = False
        for name, node in list(pending.items()):
            data = [t for t in node.input if t and index.get_constant(t) is None]
            if not all(t in inside for t in data):
                continue
            del pending[name]
            nodes.append(node)
            names.add(name)
            inside.add(node.output[0])
            pending.update({u.name: u for u, _ in index.consumers_of(node.output[0])
                            if u.op_type in _POINTWISE and u.name not in names})
            grew = True
    if len(nodes) < 2:
        return None
    exits = {t for t in inside - {tensor} if t in index.outputs
             or any(u.name not in names for u, _ in index.consumers_of(t))}
    leaks = any(u.name not in names for u, _ in index.consumers_of(tensor))
    if leaks or len(exits) != 1:
        return None
    return nodes, index.producer[exits.pop()].name
