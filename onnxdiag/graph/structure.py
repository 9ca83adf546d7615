"""The structure of a classifier graph in one record: head, layers, channel groups, totals."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from ..errors import HeadNotFoundError
from ._records import jsonable
from .groups import ChannelGroup, find_channel_groups
from .head import Head, find_head, find_head_candidates
from .index import GraphIndex
from .layers import Layer, find_layers, get_layer
from .verify import find_verified_head


@dataclass(frozen=True)
class TensorInfo:
    """A graph input or output: name, NumPy dtype name (None if not a tensor), shape."""

    name: str
    dtype: str | None
    shape: tuple | None

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape)}


@dataclass(frozen=True, eq=False)
class Structure:
    """What :func:`analyze_structure` finds.

    Fields:
        head: the classifier head (None only with ``require_head=False``).
        layers, groups: see :func:`find_layers` / :func:`find_channel_groups`.
        inputs / outputs: graph inputs (initializers excluded) and outputs.
        opset, ir_version: default-domain opset and IR version.
        n_params: elements of the floating-point initializers the graph computes with,
            counted once per node reading them (through Identity nodes, subgraphs
            included): an initializer shared by two layers counts twice.
        n_stored: elements of all floating-point initializers as stored, each once.
        n_params_layers: weights + biases of the layers.
        flops: sum of the layers' FLOPs (2 × MACs); None if any layer's is unknown.
        flops_known: the sum over layers whose FLOPs are known.
        notes: what was skipped or assumed.
        head_candidates: names of the nodes that could be a head (listed even when no
            head is found: name one with --head NODE).
    """

    head: Head | None
    layers: tuple[Layer, ...]
    groups: tuple[ChannelGroup, ...]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    opset: int
    ir_version: int
    n_params: int
    n_stored: int
    n_params_layers: int
    flops: int | None
    flops_known: int
    notes: tuple[str, ...] = ()
    head_candidates: tuple[str, ...] = ()

    def get_layer(self, node_name: str) -> Layer:
        """The layer called ``node_name``; raises KeyError listing available names."""
        return get_layer(list(self.layers), node_name)

    def to_dict(self, *, arrays: bool = False) -> dict:
        """JSON-able dict (head weight/bias summarised unless ``arrays``)."""
        d = {k: jsonable(getattr(self, k)) for k in (
            "layers", "groups", "inputs", "outputs", "opset", "ir_version", "n_params",
            "n_stored", "n_params_layers", "flops", "flops_known", "notes", "head_candidates")}
        d["head"] = None if self.head is None else self.head.to_dict(arrays=arrays)
        return d


def analyze_structure(model: onnx.ModelProto, *, head: str | None = None,
                      features: str | None = None, require_head: bool = True,
                      feeds: dict | None = None, providers=None) -> Structure:
    """Head, layers, channel groups and totals of ``model``; never modifies it.

    Args:
        model: a loaded model (see :func:`onnxdiag.model.io.load_model`).
        head, features: overrides passed to :func:`find_head`.
        require_head: when False a model without a head gives ``head=None`` and a note
            instead of raising.
        feeds: one batch ({input name: array}); when given the head is found by
            verification on it (:func:`onnxdiag.graph.verify.find_verified_head`, run on
            ``providers``), else without data (:func:`find_head`).

    Raises:
        HeadNotFoundError: no head (only when ``require_head``).
    """
    index = GraphIndex(model)
    notes = []
    try:
        found = find_head(index, head=head, features=features) if feeds is None else \
            find_verified_head(index, feeds, head=head, features=features, providers=providers)
    except HeadNotFoundError as exc:
        if require_head:
            raise
        found, notes = None, [str(exc)]
    layers = find_layers(index, found)
    groups = find_channel_groups(index, layers)
    unknown = [la.node_name for la in layers if la.flops is None]
    if unknown:
        notes.append(f"FLOPs unknown for {len(unknown)} layer(s) (dynamic or unknown shapes), "
                     f"first: {', '.join(unknown[:5])}")
    known = sum(la.flops for la in layers if la.flops is not None)
    return Structure(
        head=found, layers=tuple(layers), groups=tuple(groups),
        inputs=tuple(_info(index, n) for n in index.inputs),
        outputs=tuple(_info(index, n) for n in index.outputs),
        opset=index.opset, ir_version=int(model.ir_version),
        n_params=_count_params(index), n_stored=_count_stored(index),
        n_params_layers=sum(la.n_params for la in layers),
        flops=None if unknown else known, flops_known=known, notes=tuple(notes),
        head_candidates=tuple(find_head_candidates(index)))


def _info(index: GraphIndex, name: str) -> TensorInfo:
    et = index.elem_type(name)
    dtype = None if et is None else np.dtype(onnx.helper.tensor_dtype_to_np_dtype(et)).name
    return TensorInfo(name, dtype, index.shape(name))


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
           onnx.TensorProto.BFLOAT16)


def _count_stored(index: GraphIndex) -> int:
    return sum(int(np.prod(t.dims)) for t in index.initializers.values()
               if t.data_type in _FLOATS)


def _count_params(index: GraphIndex) -> int:
    """Per use: each float initializer's elements times the nodes reading it (a node
    reading it twice counts once; Identity nodes pass the reads on; unread: 0)."""
    sizes = {name: int(np.prod(t.dims)) for name, t in index.initializers.items()
             if t.data_type in _FLOATS}
    nodes = list(_all_nodes(index.model.graph))
    alias = {}
    for node in nodes:  # Identity chains: reads of the copy are reads of the initializer
        if node.op_type == "Identity" and node.input and node.output:
            alias[node.output[0]] = node.input[0]

    def root(name: str) -> str:
        seen = set()
        while name in alias and name not in seen:
            seen.add(name)
            name = alias[name]
        return name

    uses = 0
    for node in nodes:
        if node.op_type != "Identity":
            uses += sum(sizes.get(name, 0) for name in {root(n) for n in node.input if n})
    return uses


def _all_nodes(graph: onnx.GraphProto):
    """The graph's nodes and those of its subgraphs (If / Loop / Scan bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                        attr.graphs if attr.type == onnx.AttributeProto.GRAPHS else ()):
                yield from _all_nodes(sub)
