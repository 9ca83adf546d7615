"""METHODS §B5 interventions: equivalence tests on real ONNX Runtime runs of tests/corpus.py models.

References are built independently of onnxdiag.interventions: the ORIGINAL model with a
Mul-by-mask node inserted after the tensor whose channel should be 0.
"""

from __future__ import annotations

import json

import corpus
import exports
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxdiag.channels.interventions import (
    MIN_DAMAGE,
    lesion_channels,
    lesion_study,
    substitute_channel,
    substitute_channels,
)
from onnxdiag.channels.scores import peer_regression, score_layer
from onnxdiag.data.source import open_data
from onnxdiag.errors import OnnxDiagError
from onnxdiag.evaluate import evaluate
from onnxdiag.graph import analyze_structure
from onnxdiag.model import io as model_io


def _load(model):
    return model_io.load_model(model)


def _channel_axis(arr, linear):
    return np.moveaxis(arr, -1 if linear else 1, 0)


def _masked(model, tensor, channels, n, linear):
    """The original model with y ← y · mask inserted after ``tensor`` (mask 0 at channels)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    mask = np.ones(n, np.float32)
    mask[list(channels)] = 0
    shape = (1, n) if linear else (1, n, 1, 1)
    m.graph.initializer.append(numpy_helper.from_array(mask.reshape(shape), "ref_mask"))
    producer = next(i for i, nd in enumerate(m.graph.node) if tensor in nd.output)
    node = m.graph.node[producer]
    node.output[list(node.output).index(tensor)] = "ref_raw"
    m.graph.node.insert(producer + 1, helper.make_node("Mul", ["ref_raw", "ref_mask"], [tensor],
                                                       name="ref_mul"))
    del m.graph.value_info[:]
    return m


# (builder, layer, channels, tensor masked in the reference, tensors whose channels are 0)
CASES = [
    ("conv_bn_chain", "conv0", [3], "bn0", ["conv0", "bn0"]),
    ("conv_bn_chain", "conv1", [0, 5], "bn1", ["conv1", "bn1"]),
    ("conv_bn_folded", "conv0", [2], "conv0", ["conv0"]),
    ("conv_bias_add", "conv0", [1], "conv0_bias", ["conv0", "conv0_bias"]),
    ("preact_bn", "conv0", [4], "conv0", ["conv0", "relu0", "pool0"]),
    ("depthwise_pointwise", "dw", [6], "dw_bn", ["dw", "dw_bn"]),
    ("mlp_head", "fc1", [7, 9], "fc1", ["fc1"]),
    ("matmul_add_head", "head", [2], "logits", ["head", "logits"]),
    ("identity_transpose_weights", "head", [0], "logits", ["logits"]),
]


@pytest.mark.parametrize("builder, name, chans, masked_at, zeroed", CASES)
def test_lesion_equals_masked_reference(builder, name, chans, masked_at, zeroed):
    model = _load(corpus.CORPUS[builder]())
    before = model.SerializeToString()
    layer = analyze_structure(model).get_layer(name)
    linear = layer.op_type in ("Gemm", "MatMul")
    out = lesion_channels(model, layer, chans)
    assert model.SerializeToString() == before  # input never modified
    onnx.checker.check_model(out, full_check=True)
    feeds = corpus.random_feeds(model, batch=3)
    got = corpus.run_ort(out, feeds, zeroed)
    orig = corpus.run_ort(model, feeds, zeroed)
    keep = [c for c in range(layer.n_out) if c not in chans]
    for t in zeroed:
        g, o = _channel_axis(got[t], linear), _channel_axis(orig[t], linear)
        assert np.all(g[chans] == 0), t
        np.testing.assert_allclose(g[keep], o[keep], rtol=0, atol=1e-6)
    ref = corpus.run_ort(_masked(model, masked_at, chans, layer.n_out, linear), feeds)
    final = model.graph.output[0].name
    np.testing.assert_allclose(got[final], ref[final], rtol=0, atol=1e-5)


def test_before_next_bn_untouched():
    """Pre-activation BN: the conv output is zeroed, the BN keeps its shift for the channel."""
    model = _load(corpus.preact_bn())
    layer = analyze_structure(model).get_layer("conv0")
    assert layer.bn_position == "before_next"
    out = lesion_channels(model, layer, [4])
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    for t in model.graph.initializer:
        if t.name.startswith("bn0."):
            np.testing.assert_array_equal(inits[t.name], numpy_helper.to_array(t))
    bn = corpus.run_ort(out, corpus.random_feeds(model), ["bn0"])["bn0"][:, 4]
    g, b, mu, var = (inits[f"bn0.{k}"][4] for k in ("scale", "bias", "mean", "var"))
    np.testing.assert_allclose(bn, b - mu * g / np.sqrt(var + 1e-5), atol=1e-6)


def _shared_weight_model():
    g = corpus._G(0)
    w, b = g.rand("w", 4, 3, 3, 3), g.rand("b", 4, scale=0.1)
    a = g.node("Conv", ["x", w, b], "conv_a", kernel_shape=[3, 3], pads=[1] * 4)
    c = g.node("Conv", ["x", w, b], "conv_b", kernel_shape=[3, 3], pads=[1] * 4)
    s = g.node("Relu", [g.node("Add", [a, c], "sum")], "relu")
    g.gemm(g.pool_flatten(s), "head", 4, corpus.N_CLASSES, out="logits")
    return g.model([corpus._image()], [corpus._logits()])


def test_shared_initializers_are_copied():
    model = _load(_shared_weight_model())
    layer = analyze_structure(model).get_layer("conv_a")
    out = lesion_channels(model, layer, [1])
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    np.testing.assert_array_equal(inits["w"], numpy_helper.to_array(model.graph.initializer[0]))
    nodes = {n.name: n for n in out.graph.node}
    assert list(nodes["conv_b"].input[1:]) == ["w", "b"]
    assert nodes["conv_a"].input[1] not in ("w", "b")
    feeds = corpus.random_feeds(model)
    got = corpus.run_ort(out, feeds, ["conv_a", "conv_b"])
    orig = corpus.run_ort(model, feeds, ["conv_b"])
    assert np.all(got["conv_a"][:, 1] == 0)
    np.testing.assert_array_equal(got["conv_b"], orig["conv_b"])


def test_bad_channel_is_a_user_error():
    model = _load(corpus.conv_bn_chain())
    layer = analyze_structure(model).get_layer("conv0")
    with pytest.raises(OnnxDiagError, match="0..7"):
        lesion_channels(model, layer, [8])


# -- substitution --------------------------------------------------------------------------
def _duplicate(model, weight, bias, src, dst, scale=2.0, offset=0.3):
    """Make channel ``dst`` = scale · channel ``src`` + offset (weights rows, bias)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.name in (weight, bias):
            v = numpy_helper.to_array(t).copy()
            v[dst] = scale * v[src] + (offset if t.name == bias else 0.0)
            t.CopyFrom(numpy_helper.from_array(v, t.name))
    return _load(m)


