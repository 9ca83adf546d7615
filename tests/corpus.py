"""Tiny classifier models built in code, shared by everyone's tests.

Every builder returns a fresh, checker-valid ``onnx.ModelProto`` (opset 17, IR 8
unless stated) with weights from a seeded generator, so it runs in ONNX Runtime.
Images are (N, 3, 8, 8) float32 and vectors (N, 16) with a symbolic batch "N"
unless stated; node names are given, and a node's output tensor has the node's
name except the graph outputs ("logits", "prob", …).  ``CORPUS`` maps a name to
each builder (called with no arguments).  ``random_feeds`` / ``run_ort`` run a
model with extra tensors exposed, for numerical checks.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IMAGE = ("N", 3, 8, 8)
N_CLASSES = 5


class _G:
    """A small graph builder: nodes named after their output tensor."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def init(self, name: str, value) -> str:
        value = np.asarray(value)
        if value.dtype == np.float64:
            value = value.astype(np.float32)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def rand(self, name: str, *shape, scale: float | None = None) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        scale = scale if scale is not None else 1.0 / np.sqrt(max(fan_in, 1))
        return self.init(name, self.rng.normal(0, scale, shape))

    def node(self, op: str, inputs, name: str, out: str | None = None, **attrs) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [out or name], name=name, **attrs))
        return out or name

    def conv(self, x, name, c_in, c_out, k=3, stride=1, pad=None, group=1, bias=True,
             out=None) -> str:
        pad = k // 2 if pad is None else pad
        ins = [x, self.rand(f"{name}.weight", c_out, c_in // group, k, k)]
        if bias:
            ins.append(self.rand(f"{name}.bias", c_out, scale=0.1))
        return self.node("Conv", ins, name, out, kernel_shape=[k, k], strides=[stride, stride],
                         pads=[pad] * 4, group=group)

    def bn(self, x, name, c, out=None) -> str:
        ins = [x, self.init(f"{name}.scale", self.rng.uniform(0.5, 1.5, c)),
               self.init(f"{name}.bias", self.rng.normal(0, 0.1, c)),
               self.init(f"{name}.mean", self.rng.normal(0, 0.1, c)),
               self.init(f"{name}.var", self.rng.uniform(0.5, 1.5, c))]
        return self.node("BatchNormalization", ins, name, out, epsilon=1e-5)

    def gemm(self, x, name, d, c, trans_b=True, bias=True, out=None) -> str:
        shape = (c, d) if trans_b else (d, c)
        ins = [x, self.rand(f"{name}.weight", *shape, scale=1 / np.sqrt(d))]
        if bias:
            ins.append(self.rand(f"{name}.bias", c, scale=0.1))
        return self.node("Gemm", ins, name, out, transB=int(trans_b))

    def pool_flatten(self, x, name="pool") -> str:
        return self.node("Flatten", [self.node("GlobalAveragePool", [x], name)], "flatten")

    def model(self, inputs, outputs, opset: int = 17, ir: int = 8,
              name: str = "corpus") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  producer_name="onnxdiag-tests")
        model.ir_version = ir
        onnx.checker.check_model(model)
        return model


def _vi(name: str, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, list(shape) if shape is not None else None)


def _image(shape=IMAGE):
    return _vi("x", shape)


def _logits(name="logits", c=N_CLASSES):
    return _vi(name, ("N", c))


#: Public names of the builder helpers, for corpus modules beside this one.
GraphBuilder, value_info, image_input, logits_output = _G, _vi, _image, _logits


# -- heads ----------------------------------------------------------------------------------
def gemm_head(trans_b: bool = True, seed: int = 0) -> onnx.ModelProto:
    """x (N,16) → Relu "feat" → Gemm "head" (transB given, alpha=0.5, beta=2) → logits."""
    g = _G(seed)
    feat = g.node("Relu", ["x"], "feat")
    w = g.rand("head.weight", *((N_CLASSES, 16) if trans_b else (16, N_CLASSES)))
    g.node("Gemm", [feat, w, g.rand("head.bias", N_CLASSES)], "head", "logits",
           transB=int(trans_b), alpha=0.5, beta=2.0)
    return g.model([_vi("x", ("N", 16))], [_logits()])


def matmul_add_head(bias_first: bool = False, seed: int = 0) -> onnx.ModelProto:
    """x → Relu "feat" → MatMul "head" (W: (16,5)) → Add "head_bias" → logits."""
    g = _G(seed)
    mm = g.node("MatMul", [g.node("Relu", ["x"], "feat"), g.rand("head.weight", 16, N_CLASSES)],
                "head")
    b = g.rand("head.bias", N_CLASSES, scale=0.1)
    g.node("Add", [b, mm] if bias_first else [mm, b], "head_bias", "logits")
    return g.model([_vi("x", ("N", 16))], [_logits()])


def matmul_head_no_bias(seed: int = 0) -> onnx.ModelProto:
    """x → Relu "feat" → MatMul "head" → logits (no bias)."""
    g = _G(seed)
    g.node("MatMul", [g.node("Relu", ["x"], "feat"), g.rand("head.weight", 16, N_CLASSES)],
           "head", "logits")
    return g.model([_vi("x", ("N", 16))], [_logits()])


def conv1x1_before_gap(pool: str = "GlobalAveragePool", seed: int = 0) -> onnx.ModelProto:
    """x → Conv3×3 "conv0" (8) → Relu "relu0" → Conv1×1 "head" (5) → GAP "pool" → Flatten
    → logits (pool="ReduceMean": ReduceMean "pool" over [2, 3], keepdims=0 → logits).
    Z is the spatial mean of relu0."""
    g = _G(seed)
    r = g.node("Relu", [g.conv("x", "conv0", 3, 8)], "relu0")
    head = g.conv(r, "head", 8, N_CLASSES, k=1)
    if pool == "ReduceMean":
        g.node("ReduceMean", [head], "pool", "logits", axes=[2, 3], keepdims=0)
    else:
        g.node("Flatten", [g.node("GlobalAveragePool", [head], "pool")], "flatten", "logits")
    return g.model([_image()], [_logits()])


def conv1x1_after_gap(seed: int = 0) -> onnx.ModelProto:
    """x → conv0 (8) → Relu → GAP "pool" → Conv1×1 "head" → Squeeze(axes [2,3]) → logits."""
    g = _G(seed)
    pooled = g.node("GlobalAveragePool", [g.node("Relu", [g.conv("x", "conv0", 3, 8)],
                                                 "relu0")], "pool")
    head = g.conv(pooled, "head", 8, N_CLASSES, k=1)
    g.node("Squeeze", [head, g.init("sq_axes", np.array([2, 3], np.int64))], "squeeze",
           "logits")
    return g.model([_image()], [_logits()])


def mlp_head(seed: int = 0) -> onnx.ModelProto:
    """x (N,16) → Gemm "fc1" (32) → Relu "hidden" → Gemm "fc2" (5) → logits."""
    g = _G(seed)
    h = g.node("Relu", [g.gemm("x", "fc1", 16, 32)], "hidden")
    g.gemm(h, "fc2", 32, N_CLASSES, out="logits")
    return g.model([_vi("x", ("N", 16))], [_logits()])


def softmax_output(log: bool = False, seed: int = 0) -> onnx.ModelProto:
    """x → Relu "feat" → Gemm "head" → (Log)Softmax "softmax" → prob."""
    g = _G(seed)
    u = g.gemm(g.node("Relu", ["x"], "feat"), "head", 16, N_CLASSES)
    g.node("LogSoftmax" if log else "Softmax", [u], "softmax", "prob", axis=1)
    return g.model([_vi("x", ("N", 16))], [_logits("prob")])


def primitive_softmax(with_max: bool = True, seed: int = 0) -> onnx.ModelProto:
    """Gemm "head" → [ReduceMax, Sub] → Exp → ReduceSum → Div → prob (converter style)."""
    g = _G(seed)
    u = g.gemm(g.node("Relu", ["x"], "feat"), "head", 16, N_CLASSES)
    axes = g.init("axes", np.array([1], np.int64))
    if with_max:
        peak = g.node("ReduceMax", [u], "rmax", axes=[1], keepdims=1)
        u = g.node("Sub", [u, peak], "shift")
    e = g.node("Exp", [u], "exp")
    g.node("Div", [e, g.node("ReduceSum", [e, axes], "rsum", keepdims=1)], "div", "prob")
    return g.model([_vi("x", ("N", 16))], [_logits("prob")])


def two_outputs(seed: int = 0) -> onnx.ModelProto:
    """skl2onnx style: outputs "label" (ArgMax, int64) first, then "probabilities"."""
    g = _G(seed)
    u = g.gemm(g.node("Relu", ["x"], "feat"), "head", 16, N_CLASSES)
    p = g.node("Softmax", [u], "softmax", "probabilities", axis=1)
    g.node("ArgMax", [p], "argmax", "label", axis=1, keepdims=0)
    return g.model([_vi("x", ("N", 16))],
                   [_vi("label", ("N",), TensorProto.INT64), _logits("probabilities")])


def constant_node_weights(seed: int = 0) -> onnx.ModelProto:
    """Gemm "head" whose W comes from a Constant node (value) and b from value_floats."""
    g = _G(seed)
    w = g.rng.normal(0, 0.25, (N_CLASSES, 16)).astype(np.float32)
    g.nodes.append(helper.make_node("Constant", [], ["W"], name="const_w",
                                    value=numpy_helper.from_array(w, "W")))
    g.nodes.append(helper.make_node("Constant", [], ["B"], name="const_b",
                                    value_floats=g.rng.normal(0, 0.1, N_CLASSES).tolist()))
    g.node("Gemm", [g.node("Relu", ["x"], "feat"), "W", "B"], "head", "logits", transB=1)
    return g.model([_vi("x", ("N", 16))], [_logits()])


def identity_transpose_weights(seed: int = 0) -> onnx.ModelProto:
    """Gemm "head" (transB=1) with W = Identity(Transpose(init (16,5))), b = Identity(init)."""
    g = _G(seed)
    wt = g.node("Transpose", [g.rand("w_t", 16, N_CLASSES)], "w_transpose", perm=[1, 0])
    w = g.node("Identity", [wt], "w_identity")
    b = g.node("Identity", [g.rand("b_src", N_CLASSES, scale=0.1)], "b_identity")
    g.node("Gemm", [g.node("Relu", ["x"], "feat"), w, b], "head", "logits", transB=1)
    return g.model([_vi("x", ("N", 16))], [_logits()])


def constant_of_shape_bias(seed: int = 0) -> onnx.ModelProto:
    """Gemm "head" whose C = ConstantOfShape([5], value 0.5)."""
    g = _G(seed)
    shape = g.init("b_shape", np.array([N_CLASSES], np.int64))
    g.nodes.append(helper.make_node(
        "ConstantOfShape", [shape], ["B"], name="b_fill",
        value=numpy_helper.from_array(np.array([0.5], np.float32), "v")))
    g.node("Gemm", [g.node("Relu", ["x"], "feat"), g.rand("head.weight", N_CLASSES, 16), "B"],
           "head", "logits", transB=1)
    return g.model([_vi("x", ("N", 16))], [_logits()])


def opset9_initializers_as_inputs(seed: int = 0) -> onnx.ModelProto:
    """Opset 9, IR 3: conv0 → BN "bn0" → Relu → GAP → Flatten → Gemm "head" → Softmax
    → prob, with every initializer also listed as a graph input (old exporters)."""
    g = _G(seed)
    r = g.node("Relu", [g.bn(g.conv("x", "conv0", 3, 8, bias=False), "bn0", 8)], "relu0")
    u = g.gemm(g.pool_flatten(r), "head", 8, N_CLASSES)
    g.node("Softmax", [u], "softmax", "prob", axis=1)
    inputs = [_image()] + [_vi(t.name, t.dims, t.data_type) for t in g.inits]
    return g.model(inputs, [_logits("prob")], opset=9, ir=3)


def dynamic_spatial(seed: int = 0) -> onnx.ModelProto:
    """x (N,3,H,W) → conv0 (8) → Relu → GAP → Flatten → Gemm "head": conv FLOPs unknown."""
    g = _G(seed)
    r = g.node("Relu", [g.conv("x", "conv0", 3, 8)], "relu0")
    g.gemm(g.pool_flatten(r), "head", 8, N_CLASSES, out="logits")
    return g.model([_image(("N", 3, "H", "W"))], [_logits()])


def two_inputs(seed: int = 0) -> onnx.ModelProto:
    """Image x → conv0 (8) → Relu → GAP → Flatten, concatenated with "meta" (N,4) → Gemm
    "head" (12 → 5).  Z is the Concat output "features"."""
    g = _G(seed)
    r = g.node("Relu", [g.conv("x", "conv0", 3, 8)], "relu0")
    z = g.node("Concat", [g.pool_flatten(r), "meta"], "concat", "features", axis=1)
    g.gemm(z, "head", 12, N_CLASSES, out="logits")
    return g.model([_image(), _vi("meta", ("N", 4))], [_logits()])


# -- conv bodies ----------------------------------------------------------------------------
def conv_bn_chain(batch="N", seed: int = 0) -> onnx.ModelProto:
    """x → conv0 (3→8, 3×3, no bias) → bn0 → Relu → conv1 (8→16, 3×3, stride 2, no bias)
    → bn1 → Relu → GAP → Flatten → Gemm "head" (16 → 5) → logits."""
    g = _G(seed)
    r0 = g.node("Relu", [g.bn(g.conv("x", "conv0", 3, 8, bias=False), "bn0", 8)], "relu0")
    r1 = g.node("Relu", [g.bn(g.conv(r0, "conv1", 8, 16, stride=2, bias=False), "bn1", 16)],
                "relu1")
    g.gemm(g.pool_flatten(r1), "head", 16, N_CLASSES, out="logits")
    return g.model([_image((batch, 3, 8, 8))], [_logits()])


def relu6_constant_clip(seed: int = 0) -> onnx.ModelProto:
    """conv_bn_chain with ReLU6 as torch exports it: Clip whose min/max are scalar outputs
    of Constant nodes (read by both Clips, i.e. across repair segments)."""
    g = _G(seed)
    lo = g.node("Constant", [], "clip_min",
                value=numpy_helper.from_array(np.array(0.0, np.float32), "clip_min_value"))
    hi = g.node("Constant", [], "clip_max",
                value=numpy_helper.from_array(np.array(6.0, np.float32), "clip_max_value"))
    r0 = g.node("Clip", [g.bn(g.conv("x", "conv0", 3, 8, bias=False), "bn0", 8), lo, hi],
                "relu6_0")
    r1 = g.node("Clip", [g.bn(g.conv(r0, "conv1", 8, 16, stride=2, bias=False), "bn1", 16),
                         lo, hi], "relu6_1")
    g.gemm(g.pool_flatten(r1), "head", 16, N_CLASSES, out="logits")
    return g.model([_image(("N", 3, 8, 8))], [_logits()])


def conv_on_1x1_spatial(seed: int = 0) -> onnx.ModelProto:
    """A 3×3 conv (pad 1) whose input is 1×1 spatial, as in VGG's last stage:
    x (N,3,2,2) → conv0 3×3 stride 2 → bn0 → Relu (N,8,1,1) → conv1 3×3 pad 1 → bn1 → Relu
    → GAP → Flatten → Gemm head."""
    g = _G(seed)
    r0 = g.node("Relu", [g.bn(g.conv("x", "conv0", 3, 8, stride=2, bias=False), "bn0", 8)],
                "relu0")
    r1 = g.node("Relu", [g.bn(g.conv(r0, "conv1", 8, 16, bias=False), "bn1", 16)], "relu1")
    g.gemm(g.pool_flatten(r1), "head", 16, N_CLASSES, out="logits")
    return g.model([_image(("N", 3, 2, 2))], [_logits()])


def conv_geometry_head(seed: int = 0) -> onnx.ModelProto:
    """x (N, 4, 9, 11) → "dil" (4→6, 3×3, dilation 2, strides (2, 1), pads (1, 2, 0, 1),
    bias) → Relu → "grp" (6→6, group 2, SAME_UPPER, stride 2, bias) → Relu → "pw" (1×1,
    6→8, no bias) → Add "pw_bias" (a separate bias, after the layer's output) → Relu →
    GAP → Flatten → Gemm "head": conv geometry with known shapes and a head."""
    g = _G(seed)
    d = g.node("Conv", ["x", g.rand("dil.weight", 6, 4, 3, 3), g.rand("dil.bias", 6, scale=0.1)],
               "dil", dilations=[2, 2], strides=[2, 1], pads=[1, 2, 0, 1])
    r = g.node("Relu", [d], "relu_dil")
    q = g.node("Conv", [r, g.rand("grp.weight", 6, 3, 3, 3), g.rand("grp.bias", 6, scale=0.1)],
               "grp", strides=[2, 2], auto_pad="SAME_UPPER", group=2)
    p = g.node("Conv", [g.node("Relu", [q], "relu_grp"), g.rand("pw.weight", 8, 6, 1, 1)], "pw")
    a = g.node("Relu", [g.node("Add", [p, g.rand("pw.bias_add", 8, 1, 1, scale=0.1)],
                                "pw_bias")], "relu_pw")
    g.gemm(g.pool_flatten(a), "head", 8, N_CLASSES, out="logits")
    return g.model([_vi("x", ("N", 4, 9, 11))], [_logits()])


def conv1d_head(seed: int = 0) -> onnx.ModelProto:
    """x (N, 4, 12) → 1-D conv "c1d" (4→5, k 3, stride 2, pads (1, 0), bias) → Relu → GAP →
    Flatten → Gemm "head"."""
    g = _G(seed)
    c = g.node("Conv", ["x", g.rand("c1d.weight", 5, 4, 3), g.rand("c1d.bias", 5, scale=0.1)],
               "c1d", strides=[2], pads=[1, 0])
    g.gemm(g.pool_flatten(g.node("Relu", [c], "relu")), "head", 5, N_CLASSES, out="logits")
    return g.model([_vi("x", ("N", 4, 12))], [_logits()])


def conv_bn_folded(seed: int = 0) -> onnx.ModelProto:
    """conv_bn_chain as exported in eval mode: BN folded into biased convs (no BN nodes);
    conv1's activation is Clip(0, 6) (ReLU6)."""
    g = _G(seed)
    r0 = g.node("Relu", [g.conv("x", "conv0", 3, 8)], "relu0")
    lo, hi = g.init("clip_min", np.array(0, np.float32)), g.init("clip_max",
                                                                  np.array(6, np.float32))
    r1 = g.node("Clip", [g.conv(r0, "conv1", 8, 16, stride=2), lo, hi], "relu1")
    g.gemm(g.pool_flatten(r1), "head", 16, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])


