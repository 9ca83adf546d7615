"""Attention heads as channel groups (docs/METHODS.md §D).

An attention block splits the output features of its query, key and value projections
into heads with a Reshape (N, T, D) → (N, T, H, d) whose constants give H × d, mixes the
tokens per head, and joins the heads back, (N, T, H, d) → (N, T, H·d), for the output
projection.  Head h is then the d rows h·d … h·d+d−1 of Q, K and V and the matching
columns of the output projection: one group channel of size d.

Found from the head-split Reshapes, for separate q / k / v projections (HF BERT, the
bundled ViT sample), for one fused projection split by a Reshape to (N, T, 3, H, d)
(timm), and for a fused projection cut by a Split before the head Reshapes (GPT-2);
leading-axis Reshapes around a Gemm on N·T rows are followed.  Never modifies the model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .index import GraphIndex, get_attr
from .shapes import literal_position, reshape_target, shape_value

#: Ops between the head split and the join that act per head (tokens mixed, heads kept).
_INSIDE = frozenset({"Transpose", "MatMul", "Mul", "Div", "Add", "Sub", "Softmax", "Cast",
                     "Where", "Dropout", "Identity", "Split", "Squeeze", "Unsqueeze", "Gather",
                     "Slice", "Reshape", "Sqrt", "Max", "Min", "Expand", "Concat", "Neg"})
_PASS = ("Identity", "Cast", "Dropout")
_MAX_WALK = 120


@dataclass(frozen=True)
class HeadSplit:
    """A Reshape splitting output features ``offset`` … of ``layer`` into ``parts`` × heads
    (``parts`` = 3 for a fused q | k | v split in one Reshape); ``reshapes``: the shape
    constants met on the way (see :class:`~onnxdiag.graph.groups.ChannelReshape`)."""

    reshape: str
    layer: str
    offset: int
    n_heads: int
    head_dim: int
    parts: int
    reshapes: tuple = ()


@dataclass(frozen=True)
class AttentionBlock:
    """The head splits joined by one Reshape ``merge`` and read by ``output_layer``."""

    splits: tuple[HeadSplit, ...]
    merge: str
    output_layer: str
    n_heads: int
    head_dim: int
    reshapes: tuple = ()

    def members(self) -> list[tuple[str, int]]:
        """(layer, offset in heads) of every projection the heads index, by layer and
        offset."""
        order = list(dict.fromkeys(s.layer for s in self.splits))
        return sorted(((s.layer, s.offset // s.head_dim + p * s.n_heads)
                       for s in self.splits for p in range(s.parts)),
                      key=lambda m: (order.index(m[0]), m[1]))


def find_attention_blocks(index: GraphIndex, layers) -> list[AttentionBlock]:
    """Every attention block whose head splits come from ``layers`` (graph Layers)."""
    by_name = {la.node_name: la for la in layers}
    by_merge: dict[str, list] = defaultdict(list)
    for layer in layers:
        if layer.op_type not in ("Gemm", "MatMul") or layer.is_head:
            continue
        for split in _splits_from(index, layer):
            merge = _merge_of(index, split)
            if merge is not None:
                by_merge[merge].append(split)
    blocks = []
    for merge, splits in by_merge.items():
        block = _block(index, by_name, merge, splits)
        if block is not None:
            blocks.append(block)
    return blocks


def _start(index: GraphIndex, layer) -> str:
    if layer.bias_node:
        return index.node_by_name[layer.bias_node].output[0]
    return layer.output


def _splits_from(index: GraphIndex, layer) -> list[HeadSplit]:
    """The head splits of ``layer``'s output; [] when the output also goes elsewhere."""
    found, stack = [], [(_start(index, layer), 0, layer.n_out, ())]
    while stack:
        tensor, offset, width, seen = stack.pop()
        for user, slot in index.consumers_of(tensor):
            if user.op_type in ("Shape", "Size"):
                continue
            step = _step(index, user, slot, tensor, width)
            if step is None:
                return []
            if isinstance(step, tuple):  # a head split: (n_heads, head_dim, parts, record)
                n_heads, head_dim, parts, record = step
                found.append(HeadSplit(user.name, layer.node_name, offset, n_heads, head_dim,
                                       parts, seen + record))
                continue
            stack += [(out, offset + start, size, seen + rec) for out, start, size, rec in step]
    return found


