"""Head cases real exporters write, built in code (docs/METHODS.md §A1, §D).

Kept out of ``corpus.CORPUS``: not every builder here is found without data, and some
must be refused.  ``HEAD_CASES`` maps a name to (builder, head node, relation, features,
features_reduce, logits) as verification on data must find them; ``REFUSED_HEADS`` are
graphs shaped like a head that verification must refuse.  ``head_feeds`` makes a batch
(int64 attention masks included).
"""

from __future__ import annotations

import numpy as np
import onnx
from corpus import N_CLASSES, random_feeds
from corpus import GraphBuilder as _G
from corpus import image_input as _image
from corpus import logits_output as _logits
from corpus import value_info as _vi
from onnx import TensorProto, helper, numpy_helper


def _const(g: _G, name: str, value) -> str:
    """A Constant node ``name`` holding ``value`` (float32 unless integer)."""
    value = np.asarray(value)
    value = value.astype(np.float32) if value.dtype == np.float64 else value
    g.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                    value=numpy_helper.from_array(value, name)))
    return name


def _vector_head(g: _G, d: int = 16) -> str:
    """x (N, d) → Relu "feat" → MatMul "head" (W init) → Add "head_bias" → "u"."""
    mm = g.node("MatMul", [g.node("Relu", ["x"], "feat"), g.rand("head.weight", d, N_CLASSES)],
                "head")
    return g.node("Add", [mm, g.rand("head.bias", N_CLASSES, scale=0.5)], "head_bias", "u")


def paddle_constant_head(seed: int = 0) -> onnx.ModelProto:
    """Paddle style: conv0 → Relu → GAP → Squeeze (no axes: shape inference loses the rank)
    → MatMul "head" (W in Constant "const_w") → Add "head_bias" (b in Constant "const_b")."""
    g = _G(seed)
    r = g.node("Relu", [g.conv("x", "conv0", 3, 8)], "relu0")
    sq = g.node("Squeeze", [g.node("GlobalAveragePool", [r], "pool")], "squeeze")
    w = _const(g, "const_w", g.rng.normal(0, 0.4, (8, N_CLASSES)))
    b = _const(g, "const_b", g.rng.normal(0, 0.1, N_CLASSES))
    g.node("Add", [g.node("MatMul", [sq, w], "head"), b], "head_bias", "logits")
    return g.model([_image()], [_logits()])


def jax_softmax(seed: int = 0) -> onnx.ModelProto:
    """jax2tf style softmax written out: ReduceMax → Max(−inf) → Reshape → Expand → Sub →
    Exp → ReduceSum → Reshape → Expand → Div, after MatMul "head" + Add "head_bias"."""
    g = _G(seed)
    u = _vector_head(g)
    shape = g.node("Shape", [u], "u_shape")
    col = g.init("col", np.array([-1, 1], np.int64))
    axes = g.init("axes", np.array([1], np.int64))
    peak = g.node("ReduceMax", [u], "rmax", axes=[1], keepdims=0)
    peak = g.node("Max", [peak, _const(g, "neg_inf", np.array(-np.inf, np.float32))], "max")
    peak = g.node("Expand", [g.node("Reshape", [peak, col], "max_col"), shape], "max_full")
    e = g.node("Exp", [g.node("Sub", [u, peak], "shift")], "exp")
    total = g.node("ReduceSum", [e, axes], "rsum", keepdims=0)
    total = g.node("Expand", [g.node("Reshape", [total, col], "sum_col"), shape], "sum_full")
    g.node("Div", [e, total], "div", "prob")
    return g.model([_vi("x", ("N", 16))], [_logits("prob")])


def reciprocal_softmax(seed: int = 0) -> onnx.ModelProto:
    """Softmax as Exp(u) · Unsqueeze(Reciprocal(ReduceSum(Exp(u)))) (keepdims 0, the
    reciprocal first in the Mul)."""
    g = _G(seed)
    e = g.node("Exp", [_vector_head(g)], "exp")
    axes = g.init("axes", np.array([1], np.int64))
    total = g.node("ReduceSum", [e, axes], "rsum", keepdims=0)
    recip = g.node("Unsqueeze", [g.node("Reciprocal", [total], "recip"), axes], "recip_col")
    g.node("Mul", [recip, e], "mul", "prob")
    return g.model([_vi("x", ("N", 16))], [_logits("prob")])


def softmax_over_batch(seed: int = 0) -> onnx.ModelProto:
    """Exp(u) / ReduceSum(Exp(u)) over axis 0 (the samples): no softmax (must be refused)."""
    g = _G(seed)
    e = g.node("Exp", [_vector_head(g)], "exp")
    total = g.node("ReduceSum", [e, g.init("axes", np.array([0], np.int64))], "rsum",
                   keepdims=1)
    g.node("Div", [e, total], "div", "prob")
    return g.model([_vi("x", ("N", 16))], [_logits("prob")])


def fake_softmax(seed: int = 0) -> onnx.ModelProto:
    """Exp(u) / ReduceSum(|u|): shaped like a softmax, numerically none (must be refused)."""
    g = _G(seed)
    u = _vector_head(g)
    total = g.node("ReduceSum", [g.node("Abs", [u], "abs"),
                                 g.init("axes", np.array([1], np.int64))], "rsum", keepdims=1)
    g.node("Div", [g.node("Exp", [u], "exp"), total], "div", "prob")
    return g.model([_vi("x", ("N", 16))], [_logits("prob")])