def conv_bias_add(seed: int = 0) -> onnx.ModelProto:
    """Bias-less conv0 (8) followed by Add "conv0_bias" of an (8,1,1) constant → SiLU
    (x·Sigmoid(x)) → GAP → Flatten → Gemm "head"."""
    g = _G(seed)
    c0 = g.conv("x", "conv0", 3, 8, bias=False)
    a = g.node("Add", [c0, g.rand("conv0.bias_add", 8, 1, 1, scale=0.1)], "conv0_bias")
    s = g.node("Mul", [a, g.node("Sigmoid", [a], "sigmoid0")], "silu0")
    g.gemm(g.pool_flatten(s), "head", 8, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])


def preact_bn(seed: int = 0) -> onnx.ModelProto:
    """conv0 (8) → Relu → MaxPool "pool0" → bn0 → conv1 (16) → bn1 → LeakyRelu → GAP →
    Flatten → Gemm "head": conv0's BN sits before the next conv ("before_next")."""
    g = _G(seed)
    r0 = g.node("Relu", [g.conv("x", "conv0", 3, 8, bias=False)], "relu0")
    p0 = g.node("MaxPool", [r0], "pool0", kernel_shape=[2, 2], strides=[2, 2])
    c1 = g.conv(g.bn(p0, "bn0", 8), "conv1", 8, 16, bias=False)
    r1 = g.node("LeakyRelu", [g.bn(c1, "bn1", 16)], "relu1", alpha=0.1)
    g.gemm(g.pool_flatten(r1), "head", 16, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])


