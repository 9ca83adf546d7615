"""The structure of a classifier graph in one record: head, layers, channel groups, totals."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
                      feeds: dict | None = None, providers=None,
                      shape_feeds: dict | None = None) -> Structure:
    """Head, layers, channel groups and totals of ``model``; never modifies it.

    Args:
        model: a loaded model (see :func:`onnxdiag.model.io.load_model`).
        head, features: overrides passed to :func:`find_head`.
        require_head: when False a model without a head gives ``head=None`` and a note
            instead of raising.
        feeds: one batch ({input name: array}); when given the head is found by
            verification on it (:func:`onnxdiag.graph.verify.find_verified_head`, run on
            ``providers``), else without data (:func:`find_head`).
        shape_feeds: one batch whose shapes resolve the dimensions shape inference
            leaves open (see :func:`at_batch_shapes`).

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
    structure = _assemble(model, index, found, layers, groups, notes)
    if shape_feeds is not None:
        structure = at_batch_shapes(model, structure, shape_feeds, providers=providers)
    return structure


def _assemble(model, index, found, layers, groups, notes) -> Structure:
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


def at_batch_shapes(model: onnx.ModelProto, structure: Structure, feeds: dict, *,
                    providers=None) -> Structure:
    """``structure`` with each layer's shapes and FLOPs (per sample) at the shapes of one
    batch ``feeds``, where shape inference left a dimension open (tokens; GPT-2's
    N·T rows); the same record when nothing is open (no run then). A dimension 0 equal
    to the batch size stays symbolic (the batch).  One ONNX Runtime run on
    ``providers``; never modifies ``model``."""
    from .flops import layer_flops_per_sample
    from .shapes import batch_size, measured_shapes

    batch_dims = {i.shape[0] for i in structure.inputs if i.shape}
    open_layers = [la for la in structure.layers
                   if la.flops is None or not _static(la, batch_dims)]
    if not open_layers:
        return structure
    tensors = [t for la in open_layers for t in (la.input, la.output)]
    measured = measured_shapes(model, tensors, feeds, providers=providers)
    n = batch_size(feeds)
    resolved = {}
    for la in open_layers:
        if la.input not in measured or la.output not in measured:
            continue
        shape_in, shape_out = measured[la.input], measured[la.output]
        resolved[la.node_name] = replace(
            la, input_shape=_keep_batch(la.input_shape, shape_in, n),
            output_shape=_keep_batch(la.output_shape, shape_out, n),
            flops=layer_flops_per_sample(la, shape_in, shape_out, n))
    layers = tuple(resolved.get(la.node_name, la) for la in structure.layers)
    unknown = [la.node_name for la in layers if la.flops is None]
    notes = [n for n in structure.notes if not n.startswith("FLOPs unknown")]
    notes.append(f"shapes and FLOPs of {len(resolved)} layer(s) measured on one batch of "
                 f"{n} (dimensions shape inference left open); FLOPs are per sample")
    known = sum(la.flops for la in layers if la.flops is not None)
    return replace(structure, layers=layers, flops=None if unknown else known,
                   flops_known=known, notes=tuple(notes))


def _static(layer: Layer, batch_dims: set) -> bool:
    """Every dimension known, but a first one that is the inputs' batch (a linear layer's
    first dimension may also count rows of several tokens, GPT-2's N·T)."""
    shapes = (layer.input_shape, layer.output_shape)
    if any(s is None or not all(isinstance(d, int) for d in s[1:]) for s in shapes):
        return False
    first = layer.output_shape[0]
    return isinstance(first, int) or layer.op_type not in ("Gemm", "MatMul") \
        or len(layer.output_shape) > 2 or first in batch_dims


def _keep_batch(inferred: tuple | None, measured: tuple, n: int) -> tuple:
    if inferred and len(inferred) == len(measured) and not isinstance(inferred[0], int) \
            and measured[0] == n:
        return (inferred[0], *measured[1:])
    return measured


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
