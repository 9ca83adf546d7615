"""model.edit.ModelEditor and model.finalize: copy-on-write edits on real ONNX Runtime runs.

The editor never touches its input (hashes before and after), its copy-on-write keeps
every node that did not ask for an edit reading the same values, rewiring / inserting /
removing nodes round-trips to the same outputs, and ``finish()`` runs the full checker:
an invalid edit is an EditError (a bug), never an OnnxDiagError.
"""

from __future__ import annotations

import corpus
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiag.errors import OnnxDiagError
from onnxdiag.model.edit import ModelEditor, count_uses
from onnxdiag.model.finalize import EditError, finalize_model
from onnxdiag.model.io import load_model, model_hash


def _shared_weight_model() -> onnx.ModelProto:
    """conv_a and conv_b read the same weight and bias; their sum feeds a Gemm head."""
    g = corpus._G(0)
    w, b = g.rand("w", 4, 3, 3, 3), g.rand("b", 4, scale=0.1)
    a = g.node("Conv", ["x", w, b], "conv_a", kernel_shape=[3, 3], pads=[1] * 4)
    c = g.node("Conv", ["x", w, b], "conv_b", kernel_shape=[3, 3], pads=[1] * 4)
    s = g.node("Relu", [g.node("Add", [a, c], "sum")], "relu")
    g.gemm(g.pool_flatten(s), "head", 4, corpus.N_CLASSES, out="logits")
    return load_model(g.model([corpus._image()], [corpus._logits()]))


def _inits(model) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _nodes(model) -> dict[str, onnx.NodeProto]:
    return {n.name: n for n in model.graph.node}


def _same_outputs(a, b, tensors=()):
    feeds = corpus.random_feeds(a, batch=3, seed=4)
    want, got = corpus.run_ort(a, feeds, tensors), corpus.run_ort(b, feeds, tensors)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6)


# -- the input is never touched --------------------------------------------------------------
def test_the_editor_never_modifies_its_input():
    model = _shared_weight_model()
    before = model_hash(model), model.SerializeToString()
    ed = ModelEditor(model)
    w = ed.value("w")
    w[:] = 0  # a writable copy: the model does not see it
    ed.set_input("conv_a", 1, w)
    ed.replace_initializer("b", np.ones(4, np.float32))
    ed.set_attribute("conv_b", "dilations", [1, 1])
    ed.set_output("relu", 0, "relu_raw")
    ed.insert_after("relu", [helper.make_node("Identity", ["relu_raw"], ["relu"], name="id")])
    out = ed.finish()
    assert (model_hash(model), model.SerializeToString()) == before
    assert model_hash(out) != before[0]
    np.testing.assert_array_equal(_inits(model)["b"], _inits(_shared_weight_model())["b"])


# -- copy-on-write ---------------------------------------------------------------------------
def test_set_input_copies_a_shared_initializer_and_edits_a_sole_one_in_place():
    model = _shared_weight_model()
    ed = ModelEditor(model)
    assert ed.uses("w") == 2 and ed.uses("head.weight") == 1 and ed.uses("logits") == 1
    new = ed.set_input("conv_a", 1, np.zeros((4, 3, 3, 3), np.float32), stem="w_edited")
    assert new == "w_edited" and ed.uses("w") == 1 and ed.uses(new) == 1
    assert ed.set_input("head", 1, np.zeros((5, 4), np.float32)) == "head.weight"
    out = ed.finish()
    inits, nodes = _inits(out), _nodes(out)
    np.testing.assert_array_equal(inits["w"], _inits(model)["w"])
    assert list(nodes["conv_b"].input) == ["x", "w", "b"]
    assert list(nodes["conv_a"].input) == ["x", "w_edited", "b"]
    assert not inits["w_edited"].any() and not inits["head.weight"].any()
    feeds = corpus.random_feeds(model)
    got, orig = corpus.run_ort(out, feeds, ["conv_a", "conv_b"]), corpus.run_ort(
        model, feeds, ["conv_b"])
    np.testing.assert_array_equal(got["conv_b"], orig["conv_b"])
    np.testing.assert_allclose(got["conv_a"], np.broadcast_to(
        _inits(model)["b"].reshape(1, 4, 1, 1), got["conv_a"].shape), atol=1e-7)