def residual_block(seed: int = 0) -> onnx.ModelProto:
    """ResNet basic blocks.  stem (8) → bn → Relu = r0;
    identity block: r0 → c1 (8) → bn → Relu → c2 (8) → bn → Add(r0) "add1" → Relu = r1;
    projection block: r1 → c3 (16, s2) → bn → Relu → c4 (16) → bn, r1 → proj (1×1, 16, s2)
    → bn, Add "add2" → Relu → GAP → Flatten → Gemm "head".
    Groups: {stem, c2}, {c1}, {c3}, {c4, proj}, {head}."""
    g = _G(seed)

    def cbr(x, name, c_in, c_out, stride=1, k=3, relu=True):
        y = g.bn(g.conv(x, name, c_in, c_out, k=k, stride=stride, bias=False), f"{name}_bn",
                 c_out)
        return g.node("Relu", [y], f"{name}_relu") if relu else y

    r0 = cbr("x", "stem", 3, 8)
    r1 = g.node("Relu", [g.node("Add", [cbr(cbr(r0, "c1", 8, 8), "c2", 8, 8, relu=False), r0],
                                "add1")], "relu1")
    main = cbr(cbr(r1, "c3", 8, 16, stride=2), "c4", 16, 16, relu=False)
    short = cbr(r1, "proj", 8, 16, stride=2, k=1, relu=False)
    r2 = g.node("Relu", [g.node("Add", [main, short], "add2")], "relu2")
    g.gemm(g.pool_flatten(r2), "head", 16, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])