def _step(index: GraphIndex, node, slot: int, tensor: str, width: int):
    """How ``node`` carries ``width`` channels-last features of ``tensor``: a list of
    (output, start, size, reshape records), a head split tuple, or None (it mixes them)."""
    if slot != 0:
        return None
    if node.op_type in _PASS:
        return [(node.output[0], 0, width, ())]
    rank = index.rank(tensor)
    if node.op_type == "Split":
        return _split_parts(index, node, rank, width)
    if node.op_type != "Reshape" or rank is None:
        return None
    target, shape = reshape_target(index, node), index.shape(tensor)
    if not target:
        return None
    tail = target[rank - 1:]
    one_head = len(tail) == 2 and tail[0] == 1 and tail[1] == width  # (…, 1, d): one head
    if not one_head and (target[-1] == width or (target[-1] is not None and shape
                                                 and target[-1] == shape[-1])):
        return [(node.output[0], 0, width, _record(index, node, len(target) - 1, width))]
    if len(tail) in (2, 3) and all(isinstance(d, int) and d > 0 for d in tail) \
            and int(np.prod(tail)) == width and (len(tail) == 2 or tail[0] == 3):
        n_heads, head_dim = tail[-2], tail[-1]
        record = _record(index, node, len(target) - 2, n_heads, "heads")
        return n_heads, head_dim, 1 if len(tail) == 2 else 3, record
    return None


def _split_parts(index: GraphIndex, node, rank, width: int):
    """The parts of a Split along the features, each with the record of its size: input
    1's constant element, or (opset < 13) the ``split`` attribute's (input index -1)."""
    axis = int(get_attr(node, "axis", 0))
    if rank is None or axis not in (-1, rank - 1):
        return None
    sizes, slot, source = get_attr(node, "split"), -1, None
    if sizes is None and len(node.input) > 1 and node.input[1]:
        value, slot, source = index.get_constant(node.input[1]), 1, node.input[1]
        sizes = None if value is None else value.ravel().tolist()
        if value is None:
            return None
    if sizes is None:  # equal parts: they follow the width
        sizes, slot = [width // len(node.output)] * len(node.output), None
    if sum(sizes) != width or len(sizes) != len(node.output):
        return None
    starts = np.cumsum([0, *sizes[:-1]])
    return [(out, int(s), int(n), () if slot is None else
             ((node.name, slot, k, int(n), "channels", source, k),))
            for k, (out, s, n) in enumerate(zip(node.output, starts, sizes)) if out]


def _record(index: GraphIndex, node, position: int, value: int,
            meaning: str = "channels") -> tuple:
    """A shape constant to rewrite, when element ``position`` of the target is literal:
    ``((node, input index, position, value, meaning, constant, its element),)``."""
    raw = shape_value(index, node.input[1])
    if raw is None or position >= len(raw) or raw[position] != value:
        return ()
    source = literal_position(index, node.input[1], position)
    return () if source is None else ((node.name, 1, position, value, meaning, *source),)


def _merge_of(index: GraphIndex, split: HeadSplit) -> str | None:
    """The Reshape that joins the heads of ``split`` back, reached through per-head ops."""
    width = split.n_heads * split.head_dim
    start = index.node_by_name[split.reshape]
    frontier, seen = [start.output[0]], {start.name}
    while frontier and len(seen) < _MAX_WALK:
        tensor = frontier.pop()
        for user, _ in index.consumers_of(tensor):
            if user.name in seen or user.op_type not in _INSIDE:
                continue
            seen.add(user.name)
            if user.op_type == "MatMul" and any(index.get_constant(t) is not None
                                                for t in user.input):
                continue  # a layer: left the attention block
            if user.op_type == "Reshape" and _joins(index, user, tensor, split, width):
                return user.name
            frontier += [o for o in user.output if o]
    return None


def _joins(index: GraphIndex, node, tensor: str, split: HeadSplit, width: int) -> bool:
    """A Reshape (…, H, d) → (…, H·d) (or (…, -1) when the dims before are not known)."""
    target, shape = reshape_target(index, node), index.shape(tensor)
    if not target or target[-1] not in (width, -1):
        return False
    return shape is None or (len(shape) == len(target) + 1
                             and shape[-1] in (split.head_dim, None)
                             or (len(shape) == len(target) + 1
                                 and not isinstance(shape[-1], int)))


def _block(index: GraphIndex, by_name: dict, merge: str, splits: list) -> AttentionBlock | None:
    geometry = {(s.n_heads, s.head_dim) for s in splits}
    if len(geometry) != 1 or sum(s.parts for s in splits) < 2:
        return None  # e.g. grouped-query attention (fewer key/value heads): not a head group
    n_heads, head_dim = geometry.pop()
    if any(s.offset % head_dim for s in splits):
        return None
    node = index.node_by_name[merge]
    records = list(_record(index, node, len(reshape_target(index, node)) - 1,
                           n_heads * head_dim))
    tensor = node.output[0]
    for _ in range(4):
        users = [(u, i) for u, i in index.consumers_of(tensor)
                 if u.op_type not in ("Shape", "Size")]
        layer = next((by_name[u.name] for u, i in users if u.name in by_name and i == 0), None)
        if layer is not None:
            return AttentionBlock(tuple(splits), merge, layer.node_name, n_heads, head_dim,
                                  tuple(records))
        step = _step(index, users[0][0], users[0][1], tensor, n_heads * head_dim) \
            if len(users) == 1 else None
        if not isinstance(step, list) or len(step) != 1:
            return None
        tensor = step[0][0]
        records += step[0][3]
    return None
