"""Weighted layers (Conv / ConvTranspose / Gemm / MatMul) with geometry, FLOPs and BN pairing.

METHODS §B1 measures each Conv's pre-BN output; C1 prunes Conv and head weights.  This
module says, per layer, where that output is, which BatchNormalization normalises
it (or that BN was folded), and what activation follows.  Never modifies the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import onnx

from ._records import jsonable
from .activations import find_activation
from .flops import conv_flops, conv_output_spatial, conv_transpose_flops, linear_flops
from .index import GraphIndex, get_attr
from .norms import find_norms, norm_around
from .ops import BN_LOOKAHEAD
from .shapes import reshape_target

WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass(frozen=True)
class Layer:
    """One weighted node, keyed by ONNX names.

    Fields:
        node_name, op_type; input / output: data input and output tensors (``output``
            is the pre-BN, pre-bias-Add tensor: METHODS §B1's y).
        weight: the node's weight input tensor; weight_initializer: the initializer behind
            it (directly or through Identity), None when computed (e.g. a Transpose).
        weight_shape; weight_layout: "oihw" (Conv), "iohw" (ConvTranspose), "oi" (Gemm
            transB=1), "io" (Gemm transB=0, MatMul).
        bias: bias tensor (node input, or the constant of a following Add); bias_node: that
            Add node, else None.
        n_in / n_out: input / output channels (features for Gemm/MatMul).
        kernel, stride, dilation, pads: conv geometry (empty tuples for Gemm/MatMul).
        groups; depthwise: groups == n_in > 1.
        n_params: weight + bias elements.  flops: 2 × MACs (None when dynamic; see note).
        input_shape / output_shape: inferred shapes (None when unknown).
        bn_node / bn_position: the BatchNormalization of this layer's channels, "after"
            (reads the output, maybe past the bias Add) or "before_next" (behind an
            activation / pooling, before the next layer); None when absent.
        bn_folded: Conv without BN but with a bias (input or a per-channel Add): BN was
            probably folded by the exporter (or never present); the note says which.
        activation / activation_node: the activation after the layer or its BN ("SiLU"
            for x·Sigmoid(x), "HardSwish" for x·HardSigmoid(x)) and the node producing it.
        is_head; prunable: whether pruning edits are supported (False for ConvTranspose,
            Gemm transA=1 and computed weights), reason in ``note``.
        normalization: "batchnorm" (``bn_node``), "layernorm" or "rmsnorm" (normalising
            each token across channels, docs/METHODS.md §D), or None; norm_node: the
            norm's node (its last node when written out); norm_position: "output" (it
            reads the layer's output, maybe past a residual Add) or "input" (it wrote
            the layer's input, pre-norm style).
    """

    node_name: str
    op_type: str
    input: str
    output: str
    weight: str
    weight_initializer: str | None
    weight_shape: tuple[int, ...]
    weight_layout: str
    bias: str | None
    bias_node: str | None
    n_in: int
    n_out: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    pads: tuple[int, ...]
    groups: int
    depthwise: bool
    n_params: int
    flops: int | None
    input_shape: tuple | None
    output_shape: tuple | None
    bn_node: str | None
    bn_position: str | None
    bn_folded: bool
    activation: str | None
    activation_node: str | None
    is_head: bool
    prunable: bool
    note: str
    normalization: str | None = None
    norm_node: str | None = None
    norm_position: str | None = None

    def to_dict(self) -> dict:
        """JSON-able dict of every field."""
        return {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}


def find_layers(model: onnx.ModelProto | GraphIndex, head=None) -> list[Layer]:
    """Every Conv / ConvTranspose / Gemm / MatMul with a constant weight, in topological order.

    Args:
        model: a loaded model (shapes inferred; see :func:`onnxdiag.model_io.load_model`).
        head: the :class:`~onnxdiag.graph.head.Head` (or its node name) to flag, or None.

    Returns a possibly empty list; never modifies ``model``.
    """
    index = model if isinstance(model, GraphIndex) else GraphIndex(model)
    head_name = getattr(head, "node_name", head)
    norms = find_norms(index)
    layers = []
    for node in index.nodes:
        if node.op_type in WEIGHTED_OPS and node.domain in ("", "ai.onnx"):
            layer = _layer(index, node, node.name == head_name, norms)
            if layer is not None:
                layers.append(layer)
    return layers


def get_layer(layers: list[Layer], node_name: str) -> Layer:
    """The layer called ``node_name``; raises KeyError listing available names."""
    for layer in layers:
        if layer.node_name == node_name:
            return layer
    names = [la.node_name for la in layers]
    raise KeyError(f"No layer {node_name!r}; layers (first 5 of {len(names)}): "
                   f"{', '.join(names[:5])}")


def _layer(index: GraphIndex, node: onnx.NodeProto, is_head: bool, norms: dict
           ) -> Layer | None:
    if len(node.input) < 2:
        return None
    w = index.get_constant(node.input[1])
    if w is None or (node.op_type == "MatMul" and w.ndim != 2):
        return None
    geo = _geometry(index, node, w)
    bias, bias_node, post, notes = _bias(index, node, geo["n_out"])
    bias_size = 0 if bias is None else int(np.asarray(index.get_constant(bias)).size)
    bn_node, bn_position, post, bn_note = _batchnorm(index, post)
    activation, act_node = find_activation(index, _past_token_reshape(index, node, post,
                                                                      geo["n_out"]))
    if bn_node is None:
        bn_node, bn_position, bn_note = _bn_before_next(index, post)
    norm = _normalization(index, norms, node, post, bn_node)
    notes += [n for n in (bn_note, geo.pop("note")) if n]
    folded = node.op_type == "Conv" and not is_head and bn_node is None and bias is not None
    if folded:
        notes.append("no BatchNormalization and the conv has a bias "
                     + ("(a per-channel Add)" if bias_node else "(its bias input)")
                     + ": BN folded by the exporter, or the model never had BN")
    if activation == "Clip" and _clip_range(index, act_node) == (0.0, 6.0):
        notes.append("Clip(0, 6) = ReLU6")
    prunable, why = _prunable(index, node, w)
    notes += [why] if why else []
    return Layer(
        node_name=node.name, op_type=node.op_type, input=node.input[0], output=node.output[0],
        weight=node.input[1], weight_initializer=index.source_initializer(node.input[1]),
        weight_shape=tuple(int(d) for d in w.shape), bias=bias, bias_node=bias_node,
        n_params=int(w.size) + bias_size, bn_node=bn_node, bn_position=bn_position,
        bn_folded=folded, activation=activation, activation_node=act_node, is_head=is_head,
        prunable=prunable, note="; ".join(notes), **norm, **geo)


def _normalization(index: GraphIndex, norms: dict, node, post: str, bn_node) -> dict:
    if bn_node is not None:
        return dict(normalization="batchnorm", norm_node=bn_node, norm_position="output")
    if node.op_type not in ("Gemm", "MatMul"):
        return {}
    norm, position = norm_around(index, norms, node, post)
    return {} if norm is None else dict(normalization=norm.kind, norm_node=norm.nodes[-1],
                                        norm_position=position)


def _past_token_reshape(index: GraphIndex, node, tensor: str, n_out: int) -> str:
    """Past a Reshape that only regroups a linear layer's leading (token) axes: GPT-2's
    Conv1D runs a Gemm on (N·T, D) rows and reshapes them back to (N, T, D)."""
    user = index.sole_consumer(tensor)
    if node.op_type not in ("Gemm", "MatMul") or user is None or user.op_type != "Reshape" \
            or user.input[0] != tensor:
        return tensor
    target = reshape_target(index, user)
    return user.output[0] if target and target[-1] == n_out else tensor


def _geometry(index: GraphIndex, node: onnx.NodeProto, w: np.ndarray) -> dict:
    in_shape, out_shape = index.shape(node.input[0]), index.shape(node.output[0])
    op = node.op_type
    if op in ("Gemm", "MatMul"):
        trans = op == "Gemm" and bool(get_attr(node, "transB", 0))
        n_in, n_out = (w.shape[1], w.shape[0]) if trans else (w.shape[0], w.shape[1])
        flops, note = linear_flops(int(n_in), int(n_out), out_shape)
        return dict(weight_layout="oi" if trans else "io", n_in=int(n_in), n_out=int(n_out),
                    kernel=(), stride=(), dilation=(), pads=(), groups=1, depthwise=False,
                    flops=flops, input_shape=in_shape, output_shape=out_shape, note=note)
    rank = w.ndim - 2
    kernel = tuple(int(k) for k in w.shape[2:])
    groups = int(get_attr(node, "group", 1))
    stride = tuple(get_attr(node, "strides", [1] * rank))
    dilation = tuple(get_attr(node, "dilations", [1] * rank))
    pads = tuple(get_attr(node, "pads", [0] * 2 * rank))
    if op == "ConvTranspose":
        n_in, n_out = int(w.shape[0]), int(w.shape[1]) * groups
        flops, note = conv_transpose_flops(n_in, n_out // groups, kernel, in_shape)
    else:
        n_in, n_out = int(w.shape[1]) * groups, int(w.shape[0])
        out_shape = out_shape or _conv_shape(node, in_shape, n_out, kernel, stride, dilation, pads)
        flops, note = conv_flops(n_out, n_in // groups, kernel, out_shape)
    return dict(weight_layout="iohw" if op == "ConvTranspose" else "oihw", n_in=n_in,
                n_out=n_out, kernel=kernel, stride=stride, dilation=dilation, pads=pads,
                groups=groups, depthwise=groups > 1 and groups == n_in, flops=flops,
                input_shape=in_shape, output_shape=out_shape, note=note)


def _conv_shape(node, in_shape, n_out, kernel, stride, dilation, pads) -> tuple | None:
    """Conv output shape from the formula, when shape inference left it unknown."""
    if in_shape is None or get_attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    spatial = conv_output_spatial(tuple(in_shape[2:]), kernel, stride, dilation, pads)
    return None if spatial is None else (in_shape[0], n_out, *spatial)


def _bias(index: GraphIndex, node: onnx.NodeProto, n_out: int) -> tuple:
    """``(bias, bias_node, post, notes)``: the bias tensor and the tensor after adding it."""
    out = node.output[0]
    if node.op_type in ("Conv", "ConvTranspose", "Gemm") and len(node.input) > 2 \
            and node.input[2]:
        return node.input[2], None, out, []
    add = index.sole_consumer(out)
    if add is None or add.op_type != "Add":
        return None, None, out, []
    other = add.input[1] if add.input[0] == out else add.input[0]
    value = index.get_constant(other)
    if value is None or value.size != n_out or max(value.shape, default=0) != n_out:
        return None, None, out, []
    if node.op_type.startswith("Conv"):  # per-channel means (C, 1, 1) or (1, C, 1, 1)
        rank = index.rank(out) or 2 + len(node_kernel(index, node))
        if value.ndim < rank - 1 or value.shape[value.ndim - rank + 1] != n_out:
            return None, None, out, []
    elif value.shape[-1] != n_out:
        return None, None, out, []
    return other, add.name, add.output[0], [f"bias added by a separate Add node {add.name!r}"]


def node_kernel(index: GraphIndex, node: onnx.NodeProto) -> tuple[int, ...]:
    """Kernel size of a Conv / ConvTranspose from its weight (empty when not constant)."""
    w = index.get_constant(node.input[1])
    return () if w is None else tuple(int(k) for k in w.shape[2:])


def _batchnorm(index: GraphIndex, tensor: str) -> tuple:
    """BN reading ``tensor`` directly: ``(bn_node, "after", bn output, note)``."""
    users = index.consumers_of(tensor)
    bns = [n for n, i in users if n.op_type == "BatchNormalization" and i == 0]
    if len(bns) != 1:
        return None, None, tensor, ""
    note = "" if len(users) == 1 else "the pre-BN output is also read by other nodes"
    return bns[0].name, "after", bns[0].output[0], note


def _bn_before_next(index: GraphIndex, tensor: str) -> tuple:
    """Pre-activation style: a single BN reached through activations / pooling only."""
    frontier, found, seen = [tensor], [], set()
    while frontier:
        t = frontier.pop()
        for user, i in index.consumers_of(t):
            if user.name in seen or i != 0:
                continue
            seen.add(user.name)
            if user.op_type == "BatchNormalization":
                found.append(user)
            elif user.op_type in BN_LOOKAHEAD:
                frontier.append(user.output[0])
    if len(found) != 1:
        return None, None, ""
    return found[0].name, "before_next", "BN sits before the next layer (pre-activation style)"


def _clip_range(index: GraphIndex, node_name: str | None) -> tuple | None:
    node = index.node_by_name.get(node_name or "")
    if node is None:
        return None
    if len(node.input) > 1:
        lo, hi = (index.get_constant(t) if t else None for t in (list(node.input) + [""])[1:3])
        if lo is None or hi is None:
            return None
        return float(lo), float(hi)
    return float(get_attr(node, "min", -math.inf)), float(get_attr(node, "max", math.inf))


def _prunable(index: GraphIndex, node: onnx.NodeProto, w: np.ndarray) -> tuple[bool, str]:
    if node.op_type == "ConvTranspose":
        return False, "ConvTranspose: reported, not supported for pruning"
    if node.op_type == "Gemm" and get_attr(node, "transA", 0):
        return False, "Gemm with transA=1: not supported for pruning"
    if index.source_initializer(node.input[1]) is None:
        producer = index.producer.get(node.input[1])
        how = f"{producer.op_type} node {producer.name!r}" if producer is not None else "a node"
        return False, f"weight is computed (by {how}): not supported for pruning"
    return True, ""