def concat_block(seed: int = 0) -> onnx.ModelProto:
    """a = Relu(c0(x)) (4), b = Relu(c1(a)) (6), Concat(a, b) "cat" (10) → c2 (1×1, 8) →
    Relu → GAP → Flatten → Gemm "head".  c2 reads c0's channels at offset 0, c1's at 4."""
    g = _G(seed)
    a = g.node("Relu", [g.conv("x", "c0", 3, 4)], "relu_a")
    b = g.node("Relu", [g.conv(a, "c1", 4, 6)], "relu_b")
    cat = g.node("Concat", [a, b], "cat", axis=1)
    r = g.node("Relu", [g.conv(cat, "c2", 10, 8, k=1)], "relu2")
    g.gemm(g.pool_flatten(r), "head", 8, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])


def depthwise_pointwise(seed: int = 0) -> onnx.ModelProto:
    """MobileNet block: c0 (8) → bn → Relu → dw (3×3, group 8) → bn → Clip(0,6) → pw (1×1,
    16) → bn → Relu → GAP → Flatten → Gemm "head".  Groups: {c0, dw}, {pw}, {head}."""
    g = _G(seed)
    r0 = g.node("Relu", [g.bn(g.conv("x", "c0", 3, 8, bias=False), "c0_bn", 8)], "relu0")
    dw = g.bn(g.conv(r0, "dw", 8, 8, group=8, bias=False), "dw_bn", 8)
    r1 = g.node("Clip", [dw, g.init("lo", np.array(0, np.float32)),
                         g.init("hi", np.array(6, np.float32))], "relu6")
    r2 = g.node("Relu", [g.bn(g.conv(r1, "pw", 8, 16, k=1, bias=False), "pw_bn", 16)],
                "relu2")
    g.gemm(g.pool_flatten(r2), "head", 16, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])