def sigmoid_output(seed: int = 0) -> onnx.ModelProto:
    """Multi-label style: Gemm "head" → Sigmoid "sigmoid" → prob."""
    g = _G(seed)
    u = g.gemm(g.node("Relu", ["x"], "feat"), "head", 16, N_CLASSES)
    g.node("Sigmoid", [u], "sigmoid", "prob")
    return g.model([_vi("x", ("N", 16))], [_logits("prob")])


def scaled_identity(seed: int = 0) -> onnx.ModelProto:
    """Ops no pattern lists between head and output that leave the logits as they are:
    Gemm "head" → Mul by a Constant 1.0 → Transpose → Transpose → logits."""
    g = _G(seed)
    u = g.gemm(g.node("Relu", ["x"], "feat"), "head", 16, N_CLASSES)
    u = g.node("Mul", [u, _const(g, "one", np.array(1.0, np.float32))], "scale")
    u = g.node("Transpose", [g.node("Transpose", [u], "t0", perm=[1, 0])], "t1", "logits",
               perm=[1, 0])
    return g.model([_vi("x", ("N", 16))], [_logits()])


def label_only_output(seed: int = 0) -> onnx.ModelProto:
    """Only a label output: Gemm "head" → ArgMax "argmax" → label (N,) int64."""
    g = _G(seed)
    u = g.gemm(g.node("Relu", ["x"], "feat"), "head", 16, N_CLASSES)
    g.node("ArgMax", [u], "argmax", "label", axis=1, keepdims=0)
    return g.model([_vi("x", ("N", 16))], [_vi("label", ("N",), TensorProto.INT64)])


TOKENS = 6


def decoder_gather_head(seed: int = 0) -> onnx.ModelProto:
    """Hugging Face decoder style: x (N, 6, 16) → Relu "feat" → MatMul "head" + Add
    "head_bias" on every token (N, 6, 5) → GatherND (batch_dims 1) of the last token with
    attention_mask (N, 6) int64 == 1 → logits (N, 5)."""
    g = _G(seed)
    mm = g.node("MatMul", [g.node("Relu", ["x"], "feat"), g.rand("head.weight", 16, N_CLASSES)],
                "head")
    u = g.node("Add", [mm, g.rand("head.bias", N_CLASSES, scale=0.5)], "head_bias")
    count = g.node("ReduceSum", ["attention_mask", g.init("axes", np.array([1], np.int64))],
                   "count", keepdims=1)
    last = g.node("Sub", [count, g.init("one_i", np.array(1, np.int64))], "last")
    g.node("GatherND", [u, last], "pick", "logits", batch_dims=1)
    return g.model([_vi("x", ("N", TOKENS, 16)),
                    _vi("attention_mask", ("N", TOKENS), TensorProto.INT64)], [_logits()])


def conv1x1_relu_before_gap(seed: int = 0) -> onnx.ModelProto:
    """conv0 → Relu → Conv1×1 "head" → Relu "head_relu" → GAP "pool" → Flatten → logits:
    the logits are not a linear map of the head's input (must be refused)."""
    g = _G(seed)
    r = g.node("Relu", [g.conv("x", "conv0", 3, 8)], "relu0")
    h = g.node("Relu", [g.conv(r, "head", 8, N_CLASSES, k=1)], "head_relu")
    g.node("Flatten", [g.node("GlobalAveragePool", [h], "pool")], "flatten", "logits")
    return g.model([_image()], [_logits()])


def head_feeds(model: onnx.ModelProto, batch: int = 4, seed: int = 0) -> dict:
    """:func:`random_feeds`, with int64 attention masks (each row 1…T ones, then zeros)."""
    masks = [vi.name for vi in model.graph.input
             if vi.type.tensor_type.elem_type == TensorProto.INT64]
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    keep = [vi for vi in stripped.graph.input if vi.name not in masks]
    del stripped.graph.input[:]
    stripped.graph.input.extend(keep)
    feeds = random_feeds(stripped, batch=batch, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for name in masks:
        lengths = rng.integers(1, TOKENS + 1, batch)
        feeds[name] = (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.int64)
    return feeds


#: Heads found by verification on data: name → (builder, node, relation, features, reduce,
#: logits).
HEAD_CASES = {
    "paddle_constant_head": (paddle_constant_head, "head", "identity", "squeeze", "flatten",
                             "logits"),
    "jax_softmax": (jax_softmax, "head", "softmax", "feat", "flatten", "u"),
    "reciprocal_softmax": (reciprocal_softmax, "head", "softmax", "feat", "flatten", "u"),
    "sigmoid_output": (sigmoid_output, "head", "sigmoid", "feat", "flatten", "head"),
    "scaled_identity": (scaled_identity, "head", "identity", "feat", "flatten", "head"),
    "decoder_gather_head": (decoder_gather_head, "head", "identity", "feat", "token",
                            "logits"),
    "label_only_output": (label_only_output, "head", "argmax", "feat", "flatten", "head"),
}
#: HEAD_CASES that only verification finds (no pattern lists the ops in between).
DATA_ONLY = ("scaled_identity", "label_only_output")
#: Heads that look like one but are not (verification must refuse them).
REFUSED_HEADS = {
    "fake_softmax": fake_softmax,
    "softmax_over_batch": softmax_over_batch,
    "conv1x1_relu_before_gap": conv1x1_relu_before_gap,
}
