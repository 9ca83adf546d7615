"""The shape constants that count a group's channels or heads, rewritten when they are
pruned (docs/METHODS.md §D).

A transformer's Reshapes (and Splits) hold the sizes they cut into as literals: the head
count of a head split, the width of a head merge or of GPT-2's Gemm on N·T rows, the
q | k | v sizes of a fused projection's Split.  :func:`onnxdiag.graph.find_channel_groups`
records each in its group (:class:`~onnxdiag.graph.groups.ChannelReshape`: the literal
``value``, what one group channel is worth, ``per_channel``).  Removing k channels of
the group makes it ``value − k·per_channel``.

The literal lives in a constant: the Reshape's own shape input, or one piece of the
Concat that builds it (torch's Shape → Gather → Unsqueeze → Concat chains, through Cast /
Identity), or in a Split's ``split`` attribute (opset < 13).  The edit is asked at the
node reading that constant (its *site*, see :class:`~onnxdiag.structured.edit.ConstantEditor`),
so a constant shared with a node that keeps its size is copied, not changed under it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import OnnxDiagError
from ..graph import ChannelGroup, GraphIndex
from ..graph.index import get_attr
from ..graph.shapes import shape_value
from ..model.finalize import EditError
from .edit import ConstantEditor

_MAX_DEPTH = 16
_PASS = ("Cast", "Identity")


def request_counts(editor: ConstantEditor, groups: Sequence[ChannelGroup],
                   removed: Mapping[int, tuple]) -> tuple[str, ...]:
    """Ask ``editor`` to rewrite every count constant of the groups losing channels;
    returns the names of the nodes whose sizes change (Reshape / Split), in order.

    Raises:
        OnnxDiagError: two groups need different values in one constant (one shape
            tensor serving both): leave one of them out of the plan.
        EditError: a recorded literal is not where the group's record says (a bug).
    """
    wanted: dict[tuple[str, int], dict[int, int]] = {}
    nodes = []
    for gid, channels in removed.items():
        for record in groups[gid].reshapes:
            site, element = (record.node_name, -1), record.position  # a Split's attribute
            if record.input_index >= 0:
                site, element = count_site(editor.index, record)
            new = record.value - record.per_channel * len(channels)
            elements = wanted.setdefault(site, {})
            if elements.get(element, new) != new:
                raise OnnxDiagError(
                    f"The shape constant read by node {site[0]!r} counts the channels of "
                    f"more than one pruned group (it would need {elements[element]} and "
                    f"{new}); leave group {gid} or the other one out of the plan.")
            elements[element] = new
            nodes.append(record.node_name)
    for (node_name, slot), elements in wanted.items():
        node = editor.index.node_by_name[node_name]
        if slot < 0:
            sizes = list(get_attr(node, "split"))
            for element, new in elements.items():
                sizes[element] = new
            editor.editor.set_attribute(node_name, "split", sizes)
            continue
        tensor = node.input[slot]
        value = np.array(editor.index.get_constant(tensor))
        flat = value.reshape(-1)
        for element, new in elements.items():
            flat[element] = new
        editor.replace(node_name, slot, flat.reshape(value.shape))
    return tuple(dict.fromkeys(nodes))


def count_site(index: GraphIndex, record) -> tuple[tuple[str, int], int]:
    """``((node, input index), element)``: the node input reading the constant that holds
    ``record``'s literal, and the literal's element in it."""
    node = index.node_by_name.get(record.node_name)
    slot, position = record.input_index, record.position
    for _ in range(_MAX_DEPTH):
        if node is None or not node.name:
            break
        tensor = node.input[slot]
        value = index.get_constant(tensor)
        if value is not None:
            if np.ravel(value)[position] != record.value:
                break
            return (node.name, slot), position
        producer = index.producer.get(tensor)
        if producer is not None and producer.op_type in _PASS:
            node, slot = producer, 0
            continue
        if producer is None or producer.op_type != "Concat":
            break
        found = _concat_part(index, producer, position)
        if found is None:
            break
        node, (slot, position) = producer, found
    raise EditError(f"the shape literal {record.value} recorded at input "
                    f"{record.input_index} of {record.node_name!r} (element "
                    f"{record.position}) is not a constant element there")


def _concat_part(index: GraphIndex, node, position: int) -> tuple[int, int] | None:
    """(input index, element in it) of element ``position`` of a Concat's output."""
    offset = 0
    for i, part in enumerate(node.input):
        values = shape_value(index, part)
        if values is None:
            return None
        if position < offset + len(values):
            return i, position - offset
        offset += len(values)
    return None