def conv_flatten_gemm(seed: int = 0) -> onnx.ModelProto:
    """x → c0 (3→4, 3×3, stride 2, pad 1: 4×4×4) → Relu → Flatten (64) → Gemm "head":
    channel c of c0 is features 16c … 16c+15 of the head."""
    g = _G(seed)
    r = g.node("Relu", [g.conv("x", "c0", 3, 4, stride=2)], "relu0")
    g.gemm(g.node("Flatten", [r], "flatten", axis=1), "head", 64, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])


def no_linear_head(kind: str = "resize", seed: int = 0) -> onnx.ModelProto:
    """No classifier head: conv0 → Resize "resize" → out (kind="resize"), or a Gemm whose
    output is squared by Mul "square" (kind="elementwise")."""
    g = _G(seed)
    if kind == "resize":
        c = g.conv("x", "conv0", 3, 4)
        scales = g.init("scales", np.array([1, 1, 2, 2], np.float32))
        g.node("Resize", [c, "", scales], "resize", "out", mode="nearest")
        return g.model([_image()], [_vi("out", ("N", 4, 16, 16))])
    u = g.gemm(g.node("Relu", ["x"], "feat"), "fc", 16, N_CLASSES)
    g.node("Mul", [u, u], "square", "out")
    return g.model([_vi("x", ("N", 16))], [_vi("out", ("N", N_CLASSES))])


