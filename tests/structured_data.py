"""Models and data files of the structured-pruning tests.

:func:`write_tiny`: corpus.residual_block with learnable labelled data.
:func:`named_head_model`: a classifier whose head must be named with --head and --features
(Paddle-style export):

c0 (3→8, 3×3) → bn → Relu → c1 (8→16, 3×3) → bn → Relu → GlobalAveragePool → Squeeze
"feat" whose axes are computed at run time ([2, 3] + 0 from the data), so the rank of
"feat" is unknown to shape inference → MatMul "head" → Add "head_bias" → "logits".
Automatic discovery stops at the Add (its MatMul input is not known to be (n_samples,
n_features)); ``--head head`` alone is refused ("name the features tensor with
--features"); with ``--features feat`` the head is found.  Channel groups: {c0}
prunable, {c1} not (the ReduceMin of the axes computation reads every channel), {head}.
"""

from __future__ import annotations

import corpus
import numpy as np
import onnx
from corpus import N_CLASSES
from onnx import TensorProto, helper, numpy_helper

from onnxdiag.model.io import save_model


def write_tiny(folder):
    """(model path, data path): residual_block saved to disk with learnable labelled data
    (labels = argmax of a fixed projection of the channel means), 160 samples."""
    path = save_model(corpus.residual_block(), folder / "model.onnx")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((160, 3, 8, 8)).astype(np.float32)
    x += rng.standard_normal((160, 3, 1, 1)).astype(np.float32)
    labels = (x.mean(axis=(2, 3)) @ rng.standard_normal((3, corpus.N_CLASSES))).argmax(1)
    np.savez(folder / "data.npz", x=x, labels=labels)
    return path, folder / "data.npz"


def write_named(folder):
    """(model path, data path): named_head_model with 96 random labelled samples."""
    path = save_model(named_head_model(), folder / "model.onnx")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((96, 3, 8, 8)).astype(np.float32)
    np.savez(folder / "data.npz", x=x, labels=rng.integers(0, N_CLASSES, 96))
    return path, folder / "data.npz"


def named_head_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, inputs, name, out=None, **attrs):
        nodes.append(helper.make_node(op, inputs, [out or name], name=name, **attrs))
        return out or name

    def conv_bn_relu(x, name, c_in, c_out):
        w = const(f"{name}.weight", rng.normal(0, 1 / np.sqrt(9 * c_in),
                                               (c_out, c_in, 3, 3)).astype(np.float32))
        y = node("Conv", [x, w], name, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        bn = [const(f"{name}_bn.{k}", v.astype(np.float32)) for k, v in (
            ("scale", rng.uniform(0.5, 1.5, c_out)), ("bias", rng.normal(0, 0.1, c_out)),
            ("mean", rng.normal(0, 0.1, c_out)), ("var", rng.uniform(0.5, 1.5, c_out)))]
        return node("Relu", [node("BatchNormalization", [y, *bn], f"{name}_bn")],
                    f"{name}_relu")

    gap = node("GlobalAveragePool", [conv_bn_relu(conv_bn_relu("x", "c0", 3, 8), "c1", 8, 16)],
               "pool")
    zero = node("Mul", [gap, const("zero_f", np.float32(0))], "zero_mul")
    zero = node("Cast", [node("ReduceMin", [zero], "zero_min", keepdims=0)], "zero_int",
                to=TensorProto.INT64)
    axes = node("Add", [const("axes23", np.array([2, 3], np.int64)), zero], "axes")
    feat = node("Squeeze", [gap, axes], "feat")
    w = const("head.weight", rng.normal(0, 0.25, (16, N_CLASSES)).astype(np.float32))
    u = node("MatMul", [feat, w], "head")
    b = const("head.bias", rng.normal(0, 0.1, N_CLASSES).astype(np.float32))
    node("Add", [u, b], "head_bias", "logits")
    graph = helper.make_graph(
        nodes, "named_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", N_CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="onnxdiag-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
