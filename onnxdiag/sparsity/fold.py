"""Fold a per-output-channel repair into one Conv / Gemm / MatMul layer (METHODS §C1, §D).

A repair y' = α·y + shift per output channel (channel = a conv's output channel, a linear
layer's output feature) is written into the layer itself: α scales the weight's output
channels (a conv's first weight axis; a Gemm's rows with ``transB=1``, else the weight's
columns) and the bias (the node's own bias input, Gemm's ``beta`` honoured, or the constant
of its bias Add); the shift goes into that bias. A MatMul without a bias Add that needs a
shift gets one (:func:`add_missing_bias`) before the sequential pass starts.

Channel rows: a conv's output is ``(n, C, *spatial)`` (channel axis 1), a linear layer's
``(..., C)`` (channel axis last; positions = every leading axis, METHODS §D).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from onnx import helper

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from ..graph.index import get_attr
from ..model.edit import ModelEditor
from ..model.expose import expose_tensors
from ..report.json import to_jsonable as jsonable
from ..runtime.bound import BoundRunner
from ..runtime.pool import thread_map
from ..runtime.runner import OrtRunner
from ..stats import Moments
from .segments import batch_len

#: Normalisations over the channels of each token (METHODS §D): nothing to recalibrate.
LAYER_NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization",
                  "SkipLayerNormalization", "SkipSimplifiedLayerNormalization")


@dataclass(frozen=True, eq=False)
class LayerRepair:
    """What was folded into one layer: y' = alpha·y + shift (per output channel).

    ``kind``: "scale" (CR; a BN follows, the layer sits in a LayerNorm model, or no BN part
    was asked) or "affine" (no BN: CR and re-standardisation in one).  Arrays are (C,);
    ``shift`` is zeros for "scale"; ``mean_pruned`` / ``sigma_pruned``: the measured
    output's moments before the fold.
    """

    layer: str
    kind: str
    alpha: np.ndarray
    shift: np.ndarray
    sigma_dense: np.ndarray
    sigma_pruned: np.ndarray
    n_capped: int
    mean_pruned: np.ndarray | None = None  # μ^p (C,), before the fold
    n_samples: int = 0  # samples (images × positions) of the measured moments

    def to_dict(self, *, arrays: bool = False) -> dict:
        d = {"layer": self.layer, "kind": self.kind, "n_capped": self.n_capped,
             "alpha_min": float(self.alpha.min()), "alpha_median": float(np.median(self.alpha)),
             "alpha_max": float(self.alpha.max())}
        if arrays:
            d.update({k: jsonable(getattr(self, k)) for k in (
                "alpha", "shift", "sigma_dense", "sigma_pruned")})
        return d


def channel_rows(x: np.ndarray) -> np.ndarray:
    """(n, C, *spatial) or (n, C) → (n·Π spatial, C) float64 (channel axis 1)."""
    x = np.asarray(x, dtype=np.float64)
    return np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])


def output_rows(layer, y: np.ndarray) -> np.ndarray:
    """The layer's output ``y`` as (samples, C) float64 rows: a conv's channel axis is 1,
    a linear layer's the last (every leading axis is a position, METHODS §D)."""
    if layer.op_type in ("Conv", "ConvTranspose"):
        return channel_rows(y)
    y = np.asarray(y, dtype=np.float64)
    return y.reshape(-1, y.shape[-1])


def output_moments(layer, arrays, acc: Moments | None = None) -> Moments:
    """Per-channel moments of the layer's output over the batches ``arrays`` (folded into
    ``acc`` when given)."""
    axis = 1 if layer.op_type in ("Conv", "ConvTranspose") else -1
    for a in arrays:
        a = np.asarray(a)
        if a.ndim == 1:  # a linear layer's (C,) output: one sample
            a = a[None]
        if acc is None:
            acc = Moments(a.shape[axis], full=False)
        if axis == 1:  # float32 pairwise sums merged in float64 (stats.Moments)
            acc.update_channels(a)
        else:
            acc.update_axis(a, axis)
    return acc


def batch_moments(layer, arrays) -> Moments:
    """:func:`output_moments` of ``arrays`` with each batch folded on its own (on
    threads), then merged in order: the same moments to float64 rounding, and the same
    result whatever the number of threads (each batch's sums are its own)."""
    arrays = list(arrays)
    if len(arrays) < 2:
        return output_moments(layer, arrays)
    with thread_map(len(arrays)) as pool:
        parts = pool(lambda a: output_moments(layer, [a]), arrays)
    return merged(parts)


def merged(parts: list[Moments]) -> Moments:
    """Per-batch moments merged in order into the first (:func:`batch_moments`' merge:
    the same result whoever folded the batches, and when)."""
    acc = parts[0]
    for part in parts[1:]:
        acc.merge(part)
    return acc


