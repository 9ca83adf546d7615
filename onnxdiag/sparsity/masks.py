"""Unstructured magnitude masks and their application to a model copy (SPEC C1).

A mask is a boolean array of the weight's stored shape, True = kept.  Within a
layer the largest |w| are kept; ties are broken by flat index, the lower index
kept (so masks are reproducible across runs and platforms).  Prunable set: every
Conv and the head Gemm / MatMul weight; biases and BN parameters are never pruned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from .budget import LayerInfo, prune_count


def magnitude_order(weight: np.ndarray) -> np.ndarray:
    """Flat indices of ``weight`` in keep-first order: |w| descending, ties lower index first.

    Returns an ``(weight.size,)`` int64 array; the first ``n_keep`` entries are kept.
    """
    weight = np.asarray(weight)
    # float32 holds |w| of float16 / float32 weights exactly (and sorts faster than float64)
    dtype = np.float64 if weight.dtype == np.float64 else np.float32
    return np.argsort(-np.abs(weight.astype(dtype, copy=False)).ravel(), kind="stable")


def magnitude_mask(weight: np.ndarray, sparsity: float | None = None, *,
                   n_keep: int | None = None) -> np.ndarray:
    """Keep the largest |w| of ``weight`` (SPEC C1): a bool mask of its shape, True = kept.

    Give ``sparsity`` (prunes exactly ``prune_count(size, sparsity)`` = ⌊s·size⌋
    weights) or ``n_keep`` (keeps exactly that many).  Ties in |w| keep the lower flat
    index.  ``weight`` is not modified.
    """
    weight = np.asarray(weight)
    if (sparsity is None) == (n_keep is None):
        raise ValueError("give exactly one of sparsity or n_keep")
    if n_keep is None:
        n_keep = weight.size - prune_count(weight.size, sparsity)
    if not 0 <= n_keep <= weight.size:
        raise ValueError(f"n_keep={n_keep} outside [0, {weight.size}]")
    mask = np.zeros(weight.size, dtype=bool)
    mask[magnitude_order(weight)[:n_keep]] = True
    return mask.reshape(weight.shape)


def find_prunable(structure, keep_dense: Iterable[str] = ()) -> list:
    """The prunable layers (SPEC C1): every Conv and the head Gemm / MatMul, in topological order.

    All of them count in the budget's N (SPEC C3: a fraction of all prunable weights);
    ``keep_dense`` is only validated here and handed to :func:`allocate_sparsity`,
    which leaves those layers dense.  Layers the graph analysis marks unprunable
    (computed weights, ConvTranspose) are skipped.

    Raises:
        OnnxDiagError: a ``keep_dense`` name is not a prunable layer (the message lists them).
    """
    layers = [la for la in structure.layers if la.prunable and (
        la.op_type == "Conv" or (la.is_head and la.op_type in ("Gemm", "MatMul")))]
    check_layer_names(keep_dense, [la.node_name for la in layers], "--keep-dense")
    return layers


def check_layer_names(names: Iterable[str], known: list[str], what: str) -> None:
    """Raise OnnxDiagError naming the unknown ``names`` and listing ``known`` ones."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise OnnxDiagError(
            f"{what} names {', '.join(map(repr, unknown[:5]))}, not prunable layer(s); prunable "
            f"layers (first 5 of {len(known)}): {', '.join(known[:5])}. `onnxdiag inspect MODEL` "
            "lists them all.")


def read_weights(model: onnx.ModelProto, layers) -> dict[str, np.ndarray]:
    """``{node_name: weight}`` in the stored shape (read-only arrays); never modifies ``model``."""
    index = GraphIndex(model)
    return {la.node_name: index.get_constant(la.weight) for la in layers}