@pytest.mark.parametrize("builder, name", [("conv_bn_folded", "conv0"), ("mlp_head", "fc1")])
def test_substituting_an_exact_duplicate_recovers_the_output(builder, name):
    model = _duplicate(corpus.CORPUS[builder](), f"{name}.weight", f"{name}.bias", 1, 5)
    before = model.SerializeToString()
    layer = analyze_structure(model).get_layer(name)
    feeds = corpus.random_feeds(model, batch=16)
    orig = corpus.run_ort(model, feeds, [layer.output])
    final = model.graph.output[0].name
    y = _channel_axis(orig[layer.output], layer.op_type == "Gemm").reshape(layer.n_out, -1)
    peers, beta, a = peer_regression(np.cov(y), y.mean(axis=1), 5, k=3, ridge=0.0)
    assert peers[0] == 1
    for args in ((5, [1], [2.0], 0.3), (5, peers, beta, a)):
        out = substitute_channel(model, layer, *args)
        onnx.checker.check_model(out, full_check=True)
        assert len(out.graph.node) == len(model.graph.node) + (1 if "conv" in name else 2)
        got = corpus.run_ort(out, feeds, [layer.output])
        np.testing.assert_allclose(got[final], orig[final], rtol=0, atol=1e-5)
        np.testing.assert_allclose(got[layer.output], orig[layer.output], rtol=0, atol=1e-5)
    lesioned = corpus.run_ort(lesion_channels(model, layer, [5]), feeds)[final]
    assert np.max(np.abs(lesioned - orig[final])) > 1e-3  # the channel matters
    assert model.SerializeToString() == before