def dense_moments(model, layers, batches, providers, threads) -> dict[str, Moments]:
    """{node name: output moments} of ``layers`` of ``model`` over ``batches`` (one pass,
    folded batch by batch: only one batch's outputs are held; the layers' folds, each its
    own, on threads)."""
    if not layers:
        return {}
    names = [la.output for la in layers]
    runner = OrtRunner(expose_tensors(model, names), providers=providers, threads=threads,
                       spinning=False)  # the moments' NumPy work runs between batches
    # each batch's outputs are folded before the next run: reused buffers, one run a batch
    bound = BoundRunner(runner, names, rows=max(batch_len(b) for b in batches))
    acc: dict = {la.node_name: None for la in layers}
    with thread_map(len(layers)) as pool:
        for b in batches:
            out = bound.run(b)
            items = [(la, out[la.output], acc[la.node_name]) for la in layers]
            folded = pool(lambda item: output_moments(item[0], [item[1]], item[2]), items)
            acc.update((la.node_name, m) for la, m in zip(layers, folded))
    return acc


def has_layer_norm(index: GraphIndex) -> bool:
    """Whether the model normalises tokens across channels (METHODS §D): a LayerNorm /
    RMSNorm op, or one written out (a ReduceMean over the last axis of a square)."""
    for node in index.nodes:
        if node.op_type in LAYER_NORM_OPS:
            return True
        if node.op_type == "ReduceMean" and _last_axis(index, node):
            producer = index.producer.get(node.input[0])
            if producer is not None and _is_square(index, producer):
                return True
    return False


def _last_axis(index: GraphIndex, node) -> bool:
    axes = get_attr(node, "axes", None)
    if axes is None and len(node.input) > 1 and node.input[1]:
        axes = index.get_constant(node.input[1])
    if axes is None:
        return False
    axes = [int(a) for a in np.atleast_1d(axes)]
    rank = index.rank(node.input[0])
    return len(axes) == 1 and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1))


def _is_square(index: GraphIndex, node) -> bool:
    if node.op_type == "Pow":
        e = index.get_constant(node.input[1])
        return e is not None and np.size(e) == 1 and float(np.ravel(e)[0]) == 2.0
    return node.op_type == "Mul" and node.input[0] == node.input[1]


def uses_affine(layer, with_bn: bool, layer_norm: bool) -> bool:
    """The folded-BN affine applies (METHODS §C1): a BN part was asked, the layer has no BN,
    and it is a conv or a linear layer of a model without LayerNorm (METHODS §D: under
    LayerNorm there is nothing to re-standardise)."""
    return with_bn and layer.bn_node is None and (layer.op_type == "Conv" or not layer_norm)


def add_missing_bias(editor: ModelEditor, layer):
    """A MatMul layer without a bias Add gets one (zeros) so that a shift can be folded:
    the MatMul now writes ``<output>_prebias`` and the Add the original output name
    (readers and graph outputs unchanged). Returns the layer record to use (updated
    ``output``, ``bias``, ``bias_node``); other layers come back as they are."""
    if layer.op_type != "MatMul" or layer.bias_node is not None:
        return layer
    w = editor.value(layer.weight)
    pre = editor.unique(f"{layer.output}_prebias")
    bias = editor.add_initializer(f"{layer.node_name}_bias", np.zeros(layer.n_out, w.dtype))
    add = editor.unique(f"{layer.node_name}_bias_add")
    editor.set_output(layer.node_name, 0, pre)
    editor.insert_after(layer.node_name, [helper.make_node("Add", [pre, bias], [layer.output],
                                                           name=add)])
    return dataclasses.replace(layer, output=pre, bias=bias, bias_node=add)


CR_EPS = 1e-8


def cr_alpha(kind: str, var_dense: np.ndarray, var_pruned: np.ndarray,
             cap: float = 100.0) -> np.ndarray:
    """α (C,) of a CR variant (METHODS §C1) from per-channel dense / pruned variances."""
    vd, vp = np.maximum(var_dense, 0.0), np.maximum(var_pruned, 0.0)
    if kind == "layer":
        a = np.full(vd.shape, np.sqrt(vd.mean()) / (np.sqrt(vp.mean()) + CR_EPS))
    else:
        a = np.sqrt(vd) / (np.sqrt(vp) + CR_EPS)
    a = np.minimum(a, cap)
    if kind == "shrunk":
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(vd > 0, vp / np.where(vd > 0, vd, 1.0), np.inf)
            med = float(np.median(r[np.isfinite(r)])) if np.isfinite(r).any() else 0.0
            lam = np.where(np.isinf(r), 1.0, np.divide(r, r + med, out=np.ones_like(r),
                                                       where=(r + med) > 0))
            a = np.where(a > 0, np.exp(lam * np.log(np.where(a > 0, a, 1.0))), 0.0)
    return a