def test_an_in_place_write_keeps_the_index_and_drops_its_cached_constants():
    """A sole initializer overwritten in place: the editor keeps its graph index (no
    rebuild), and the index reads the new value, not its cached old one."""
    model = _shared_weight_model()
    ed = ModelEditor(model)
    index = ed.index
    old = np.array(index.get_constant("head.weight"))
    new = np.full_like(old, 0.5)
    ed.set_input("head", 1, new)
    assert ed.index is index
    np.testing.assert_array_equal(ed.index.get_constant("head.weight"), new)
    ed.replace_initializer("head.weight", 2 * new)
    np.testing.assert_array_equal(ed.index.get_constant("head.weight"), 2 * new)
    np.testing.assert_array_equal(_inits(ed.finish())["head.weight"], 2 * new)


def test_a_constant_node_source_becomes_an_initializer_and_the_node_is_dropped():
    model = load_model(corpus.constant_node_weights())
    ed = ModelEditor(model)
    head = ed.node("head")
    weight = ed.value(head.input[1])
    assert weight is not None and head.input[1] not in ed.index.initializers
    name = ed.set_input("head", 1, 2 * weight)
    out = ed.finish()
    assert name in _inits(out)
    np.testing.assert_array_equal(_inits(out)[name], 2 * weight)
    kinds = [n.op_type for n in out.graph.node]
    assert kinds.count("Constant") == [n.op_type for n in model.graph.node].count("Constant") - 1


def test_a_missing_optional_input_is_added():
    g = corpus._G(1)
    g.gemm(g.pool_flatten(g.conv("x", "conv", 3, 4, bias=False)), "head", 4, 5, out="logits")
    model = load_model(g.model([corpus._image()], [corpus._logits()]))
    ed = ModelEditor(model)
    name = ed.set_input("conv", 2, np.full(4, 0.5, np.float32))
    out = ed.finish()
    assert list(_nodes(out)["conv"].input) == ["x", "conv.weight", name]
    feeds = corpus.random_feeds(model)
    got, orig = corpus.run_ort(out, feeds, ["conv"]), corpus.run_ort(model, feeds, ["conv"])
    np.testing.assert_allclose(got["conv"], orig["conv"] + 0.5, atol=1e-6)


def test_only_what_the_edit_left_unread_is_dropped():
    model = _shared_weight_model()
    model.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "spare"))
    ed = ModelEditor(model)
    zeros = ed.add_initializer("zeros", np.zeros((4, 3, 3, 3), np.float32))
    ed.rewire("conv_a", 1, zeros)
    ed.rewire("conv_b", 1, zeros)
    assert ed.uses("w") == 0 and ed.uses(zeros) == 2
    names = set(_inits(ed.finish()))
    assert "w" not in names and "spare" in names  # "spare" was unread before the edit


def test_unique_names_avoid_every_tensor_and_node_name():
    ed = ModelEditor(_shared_weight_model())
    assert ed.unique("conv_a") == "conv_a_1" and ed.unique("conv_a") == "conv_a_2"
    assert ed.unique("w") == "w_1" and ed.unique("fresh") == "fresh"
    assert ed.add_initializer("b", np.zeros(1, np.float32)) == "b_1"


