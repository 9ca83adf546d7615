"""GraphIndex: producers/consumers, topological order, shapes, constant folding."""

from __future__ import annotations

import corpus
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiag.errors import OnnxDiagError
from onnxdiag.graph import GraphIndex
from onnxdiag.model.io import load_model


def _const_model() -> onnx.ModelProto:
    """Every constant form the index folds, feeding Add nodes so the model stays valid."""
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [
        helper.make_node("Constant", [], ["c_value"], value=numpy_helper.from_array(base, "v")),
        helper.make_node("Constant", [], ["c_float"], value_float=2.5),
        helper.make_node("Constant", [], ["c_floats"], value_floats=[1.0, 2.0]),
        helper.make_node("Constant", [], ["c_int"], value_int=7),
        helper.make_node("Constant", [], ["c_ints"], value_ints=[3, 1]),
        helper.make_node("ConstantOfShape", ["c_ints"], ["filled"],
                         value=numpy_helper.from_array(np.array([0.25], np.float32), "f")),
        helper.make_node("Transpose", ["init"], ["t"], perm=[1, 0]),
        helper.make_node("Identity", ["t"], ["ti"]),
        helper.make_node("Reshape", ["ti", "shape"], ["r"]),
        helper.make_node("Cast", ["r"], ["rc"], to=TensorProto.DOUBLE),
        helper.make_node("Unsqueeze", ["init", "axes0"], ["u"]),
        helper.make_node("Squeeze", ["u", "axes0"], ["s"]),
        helper.make_node("Add", ["x", "s"], ["y"]),
        helper.make_node("Relu", ["y"], ["z"]),
    ]
    inits = [numpy_helper.from_array(base, "init"),
             numpy_helper.from_array(np.array([0, -1], np.int64), "shape"),
             numpy_helper.from_array(np.array([0], np.int64), "axes0")]
    graph = helper.make_graph(nodes, "consts", [helper.make_tensor_value_info("x", 1, [2, 3])],
                              [helper.make_tensor_value_info("z", 1, [2, 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return load_model(model)


def test_constants_fold_every_supported_form():
    index = GraphIndex(_const_model())
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(index.get_constant("c_value"), base)
    assert index.get_constant("c_float") == pytest.approx(2.5)
    np.testing.assert_array_equal(index.get_constant("c_floats"), [1.0, 2.0])
    assert int(index.get_constant("c_int")) == 7
    np.testing.assert_array_equal(index.get_constant("c_ints"), [3, 1])
    np.testing.assert_array_equal(index.get_constant("filled"), np.full((3, 1), 0.25))
    np.testing.assert_array_equal(index.get_constant("t"), base.T)
    np.testing.assert_array_equal(index.get_constant("ti"), base.T)
    np.testing.assert_array_equal(index.get_constant("r"), base.T)
    assert index.get_constant("rc").dtype == np.float64
    assert index.get_constant("u").shape == (1, 2, 3)
    np.testing.assert_array_equal(index.get_constant("s"), base)
    assert index.get_constant("y") is None and index.get_constant("x") is None
    assert index.get_constant("no_such_tensor") is None
    with pytest.raises(ValueError):
        index.get_constant("init")[0, 0] = 1.0  # read-only


def test_producers_consumers_and_topological_order():
    model = corpus.residual_block()
    shuffled = onnx.ModelProto()
    shuffled.CopyFrom(model)
    nodes = list(shuffled.graph.node)[::-1]
    del shuffled.graph.node[:]
    shuffled.graph.node.extend(nodes)
    index = GraphIndex(shuffled)
    pos = {n.name: i for i, n in enumerate(index.nodes)}
    for node in index.nodes:
        for t in node.input:
            if t in index.producer:
                assert pos[index.producer[t].name] < pos[node.name]
    assert index.producer["stem"].name == "stem"
    users = sorted(n.name for n, _ in index.consumers_of("stem_relu"))
    assert users == ["add1", "c1"]
    assert index.sole_consumer("stem") is not None and index.sole_consumer("stem_relu") is None
    assert index.inputs == ["x"] and index.outputs == ["logits"] and index.opset == 17


def test_shapes_types_and_get_node():
    index = GraphIndex(load_model(corpus.conv_bn_chain()))
    assert index.shape("conv1") == ("N", 16, 4, 4)
    assert index.shape("conv0.weight") == (8, 3, 3, 3)
    assert index.rank("flatten") == 2
    assert index.is_float("logits") is True
    assert index.get_node("conv1").op_type == "Conv"
    with pytest.raises(OnnxDiagError, match="not in the model"):
        index.get_node("nope")


def test_opset9_initializer_inputs_are_constants_not_inputs():
    raw = corpus.opset9_initializers_as_inputs()
    for model in (raw, load_model(raw)):
        index = GraphIndex(model)
        assert index.inputs == ["x"]
        assert index.get_constant("head.weight").shape == (5, 8)
