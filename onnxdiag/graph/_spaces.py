"""Channel-space bookkeeping behind :mod:`onnxdiag.graph.groups` (union-find + op rules).

A tensor's channel axis is described by a :class:`Space`: a list of segments, each
a run of consecutive channels belonging to one group (None: channels no layer
produces, e.g. a graph input).  A plain layer output has one segment; a concat
output has one per input.  ``block`` > 1 after a Flatten: channel c is the
``block`` consecutive features from c·block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from .index import GraphIndex


@dataclass(frozen=True)
class Segment:
    group: int | None
    offset: int
    length: int


@dataclass(frozen=True)
class Space:
    segments: tuple[Segment, ...]
    axis: int
    rank: int
    block: int = 1

    @property
    def n_channels(self) -> int:
        return sum(s.length for s in self.segments)

    def moved(self, axis: int, rank: int, block: int | None = None) -> Space:
        return Space(self.segments, axis, rank, self.block if block is None else block)


@dataclass
class _Info:
    n_channels: int
    members: list = field(default_factory=list)
    kinds: set = field(default_factory=set)
    consumers: list = field(default_factory=list)
    params: list = field(default_factory=list)
    reasons: list = field(default_factory=list)
    reshapes: list = field(default_factory=list)
    block_size: int = 1
    role: str | None = None


class Tracker:
    """Union-find over groups plus the space of every tensor seen so far."""

    def __init__(self, index: GraphIndex):
        self.index = index
        self.parent: list[int] = []
        self.info: list[_Info] = []
        self.order: list[int] = []
        self.spaces: dict[str, Space] = {}
        self.dissolved: set[int] = set()  # roots whose records are replaced (heads)

    # -- union-find --------------------------------------------------------------------------
    def new_space(self, member: str, n_channels: int, axis: int, rank: int) -> Space:
        gid = len(self.parent)
        self.parent.append(gid)
        self.order.append(gid)
        self.info.append(_Info(n_channels, members=[(member, 0)]))
        return Space((Segment(gid, 0, n_channels),), axis, rank)

    def new_source(self, n_channels: int, axis: int, rank: int, kind: str) -> Space:
        """A space of channels no layer produces but constants index (an embedding
        table's columns): a group without members."""
        gid = self.new_group(n_channels, kind)
        return Space((Segment(gid, 0, n_channels),), axis, rank)

    def new_group(self, n_channels: int, kind: str) -> int:
        gid = len(self.parent)
        self.parent.append(gid)
        self.order.append(gid)
        self.info.append(_Info(n_channels, kinds={kind}))
        return gid

    def find(self, gid: int) -> int:
        while self.parent[gid] != gid:
            self.parent[gid] = self.parent[self.parent[gid]]
            gid = self.parent[gid]
        return gid

    def union(self, a: int, b: int, kind: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            ra, rb = sorted((ra, rb), key=lambda r: self.order[r])
            self.parent[rb] = ra
            keep, gone = self.info[ra], self.info[rb]
            if keep.n_channels != gone.n_channels:
                keep.reasons.append(f"channel counts differ ({keep.n_channels} vs "
                                    f"{gone.n_channels})")
            for name in ("members", "consumers", "params", "reasons", "reshapes"):
                getattr(keep, name).extend(getattr(gone, name))
            keep.kinds |= gone.kinds
            keep.kinds.add(kind)

    def _groups(self, space: Space):
        return [self.info[self.find(s.group)] for s in space.segments if s.group is not None]

    def block(self, space: Space, reason: str) -> None:
        for info in self._groups(space):
            info.reasons.append(reason)

    def add_kind(self, space: Space, kind: str) -> None:
        for info in self._groups(space):
            info.kinds.add(kind)

    def add_reshape(self, space: Space, record: tuple) -> None:
        """A Reshape whose shape constant holds a count of these channels (rewritten
        when they are pruned, :mod:`onnxdiag.structured.counts`)."""
        for info in self._groups(space):
            info.reshapes.append(record)

    def add_member(self, seg: Segment, name: str, kind: str) -> None:
        if seg.group is not None:
            info = self.info[self.find(seg.group)]
            info.members.append((name, seg.offset))
            info.kinds.add(kind)

    def add_consumer(self, space: Space, node: onnx.NodeProto, input_index: int) -> None:
        for seg in space.segments:
            if seg.group is not None:
                info = self.info[self.find(seg.group)]
                info.consumers.append((node.name, node.op_type, input_index, seg.offset,
                                       space.block))
                if space.block > 1:
                    info.kinds.add("flatten")

    def add_param(self, space: Space, node: onnx.NodeProto, input_index: int, axis: int):
        for seg in space.segments:
            if seg.group is not None:
                tensor = node.input[input_index]
                self.info[self.find(seg.group)].params.append(
                    (node.name, input_index, tensor, axis, seg.offset,
                     self.index.source_initializer(tensor)))

    # -- helpers for the op rules -----------------------------------------------------------
    def unknown(self, node: onnx.NodeProto, ins, why: str = "not understood") -> None:
        for space in ins:
            if space is not None:
                self.block(space, f"op {node.op_type!r} (node {node.name!r}) {why}")

    def only_first(self, node, ins) -> Space | None:
        """Input 0's space; other mapped inputs are blocked (used as parameters)."""
        if any(s is not None for s in ins[1:]):
            self.unknown(node, [None, *ins[1:]], "reads channels as a parameter")
        return ins[0]

    def rank_of(self, tensor: str, default: int) -> int:
        return self.index.rank(tensor) or default