def fold_repair(frontier: dict, editor: ModelEditor, layer, dense: Moments, cr_kind,
                affine: bool, cap: float, patch: bool = True,
                pruned: Moments | None = None) -> LayerRepair:
    """Measure ``layer``'s pruned output in ``frontier`` (its cached batches), fold
    y' = α·y + shift into the layer in ``editor`` and patch the cached output to match
    (``patch`` False: left as measured, for a caller whose next reader stands in for it).
    ``pruned``: those batches' moments when already folded (:func:`batch_moments`'
    result, e.g. folded while the pass ran on); None: folded here.

    α: the CR variant ``cr_kind`` (None: channel-wise, for a pure ``bn`` affine) capped at
    ``cap``; ``affine``: also re-standardise, shift = μ^d − α·μ^p of the output after its
    bias (METHODS §C1 folded-BN affine); else shift = 0.
    """
    index = editor.index
    node = index.get_node(layer.node_name)
    if pruned is None:
        pruned = batch_moments(layer, frontier[layer.output])
    vd, vp = dense.var(), pruned.var()
    alpha = cr_alpha(cr_kind or "channel", vd, vp, cap)
    w = _value(editor, node.input[1])
    editor.set_input(node.name, 1, scale_output_channels(layer, w, alpha))
    shift, in_node = _fold_bias(editor, index, layer, node, alpha, dense, pruned, affine)
    if patch:
        with thread_map(len(frontier[layer.output])) as pool:  # each batch its own patch
            frontier[layer.output] = pool(
                lambda y: _patched(layer, y, alpha, shift if in_node else None),
                frontier[layer.output])
    return LayerRepair(layer.node_name, "affine" if affine else "scale", alpha, shift,
                       np.sqrt(vd), np.sqrt(vp), int(np.sum(alpha >= cap)), pruned.mean,
                       pruned.n)


def scale_output_channels(layer, w: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """``w`` with output channel c multiplied by α_c: each float64 product rounded once to
    ``w``'s dtype (one float64 copy of ``w``, multiplied in place)."""
    if layer.op_type == "Conv":
        a = alpha.reshape(-1, *[1] * (w.ndim - 1))
    else:
        a = alpha[:, None] if layer.weight_layout == "oi" else alpha[None, :]
    w64 = np.array(w, np.float64)
    return np.multiply(w64, a, out=w64).astype(w.dtype)


def bias_state(editor, index, layer, node):
    """(holder node, input slot or None, bias value or None, beta, in-node flag); beta is
    Gemm's scale of its C input, also of a C the repair adds."""
    beta = float(get_attr(node, "beta", 1.0)) if node.op_type == "Gemm" else 1.0
    if len(node.input) > 2 and node.input[2]:
        return node, 2, _value(editor, node.input[2]), beta, True
    if layer.bias_node:
        add = index.get_node(layer.bias_node)
        slot = list(add.input).index(layer.bias)
        return add, slot, _value(editor, add.input[slot]), 1.0, False
    return node, None, None, beta, True


def _fold_bias(editor, index, layer, node, alpha, dense, pruned, affine) -> tuple:
    """Write α·b + shift into the bias; returns (shift (C,), whether it lies inside the
    node's own output) — for a bias Add the shift reaches the Add's output instead."""
    holder, slot, b, beta, in_node = bias_state(editor, index, layer, node)
    if beta == 0.0:  # Gemm ignores C: the repaired bias is written with beta = 1
        editor.set_attribute(node.name, "beta", 1.0)
        b, beta = None, 1.0
    c = alpha.size
    full = np.zeros(c) if b is None else beta * np.asarray(b, np.float64)
    per_channel = full.size == c
    flat = full.reshape(-1) if per_channel else full  # else Gemm's C broadcast (last axis C)
    extra = 0.0 if in_node else flat  # the full output's mean includes the Add's bias
    shift = ((dense.mean + extra) - alpha * (pruned.mean + extra)) if affine else np.zeros(c)
    if b is not None or affine:
        new = alpha * flat + shift
        shape = b.shape if b is not None and per_channel else np.shape(new)
        dtype = b.dtype if b is not None else _value(editor, node.input[1]).dtype
        editor.set_input(holder.name, 2 if slot is None else slot,
                         (np.asarray(new) / beta).reshape(shape).astype(dtype))
    return shift, in_node


def _patched(layer, y: np.ndarray, alpha: np.ndarray, in_node) -> np.ndarray:
    """A cached output batch after the fold: α·y (+ the in-node shift)."""
    shape = (1, -1, *[1] * (y.ndim - 2)) if layer.op_type == "Conv" else (-1,)
    if y.dtype == np.float32 and y.flags.writeable:  # a segment's own output: in place
        np.multiply(y, alpha.reshape(shape).astype(np.float32), out=y)
        if in_node is not None:
            np.add(y, in_node.reshape(shape).astype(np.float32), out=y)
        return y
    out = y * alpha.reshape(shape).astype(np.float32)
    if in_node is not None:
        out = out + in_node.reshape(shape).astype(np.float32)
    return out.astype(y.dtype)


def _value(editor: ModelEditor, name: str) -> np.ndarray:
    value = editor.value(name)  # initializers, Identity / Constant sources
    if value is None:
        raise OnnxDiagError(f"Tensor {name!r} is not a constant; cannot fold a repair into it.")
    return value