def se_block(seed: int = 0) -> onnx.ModelProto:
    """Squeeze-and-excitation: r = Relu(c0(x)) (8); s = Sigmoid(se_expand(Relu(se_reduce(
    GAP(r))))) with 1×1 convs 8→2→8; Mul "gate"(r, s) → GAP → Flatten → Gemm "head".
    Groups: {c0, se_expand} (mul), {se_reduce}, {head}."""
    g = _G(seed)
    r = g.node("Relu", [g.conv("x", "c0", 3, 8)], "relu0")
    sq = g.node("GlobalAveragePool", [r], "se_pool")
    e = g.node("Relu", [g.conv(sq, "se_reduce", 8, 2, k=1)], "se_relu")
    s = g.node("Sigmoid", [g.conv(e, "se_expand", 2, 8, k=1)], "se_sigmoid")
    gated = g.node("Mul", [r, s], "gate")
    g.gemm(g.pool_flatten(gated), "head", 8, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])


def conv_transpose(seed: int = 0) -> onnx.ModelProto:
    """c0 (8, stride 2) → Relu → ConvTranspose "up" (8→4, 2×2, stride 2) → Relu → GAP →
    Flatten → Gemm "head"."""
    g = _G(seed)
    r = g.node("Relu", [g.conv("x", "c0", 3, 8, stride=2)], "relu0")
    up = g.node("ConvTranspose", [r, g.rand("up.weight", 8, 4, 2, 2), g.rand("up.bias", 4)],
                "up", kernel_shape=[2, 2], strides=[2, 2])
    g.gemm(g.pool_flatten(g.node("Relu", [up], "relu1")), "head", 4, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])


