"""Unstructured magnitude masks and their application to a model copy (METHODS §C1).

A mask is a boolean array of the weight's stored shape, True = kept.  Within a
layer the largest |w| are kept; ties are broken by flat index, the lower index
kept (so masks are reproducible across runs and platforms).  Prunable set: every
Conv and every Gemm / MatMul with a constant weight (METHODS §D: an MLP's hidden layers, a
transformer's attention and MLP projections, the head); biases, BN and LayerNorm
parameters and embedding tables (read by Gather: not layers) are never pruned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np
import onnx

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from ..model.edit import ModelEditor
from .budget import LayerInfo, prune_count

#: The ops whose constant weight is pruned (METHODS §C1, §D).
PRUNABLE_OPS = ("Conv", "Gemm", "MatMul")


def magnitude_order(weight: np.ndarray) -> np.ndarray:
    """Flat indices of ``weight`` in keep-first order: |w| descending, ties lower index first.

    Returns an ``(weight.size,)`` int64 array; the first ``n_keep`` entries are kept.
    """
    weight = np.asarray(weight)
    # float32 holds |w| of float16 / float32 weights exactly (and sorts faster than float64)
    dtype = np.float64 if weight.dtype == np.float64 else np.float32
    mag = np.abs(weight.astype(dtype, copy=False)).ravel()
    if dtype == np.float32 and mag.size < 2 ** 32 and not np.isnan(mag).any():
        # One unstable sort of unique 64-bit keys (SIMD-sorted, ~10x a stable argsort):
        # the bits of |w| (monotone for float32 ≥ 0) flipped for descending order, above
        # the flat index for the ties; the low 32 bits are then the order.
        keys = (np.uint64(0xFFFFFFFF) - mag.view(np.uint32).astype(np.uint64)) << np.uint64(32)
        keys |= np.arange(mag.size, dtype=np.uint64)
        keys.sort()
        return (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)
    return np.argsort(-mag, kind="stable")


#: Buckets of the selection in :func:`magnitude_levels`: the top 16 bits of |w|'s float32
#: pattern (sign, exponent, 7 mantissa bits; a bucket spans under 1 % of a value).
_BUCKET_SHIFT = np.uint32(16)


def magnitude_levels(weight: np.ndarray, kept) -> np.ndarray:
    """Per flat weight, the first level j whose mask of ``kept[j]`` weights drops it, or
    ``len(kept)`` when none does: the number of levels j with ``kept[j]`` > its rank in
    :func:`magnitude_order` (``kept`` non-increasing). uint8 for fewer than 255 levels,
    uint32 otherwise; equal to ranking by :func:`magnitude_order` (tested), without
    sorting every weight.

    A selection instead of a sort: the weights are counted into buckets of their |w|'s
    top float32 bits; a bucket no level's cut falls inside of gets one level for all its
    weights, and only the weights of the (at most ``len(kept)``) buckets holding a cut
    are ranked exactly, by the keys of :func:`magnitude_order`. float64 and NaN weights
    are ranked by :func:`magnitude_order` itself."""
    weight = np.asarray(weight)
    kept = np.asarray(kept, dtype=np.int64)
    if kept.size > 1 and np.any(np.diff(kept) > 0):
        raise ValueError("kept counts must be non-increasing")
    dtype = np.uint8 if kept.size < 255 else np.uint32
    size = weight.size
    mag = np.abs(weight.astype(np.float32 if weight.dtype != np.float64 else np.float64,
                              copy=False)).ravel()
    if mag.dtype == np.float64 or size >= 2 ** 32 or np.isnan(mag).any():
        ranks = np.empty(size, np.int64)
        ranks[magnitude_order(weight)] = np.arange(size)
        return _level_of_rank(kept, ranks).astype(dtype)
    bucket = mag.view(np.uint32) >> _BUCKET_SHIFT
    counts = np.bincount(bucket)
    above = np.cumsum(counts[::-1])[::-1] - counts  # weights in higher buckets (kept first)
    # a bucket's ranks are above[b] .. above[b] + counts[b] - 1: a cut k inside that range
    # (above < k < above + count) splits it; otherwise all its weights share one level
    level_of = _level_of_rank(kept, above).astype(dtype)
    split = np.zeros(counts.size, bool)
    for k in np.unique(kept):
        b = np.searchsorted(-above, -k, side="left")  # the lowest-ranked bucket above ≤ k
        if b < counts.size and above[b] < k < above[b] + counts[b]:
            split[b] = True
    levels = level_of[bucket]
    if split.any():
        idx = np.flatnonzero(split[bucket])
        keys = (np.uint64(0xFFFFFFFF) - mag[idx].view(np.uint32).astype(np.uint64)) \
            << np.uint64(32)
        keys |= idx.astype(np.uint64)
        order = np.argsort(keys)
        ranked = idx[order]
        b = bucket[ranked]
        # the weights of one bucket are consecutive in ``ranked``: rank = above + offset
        first = np.searchsorted(-b.astype(np.int64), -b.astype(np.int64), side="left")
        ranks = above[b] + (np.arange(ranked.size) - first)
        levels[ranked] = _level_of_rank(kept, ranks).astype(dtype)
    return levels


def _level_of_rank(kept: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """How many of the non-increasing ``kept`` exceed each rank (int64)."""
    return np.searchsorted(-kept, -np.asarray(ranks, np.int64), side="left")


def magnitude_mask(weight: np.ndarray, sparsity: float | None = None, *,
                   n_keep: int | None = None, order: np.ndarray | None = None) -> np.ndarray:
    """Keep the largest |w| of ``weight`` (METHODS §C1): a bool mask of its shape, True = kept.

    Give ``sparsity`` (prunes exactly ``prune_count(size, sparsity)`` = ⌊s·size⌋
    weights) or ``n_keep`` (keeps exactly that many).  Ties in |w| keep the lower flat
    index.  ``order``: :func:`magnitude_order` of ``weight`` if already at hand (otherwise
    a selection, :func:`magnitude_levels`: the same mask without a sort).
    ``weight`` is not modified.
    """
    weight = np.asarray(weight)
    if (sparsity is None) == (n_keep is None):
        raise ValueError("give exactly one of sparsity or n_keep")
    if n_keep is None:
        n_keep = weight.size - prune_count(weight.size, sparsity)
    if not 0 <= n_keep <= weight.size:
        raise ValueError(f"n_keep={n_keep} outside [0, {weight.size}]")
    if order is None:  # a selection (magnitude_levels): level 1 = never dropped = kept
        return (magnitude_levels(weight, [n_keep]) == 1).reshape(weight.shape)
    mask = np.zeros(weight.size, dtype=bool)
    mask[order[:n_keep]] = True
    return mask.reshape(weight.shape)


def find_prunable(structure, keep_dense: Iterable[str] = ()) -> list:
    """The prunable layers (METHODS §C1, §D): every Conv and every Gemm / MatMul (hidden
    linear layers and the head alike), in topological order.

    All of them count in the budget's N (METHODS §C3: a fraction of all prunable weights);
    ``keep_dense`` is only validated here and handed to :func:`allocate_sparsity`,
    which leaves those layers dense.  Layers the graph analysis marks unprunable
    (computed weights, ConvTranspose, Gemm with transA) are skipped.

    Raises:
        OnnxDiagError: a ``keep_dense`` name is not a prunable layer (the message lists them).
    """
    layers = [la for la in structure.layers
              if la.prunable and la.op_type in PRUNABLE_OPS]
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


def make_masks(allocation, weights: Mapping[str, np.ndarray], orders: dict | None = None
               ) -> dict[str, np.ndarray]:
    """Magnitude masks keeping ``allocation.n_kept[name]`` weights of each layer.

    ``orders``: a cache for masks of the same weights made again (a sweep's cells): a
    layer's first mask comes from a selection (:func:`magnitude_levels`, no sort) and marks
    it seen (None); its second sorts it once (:func:`magnitude_order`, kept for every later
    mask). The masks are :func:`magnitude_mask`'s either way."""
    masks = {}
    for name, k in allocation.n_kept.items():
        order = None
        if orders is not None and name not in orders:
            orders[name] = None
        elif orders is not None:
            if orders[name] is None:  # int32 flat indices: half the memory
                order = magnitude_order(weights[name])
                orders[name] = order.astype(np.int32) if order.size < 2 ** 31 else order
            order = orders[name]
        masks[name] = magnitude_mask(weights[name], n_keep=int(k), order=order)
    return masks


def apply_masks(model: onnx.ModelProto, masks: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` with each masked layer's weight zeroed where the mask is False.

    ``masks`` maps a layer's node name to a bool mask of its weight's stored shape.  A
    weight initializer shared with another node (or reached through Identity / a
    Constant node) gets its own copy first, so only the named layer changes.  The copy
    comes back through the editor's checked ``finish()``.  Never modifies ``model``.

    Raises:
        OnnxDiagError: an unknown node name or a mask of the wrong shape.
    """
    editor = ModelEditor(model)
    write_masks(editor, masks)
    return editor.finish()


def write_masks(editor: ModelEditor, masks: Mapping[str, np.ndarray]) -> None:
    """Zero each masked layer's weight in ``editor`` (see :func:`apply_masks`)."""
    for name, mask in masks.items():
        node = editor.node(name)
        weight = editor.value(node.input[1])
        mask = np.asarray(mask, dtype=bool)
        if weight is None or mask.shape != weight.shape:
            raise OnnxDiagError(
                f"Mask for layer {name!r} has shape {mask.shape}, but its weight is "
                f"{None if weight is None else weight.shape}; masks use the stored weight shape.")
        editor.set_input(name, 1, np.where(mask, weight, 0).astype(weight.dtype))