def test_uses_count_graph_outputs_and_subgraph_reads():
    then = helper.make_graph([helper.make_node("Identity", ["y"], ["t"], name="inner")], "then",
                             [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu"),
         helper.make_node("If", ["c"], ["z"], name="if", then_branch=then, else_branch=then)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    uses = count_uses(graph)
    assert uses["y"] == 3 and uses["x"] == 1 and uses["c"] == 1 and uses["z"] == 1


def test_initializers_listed_as_inputs_keep_their_input_in_step():
    model = onnx.ModelProto()
    model.CopyFrom(corpus.opset9_initializers_as_inputs())  # IR 3: initializers are inputs
    ed = ModelEditor(model)
    w = next(t.name for t in model.graph.initializer if len(t.dims) == 2)
    old = ed.value(w)
    new = ed.add_initializer("extra", np.zeros((2, 2), np.float32))
    ed.replace_initializer(w, old[:, :1].copy())
    inputs = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in ed.model.graph.input}
    assert inputs[new] == [2, 2] and inputs[w] == [old.shape[0], 1]
    assert model_hash(model) == model_hash(corpus.opset9_initializers_as_inputs())


# -- rewiring, inserting, removing -----------------------------------------------------------
def test_insert_then_remove_round_trips():
    model = load_model(corpus.conv_bn_chain())
    ed = ModelEditor(model)
    raw = ed.unique("bn0_raw")
    ed.set_output("bn0", 0, raw)
    scale = ed.add_initializer("scale", np.full((1, 8, 1, 1), 2.0, np.float32))
    ed.insert_after("bn0", [helper.make_node("Mul", [raw, scale], ["bn0"], name="double")])
    doubled = ed.finish()
    assert [n.name for n in doubled.graph.node].index("double") == \
        [n.name for n in doubled.graph.node].index("bn0") + 1
    feeds = corpus.random_feeds(model)
    got, orig = corpus.run_ort(doubled, feeds, ["bn0"]), corpus.run_ort(model, feeds, ["bn0"])
    np.testing.assert_allclose(got["bn0"], 2 * orig["bn0"], rtol=1e-6)
    back = ModelEditor(doubled)
    assert back.replace_uses("bn0", raw) == 1
    back.remove_node("double")
    back.set_output("bn0", 0, "bn0")
    assert back.replace_uses(raw, "bn0") == 1
    again = back.finish()
    assert [n.name for n in again.graph.node] == [n.name for n in model.graph.node]
    assert _inits(again).keys() == _inits(model).keys()  # "scale" was dropped
    _same_outputs(model, again, ["bn0", "conv1"])


def test_rewire_round_trips():
    model = _shared_weight_model()
    ed = ModelEditor(model)
    ed.rewire("sum", 1, "conv_a")  # sum = conv_a + conv_a
    twice = ed.finish()
    feeds = corpus.random_feeds(model)
    got, orig = corpus.run_ort(twice, feeds, ["sum"]), corpus.run_ort(model, feeds, ["conv_a"])
    np.testing.assert_allclose(got["sum"], 2 * orig["conv_a"], rtol=1e-6)
    back = ModelEditor(twice)
    back.rewire("sum", 1, "conv_b")
    _same_outputs(model, back.finish(), ["sum"])


# -- finish() checks -------------------------------------------------------------------------
@pytest.mark.parametrize("edit", [
    lambda ed: ed.rewire("sum", 1, "nowhere"),                          # dangling input
    lambda ed: ed.set_input("conv_a", 1, np.zeros((4, 3, 3, 3))),       # float64 weight
    lambda ed: ed.set_input("head", 1, np.zeros((5, 7), np.float32)),   # wrong width
    lambda ed: ed.remove_node("relu"),                                  # output still read
])
def test_finish_runs_the_full_checker(edit):
    ed = ModelEditor(_shared_weight_model())
    edit(ed)
    with pytest.raises(EditError) as info:
        ed.finish()
    assert not isinstance(info.value, OnnxDiagError)


def test_finalize_runs_both_halves_of_the_full_checker():
    # the structural checker alone sees duplicate metadata keys; strict shape inference
    # alone sees a float64 weight beside float32 data (test_finish_runs_the_full_checker)
    model = load_model(corpus.conv_bn_chain())
    model.metadata_props.add(key="k", value="1")
    model.metadata_props.add(key="k", value="2")
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    with pytest.raises(EditError, match="duplicate keys"):
        finalize_model(model)


def test_finish_runs_the_postcondition_and_closes_the_editor():
    ed = ModelEditor(_shared_weight_model())

    def fail(model):
        assert isinstance(model, onnx.ModelProto)
        raise EditError("postcondition")

    with pytest.raises(EditError, match="postcondition"):
        ed.finish(check=fail)
    with pytest.raises(EditError, match="finished"):
        ed.add_initializer("late", np.zeros(1, np.float32))
    ed = ModelEditor(_shared_weight_model())
    ed.finish()
    with pytest.raises(EditError, match="finished"):
        ed.finish()


def test_inserted_nodes_need_new_names():
    ed = ModelEditor(_shared_weight_model())
    with pytest.raises(EditError, match="new name"):
        ed.insert_after("relu", [helper.make_node("Identity", ["relu"], ["r2"], name="sum")])
    with pytest.raises(OnnxDiagError, match="not in the model"):
        ed.node("nope")


def test_finalize_clears_stale_shapes_and_reinfers_them():
    model = load_model(corpus.conv_bn_chain())
    stale = onnx.ModelProto()
    stale.CopyFrom(model)
    stale.graph.value_info.append(helper.make_tensor_value_info("conv0", TensorProto.FLOAT,
                                                                ["N", 99, 8, 8]))
    before = stale.SerializeToString()
    out = finalize_model(stale)
    assert stale.SerializeToString() == before  # a copy: the input keeps its stale entry
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in out.graph.value_info}
    assert shapes["conv0"] == ["N", 8, 8, 8]