def channel_shuffle(seed: int = 0) -> onnx.ModelProto:
    """ShuffleNet's shuffle: c0 (8) → Reshape (N,2,4,8,8) → Transpose → Reshape (N,8,8,8) →
    c1 (8) → GAP → Flatten → Gemm "head".  c0's channels are mixed: not prunable."""
    g = _G(seed)
    c0 = g.conv("x", "c0", 3, 8)
    a = g.node("Reshape", [c0, g.init("shape_a", np.array([0, 2, 4, 8, 8], np.int64))], "split")
    b = g.node("Transpose", [a], "shuffle", perm=[0, 2, 1, 3, 4])
    c = g.node("Reshape", [b, g.init("shape_b", np.array([0, 8, 8, 8], np.int64))], "merge")
    g.gemm(g.pool_flatten(g.conv(c, "c1", 8, 8)), "head", 8, N_CLASSES, out="logits")
    return g.model([_image()], [_logits()])



CORPUS = {
    "gemm_head": gemm_head,
    "gemm_head_transb0": lambda: gemm_head(trans_b=False),
    "matmul_add_head": matmul_add_head,
    "matmul_add_head_bias_first": lambda: matmul_add_head(bias_first=True),
    "matmul_head_no_bias": matmul_head_no_bias,
    "conv1x1_before_gap": conv1x1_before_gap,
    "conv1x1_before_reducemean": lambda: conv1x1_before_gap(pool="ReduceMean"),
    "conv1x1_after_gap": conv1x1_after_gap,
    "mlp_head": mlp_head,
    "softmax_output": softmax_output,
    "log_softmax_output": lambda: softmax_output(log=True),
    "primitive_softmax": primitive_softmax,
    "primitive_softmax_no_max": lambda: primitive_softmax(with_max=False),
    "two_outputs": two_outputs,
    "constant_node_weights": constant_node_weights,
    "identity_transpose_weights": identity_transpose_weights,
    "constant_of_shape_bias": constant_of_shape_bias,
    "opset9_initializers_as_inputs": opset9_initializers_as_inputs,
    "dynamic_spatial": dynamic_spatial,
    "two_inputs": two_inputs,
    "conv_bn_chain": conv_bn_chain,
    "conv_bn_chain_batch2": lambda: conv_bn_chain(batch=2),
    "conv_bn_folded": conv_bn_folded,
    "conv_bias_add": conv_bias_add,
    "preact_bn": preact_bn,
    "residual_block": residual_block,
    "concat_block": concat_block,
    "depthwise_pointwise": depthwise_pointwise,
    "conv_flatten_gemm": conv_flatten_gemm,
    "se_block": se_block,
    "conv_transpose": conv_transpose,
    "channel_shuffle": channel_shuffle,
}
#: Models without a linear head (find_head must raise HeadNotFoundError).
NO_HEAD = {
    "no_linear_head_resize": no_linear_head,
    "no_linear_head_elementwise": lambda: no_linear_head(kind="elementwise"),
}


# -- running --------------------------------------------------------------------------------
def random_feeds(model: onnx.ModelProto, batch: int = 4, seed: int = 0,
                 size: int = 8) -> dict[str, np.ndarray]:
    """Standard-normal float32 feeds for every graph input; dynamic dims → ``batch``
    (first) or ``size`` (others)."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else (batch if i == 0 else size)
                for i, d in enumerate(vi.type.tensor_type.shape.dim)]
        feeds[vi.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def run_ort(model: onnx.ModelProto, feeds: dict, outputs=()) -> dict[str, np.ndarray]:
    """Run ``model`` in ONNX Runtime (CPU) with ``outputs`` exposed as extra graph outputs;
    returns every output by name.  ``model`` is not modified."""
    import onnxruntime as ort

    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.input)}
    copy = onnx.ModelProto()
    copy.CopyFrom(inferred)
    present = {o.name for o in copy.graph.output}
    for name in outputs:
        if name not in present:
            copy.graph.output.append(known.get(name) or helper.make_empty_tensor_value_info(name))
            present.add(name)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(copy.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))