def describe_layers(model: onnx.ModelProto, layers) -> list[LayerInfo]:
    """:class:`LayerInfo` records (ERK shape, projection flag) for ``layers`` of ``model``.

    A projection is a 1×1 conv (not the head) whose output, after its BN / bias, feeds an
    Add, and whose input is also read by another layer: the shortcut of a ResNet block.
    """
    index = GraphIndex(model)
    readers = Counter(la.input for la in layers)
    infos = []
    for la in layers:
        if la.op_type == "Conv":
            shape = (la.n_out, la.n_in // la.groups, *la.kernel)
            proj = (not la.is_head and all(k == 1 for k in la.kernel) and readers[la.input] > 1
                    and _feeds_add(index, la))
        else:
            shape, proj = (la.n_out, la.n_in), False
        infos.append(LayerInfo(la.node_name, tuple(int(d) for d in shape), is_projection=proj,
                               is_head=la.is_head))
    return infos


def _feeds_add(index: GraphIndex, layer) -> bool:
    post = layer.output
    if layer.bias_node:
        post = index.get_node(layer.bias_node).output[0]
    if layer.bn_position == "after":
        post = index.get_node(layer.bn_node).output[0]
    return any(n.op_type in ("Add", "Sum") for n, _ in index.consumers_of(post))


def make_masks(allocation, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Magnitude masks keeping ``allocation.n_kept[name]`` weights of each layer."""
    return {name: magnitude_mask(weights[name], n_keep=int(k))
            for name, k in allocation.n_kept.items()}


def apply_masks(model: onnx.ModelProto, masks: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` with each masked layer's weight zeroed where the mask is False.

    ``masks`` maps a layer's node name to a bool mask of its weight's stored shape.  A
    weight initializer shared with another node (or reached through Identity / a
    Constant node) gets its own copy first, so only the named layer changes.  Never
    modifies ``model``.

    Raises:
        OnnxDiagError: an unknown node name or a mask of the wrong shape.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    index = GraphIndex(out)
    uses = count_uses(out)
    used_before = {name for name, n in uses.items() if n > 0}
    for name, mask in masks.items():
        node = index.get_node(name)
        weight = index.get_constant(node.input[1])
        mask = np.asarray(mask, dtype=bool)
        if weight is None or mask.shape != weight.shape:
            raise OnnxDiagError(
                f"Mask for layer {name!r} has shape {mask.shape}, but its weight is "
                f"{None if weight is None else weight.shape}; masks use the stored weight shape.")
        set_input_constant(out, node, 1, np.where(mask, weight, 0).astype(weight.dtype), uses)
    drop_dead_constants(out, uses, used_before)
    return out


def drop_dead_constants(model: onnx.ModelProto, uses: Counter, used_before: set[str]) -> None:
    """Remove (in place) Constant / Identity nodes and initializers that were read before an
    edit (``used_before``) and no longer are: left behind when a weight reached through them
    was replaced.  Whatever was already unused stays."""
    graph = model.graph
    changed = True
    while changed:
        changed = False
        for node in list(graph.node):
            if node.op_type in ("Constant", "Identity") and all(
                    uses[t] <= 0 and t in used_before for t in node.output):
                uses.subtract(t for t in node.input if t)
                graph.node.remove(node)
                changed = True
    inputs = {v.name for v in graph.input}
    for init in list(graph.initializer):
        if uses[init.name] <= 0 and init.name in used_before and init.name not in inputs:
            graph.initializer.remove(init)


def count_uses(model: onnx.ModelProto) -> Counter:
    """How many node inputs (subgraphs included) and graph outputs read each tensor name."""
    uses: Counter = Counter(o.name for o in model.graph.output)

    def walk(graph):
        for node in graph.node:
            uses.update(t for t in node.input if t)
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    walk(sub)

    walk(model.graph)
    return uses


def set_input_constant(model: onnx.ModelProto, node: onnx.NodeProto, input_index: int,
                       value: np.ndarray, uses: Counter | None = None) -> str:
    """Make ``node.input[input_index]`` of ``model`` (edited in place) hold ``value``.

    The initializer is overwritten when this input is its only reader; otherwise (a
    shared initializer, an Identity / Constant source, or a missing optional input) a
    new uniquely named initializer is added and the input rewired to it.  ``uses``
    (from :func:`count_uses`) is updated.  Returns the initializer's name.
    """
    uses = count_uses(model) if uses is None else uses
    inits = {t.name: t for t in model.graph.initializer}
    while len(node.input) <= input_index:
        node.input.append("")
    name = node.input[input_index]
    if name and name in inits and uses[name] == 1:
        inits[name].CopyFrom(numpy_helper.from_array(np.asarray(value), name))
        return name
    base = f"{name or node.name + '_input' + str(input_index)}_{node.name}"
    new, i = base, 1
    taken = set(inits) | set(uses)
    while new in taken:
        new, i = f"{base}_{i}", i + 1
    model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), new))
    if name:
        uses[name] -= 1
    uses[new] += 1
    node.input[input_index] = new
    return new