def test_substitute_several_channels_with_one_node():
    model = _duplicate(corpus.conv_bn_folded(), "conv0.weight", "conv0.bias", 1, 5)
    model = _duplicate(model, "conv0.weight", "conv0.bias", 2, 6, scale=-0.5, offset=0.1)
    layer = analyze_structure(model).get_layer("conv0")
    out = substitute_channels(model, layer, [5, 6], [[1], [2, 3]], [[2.0], [-0.5, 0.0]],
                              [0.3, 0.1])
    assert len(out.graph.node) == len(model.graph.node) + 1
    feeds = corpus.random_feeds(model)
    np.testing.assert_allclose(corpus.run_ort(out, feeds)["logits"],
                               corpus.run_ort(model, feeds)["logits"], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="exclude"):
        substitute_channel(model, layer, 5, [5], [1.0], 0.0)


# -- the study -----------------------------------------------------------------------------
def _dead_channel_model():
    """conv_bn_folded with conv0 channel 2 dead (all-zero weights and bias)."""
    return _duplicate(corpus.conv_bn_folded(), "conv0.weight", "conv0.bias", 0, 2,
                      scale=0.0, offset=0.0)


def _eval_source(model, n=24):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 3, 8, 8)).astype(np.float32)
    labels = rng.integers(0, corpus.N_CLASSES, n)
    return open_data({"x": x, "labels": labels}, model_io.get_input_specs(model), batch_size=10)


def _scores(model, layer):
    feeds = corpus.random_feeds(model, batch=16)
    y = corpus.run_ort(model, feeds, [layer.output])[layer.output]
    y = np.moveaxis(y, 1, 0).reshape(layer.n_out, -1).astype(np.float64)
    return score_layer(np.cov(y) + 1e-9 * np.eye(layer.n_out), layer=layer.node_name,
                       mean_y=y.mean(axis=1), k_peers=3)


def test_lesion_study_rows_are_consistent():
    model = _dead_channel_model()
    structure = analyze_structure(model)
    source = _eval_source(model)
    conv0 = structure.get_layer("conv0")
    study = lesion_study(model, structure, source, layers=["conv0", "conv1"],
                         channels={"conv0": [0, 2, 3]}, sample=3, seed=7,
                         scores={"conv0": _scores(model, conv0)}, substitute=True, pairs=2)
    base = evaluate(model, structure.head, source)
    assert study.base == base
    assert [(r.layer, r.channel) for r in study.for_layer("conv0")] == \
        [("conv0", 0), ("conv0", 2), ("conv0", 3)]
    assert len(study.for_layer("conv1")) == 3 and len(study.pairs) == 4
    dead = study.for_layer("conv0")[1]
    assert abs(dead.damage) <= 1e-7 and dead.recovery is None
    assert any("recovery undefined" in n for n in study.notes)
    ref = evaluate(lesion_channels(model, conv0, [3]), structure.head, source)
    row = study.for_layer("conv0")[2]
    assert row.damage == pytest.approx(ref.loss - base.loss, abs=1e-6)
    for r in study.lesions:
        assert r.acc_drop == pytest.approx(100 * (base.accuracy - r.accuracy))
        assert (r.sub_damage is None) == (r.layer == "conv1")
        if r.recovery is not None:
            assert r.recovery == pytest.approx((r.damage - r.sub_damage) / r.damage)
    singles = {(r.layer, r.channel): r.damage for r in study.lesions}
    for p in study.pairs:
        worst = max(singles[(p.layer, c)] for c in p.channels)
        assert p.excess == pytest.approx(p.damage - worst)
    rows = study.to_rows()
    assert rows[0]["peer_r2"] is not None and rows[-1]["peer_r2"] is None
    assert {"layer", "channel", "damage", "acc_drop", "sub_damage", "recovery"} <= set(rows[0])
    json.dumps(study.to_dict())
    assert study.timing["n_edits"] == 6 + 3 + 4 and study.timing["seconds_per_edit"] > 0


