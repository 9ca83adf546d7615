"""Head discovery by verification on data (docs/METHODS.md §A1, §D).

Oracle: the tensors are read back through ``corpus.run_ort`` (its own exposure, ORT with
optimisations off), Z is rebuilt by brute force (a loop over spatial positions, the last
non-pad token from the attention mask), and the model's output is compared with the
relation applied to U by NumPy — nothing of the implementation's own matching is reused.
"""

from __future__ import annotations

import corpus
import corpus_heads
import numpy as np
import pytest

from onnxdiag.errors import HeadNotFoundError
from onnxdiag.evaluate import head_arrays
from onnxdiag.graph import GraphIndex, analyze_structure, find_head
from onnxdiag.graph.verify import TOLERANCE, find_verified_head
from onnxdiag.model.io import get_input_specs, load_model


def _softmax(u):
    e = np.exp(u - u.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


RELATION = {"identity": lambda u: u, "softmax": _softmax,
            "log_softmax": lambda u: np.log(_softmax(u)),
            "sigmoid": lambda u: 1 / (1 + np.exp(-u)), "argmax": lambda u: u.argmax(axis=1)}


def _brute_features(values, head, feeds) -> np.ndarray:
    """Z by explicit loops: spatial mean position by position; the last unmasked token."""
    values = values.astype(np.float64)
    n = values.shape[0]
    if head.features_reduce == "spatial_mean":
        flat = values.reshape(n, values.shape[1], -1)
        total = np.zeros(flat.shape[:2])
        for p in range(flat.shape[2]):
            total += flat[:, :, p]
        return total / flat.shape[2]
    if head.features_reduce == "token":
        last = feeds["attention_mask"].sum(axis=1) - 1
        return np.stack([values[i, last[i]] for i in range(n)])
    return values.reshape(n, -1)


def assert_verified_head_matches(model, head, feeds) -> None:
    """Z Wᵀ + b = U and output = relation(U) on ORT's own tensors."""
    out = corpus.run_ort(model, feeds, [head.features, head.logits])
    z = _brute_features(out[head.features], head, feeds)
    u = out[head.logits].reshape(z.shape[0], -1).astype(np.float64)
    np.testing.assert_allclose(z @ head.weight.T + head.bias, u, rtol=1e-4, atol=1e-5)
    assert head.rel_error <= TOLERANCE and head.verified
    if head.output is not None:
        target = out[head.scores or head.output].reshape(RELATION[head.relation](u).shape)
        np.testing.assert_allclose(RELATION[head.relation](u), target, rtol=1e-4, atol=1e-6)
        assert head.relation_error <= TOLERANCE


@pytest.mark.parametrize("name", sorted(corpus_heads.HEAD_CASES))
def test_verified_heads(name):
    builder, node, relation, features, reduce, logits = corpus_heads.HEAD_CASES[name]
    model = load_model(builder())
    feeds = corpus_heads.head_feeds(model)
    head = find_verified_head(model, feeds)
    got = (head.node_name, head.relation, head.features, head.features_reduce, head.logits)
    assert got == (node, relation, features, reduce, logits)
    assert_verified_head_matches(model, head, feeds)
    if name in corpus_heads.DATA_ONLY:  # no pattern lists the ops in between
        with pytest.raises(HeadNotFoundError):
            find_head(model)
    else:  # refused before: now found without data too, with the same relation
        static = find_head(model)
        assert (static.node_name, static.relation, static.logits) == (node, relation, logits)
        assert not static.verified


@pytest.mark.parametrize("name", sorted(corpus_heads.REFUSED_HEADS))
def test_refused_heads_name_the_mismatch(name):
    model = load_model(corpus_heads.REFUSED_HEADS[name]())
    with pytest.raises(HeadNotFoundError):
        find_head(model)  # softmax_over_batch was accepted as a softmax before
    with pytest.raises(HeadNotFoundError) as err:
        find_verified_head(model, corpus_heads.head_feeds(model))
    msg = str(err.value)
    assert "\n" not in msg and "'head'" in msg and "--head NODE" in msg
    assert "--features TENSOR" in msg and f"{TOLERANCE:g}" in msg
    if name != "conv1x1_relu_before_gap":  # the measured error of each relation
        assert all(f"{r} " in msg for r in ("identity", "softmax", "log_softmax", "sigmoid"))


def test_conv_relu_before_pool_says_what_is_there():
    model = load_model(corpus_heads.conv1x1_relu_before_gap())
    with pytest.raises(HeadNotFoundError) as err:
        find_head(model)
    msg = str(err.value)
    assert "not preceded by" not in msg
    assert "Relu 'head_relu' applied to the output of 1×1 Conv 'head'" in msg
    assert "not a linear map of that conv's input" in msg


def test_fake_softmax_measured_error():
    """Exp(u) / ReduceSum(|u|): the check measures how far from a softmax it is."""
    model = load_model(corpus_heads.fake_softmax())
    feeds = corpus_heads.head_feeds(model)
    out = corpus.run_ort(model, feeds, ["u"])
    expected = np.linalg.norm(_softmax(out["u"].astype(np.float64)) - out["prob"]) \
        / np.linalg.norm(out["prob"])
    with pytest.raises(HeadNotFoundError, match=f"softmax {expected:.3g}"):
        find_verified_head(model, feeds)


def test_head_arrays_spatial_mean_against_brute_force():
    """A 1×1 conv before GAP: Z is the mean over positions, not their sum (with the sum,
    Z Wᵀ + b misses U by a factor of 64 positions)."""
    model = load_model(corpus.conv1x1_before_gap())
    head = find_head(model)
    feeds = corpus.random_feeds(model, batch=3)
    out = corpus.run_ort(model, feeds, [head.features, head.logits])
    z, u = head_arrays(out, head)
    np.testing.assert_allclose(z, _brute_features(out[head.features], head, feeds), rtol=1e-12)
    np.testing.assert_allclose(z @ head.weight.T + head.bias, u, rtol=1e-4, atol=1e-6)
    verified = find_verified_head(model, feeds)
    assert verified.features_reduce == "spatial_mean" and verified.rel_error < 1e-6


def test_head_arrays_token_pick_against_the_mask():
    model = load_model(corpus_heads.decoder_gather_head())
    head = find_head(model)
    feeds = corpus_heads.head_feeds(model, batch=5)
    out = corpus.run_ort(model, feeds, [head.features, head.logits])
    z, u = head_arrays(out, head)
    np.testing.assert_allclose(z, _brute_features(out[head.features], head, feeds))
    assert u.shape == (5, corpus.N_CLASSES)


def test_named_head_and_features_are_verified():
    model = load_model(corpus.conv_bn_chain())
    feeds = corpus.random_feeds(model, batch=3)
    spatial = find_verified_head(model, feeds, head="head", features="relu1")
    assert spatial.features_reduce == "spatial_mean"
    assert_verified_head_matches(model, spatial, feeds)
    hidden = find_verified_head(load_model(corpus.mlp_head()), corpus.random_feeds(
        load_model(corpus.mlp_head())), head="fc1")
    assert hidden.output is None and hidden.relation_error is None and hidden.verified
    named = load_model(corpus_heads.fake_softmax())  # a last linear map: its relation too
    with pytest.raises(HeadNotFoundError, match="no relation maps 'u' to output 'prob'"):
        find_verified_head(named, corpus_heads.head_feeds(named), head="head")


def test_structure_lists_candidates_when_no_head_and_verifies_with_feeds():
    model = load_model(corpus_heads.scaled_identity())
    structure = analyze_structure(model, require_head=False)
    assert structure.head is None and structure.head_candidates == ("head",)
    assert structure.to_dict()["head_candidates"] == ["head"]
    feeds = corpus_heads.head_feeds(model)
    verified = analyze_structure(model, feeds=feeds).head
    assert verified.relation == "identity" and verified.path == ("Mul", "Transpose", "Transpose")
    d = verified.to_dict()
    assert d["verified"] and d["rel_error"] <= TOLERANCE and d["relation"] == "identity"


@pytest.mark.parametrize("name", sorted({**corpus_heads.HEAD_CASES,
                                         **corpus_heads.REFUSED_HEADS}))
def test_candidates_listed_without_data_for_every_head_case(name):
    builder = corpus_heads.HEAD_CASES.get(name, (corpus_heads.REFUSED_HEADS.get(name),))[0]
    structure = analyze_structure(load_model(builder()), require_head=False)
    assert "head" in structure.head_candidates


def test_dequantize_linear_constants_fold():
    from onnx import TensorProto, helper, numpy_helper

    q = np.array([[-3, 7], [12, -128], [5, 0]], np.int8)
    scale, zero = np.array([0.5, 0.25, 2.0], np.float32), np.array([1, -2, 0], np.int8)
    inits = [numpy_helper.from_array(a, n) for a, n in ((q, "q"), (scale, "s"), (zero, "z"))]
    node = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["w"], axis=0)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info(
        "w", TensorProto.FLOAT, [3, 2])], inits)
    index = GraphIndex(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    expected = (q.astype(np.float64) - zero[:, None]) * scale[:, None]
    np.testing.assert_array_equal(index.get_constant("w"), expected)
    assert index.get_constant("w").dtype == np.float32


def test_probe_reports_the_verified_relation():
    from onnxdiag.data.source import open_data
    from onnxdiag.selection.probe import probe_model

    model = load_model(corpus_heads.jax_softmax())
    feeds = corpus_heads.head_feeds(model, batch=8)
    probe = open_data(feeds, get_input_specs(model), batch_size=4)
    result = probe_model(model, analyze_structure(model), probe, targets="pseudo")
    d = result.to_dict()
    assert d["head_relation"] == "softmax" and d["head_relation_error"] <= TOLERANCE
    assert d["head_rel_error"] <= TOLERANCE


def test_probe_refuses_a_head_that_does_not_verify():
    from onnxdiag.data.source import open_data
    from onnxdiag.selection.probe import probe_model

    model = load_model(corpus_heads.fake_softmax())
    structure = analyze_structure(model, head="head")
    probe = open_data(corpus_heads.head_feeds(model), get_input_specs(model), batch_size=4)
    with pytest.raises(HeadNotFoundError, match="no relation maps 'u' to output 'prob'"):
        probe_model(model, structure, probe, targets="pseudo")