def test_lesion_study_sample_is_seeded():
    model = _load(corpus.conv_bn_chain())
    structure = analyze_structure(model)
    source = _eval_source(model, n=8)
    runs = [lesion_study(model, structure, source, layers=["conv1"], sample=2, seed=s)
            for s in (3, 3, 4)]
    chans = [[r.channel for r in s.lesions] for s in runs]
    assert chans[0] == chans[1] and len(chans[0]) == 2
    assert MIN_DAMAGE == 1e-6
    with pytest.raises(OnnxDiagError, match="inspect"):
        lesion_study(model, structure, source, layers=["nope"])


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    export = exports.hf_bert(tmp_path_factory.mktemp("bert"))
    return _load(export.path), export.feeds


BERT_FC1 = "/model/bert/encoder/layer.0/intermediate/dense/MatMul"


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_lesion_of_a_token_layer_equals_masked_reference(bert):
    """A MatMul on (N, T, D) tokens with a separate bias Add (docs/METHODS.md §D): its
    weight columns and bias entries zeroed equal the output features masked to 0 after
    the bias Add, at every token."""
    model, feeds = bert
    layer = analyze_structure(model).get_layer(BERT_FC1)
    assert layer.weight_layout == "io" and layer.bias_node
    post = next(n.output[0] for n in model.graph.node if n.name == layer.bias_node)
    out = lesion_channels(model, layer, [3, 7])
    got = corpus.run_ort(out, feeds, [post])
    assert np.all(got[post][..., [3, 7]] == 0)
    ref = corpus.run_ort(_masked(model, post, [3, 7], layer.n_out, True), feeds)
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_substituting_a_token_feature_by_its_duplicate_recovers_the_output(bert):
    """Feature 5 of a token layer made 2 × feature 1: the inserted MatMul over the peer
    features reproduces the model at every token."""
    model, feeds = bert
    layer = analyze_structure(model).get_layer(BERT_FC1)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.name == layer.weight:
            w = numpy_helper.to_array(t).copy()
            w[:, 5] = 2 * w[:, 1]
            t.CopyFrom(numpy_helper.from_array(w, t.name))
    layer = analyze_structure(m).get_layer(BERT_FC1)
    orig = corpus.run_ort(m, feeds, [layer.output])
    y = orig[layer.output].reshape(-1, layer.n_out).T.astype(np.float64)
    peers, beta, a = peer_regression(np.cov(y), y.mean(axis=1), 5, k=3, ridge=0.0)
    assert peers[0] == 1
    out = substitute_channel(m, layer, 5, peers, beta, a)
    got = corpus.run_ort(out, feeds, [layer.output])
    np.testing.assert_allclose(got["logits"], orig["logits"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[layer.output], orig[layer.output], rtol=0, atol=1e-5)
    lesioned = corpus.run_ort(lesion_channels(m, layer, [5]), feeds)["logits"]
    assert np.max(np.abs(lesioned - orig["logits"])) > 1e-6
