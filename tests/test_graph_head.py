"""Head discovery (METHODS §A1) on the corpus, real exporters, overrides and failures.

Oracle: with the features and logits tensors exposed, ONNX Runtime's logits equal
Z Wᵀ + b computed from the returned W, b (so W's orientation is right), and the
model's output equals U, softmax(U) or log_softmax(U) as ``output_kind`` says.
"""

from __future__ import annotations

import io
import json

import corpus
import numpy as np
import pytest

from onnxdiag.errors import HeadNotFoundError
from onnxdiag.graph import Head, analyze_structure, find_head, find_head_candidates
from onnxdiag.model.io import load_model

SOFTMAX = ("Softmax(Exp/ReduceSum/Div)",)
# name: (node, op, features, reduce, logits, output, output_kind, path, n_features)
EXPECTED = {
    "gemm_head": ("head", "Gemm", "feat", "flatten", "logits", "logits", "logits", (), 16),
    "gemm_head_transb0": ("head", "Gemm", "feat", "flatten", "logits", "logits", "logits", (),
                          16),
    "matmul_add_head": ("head", "MatMul", "feat", "flatten", "logits", "logits", "logits", (),
                        16),
    "matmul_add_head_bias_first": ("head", "MatMul", "feat", "flatten", "logits", "logits",
                                   "logits", (), 16),
    "matmul_head_no_bias": ("head", "MatMul", "feat", "flatten", "logits", "logits", "logits",
                            (), 16),
    "conv1x1_before_gap": ("head", "Conv", "relu0", "spatial_mean", "pool", "logits", "logits",
                           ("Flatten",), 8),
    "conv1x1_before_reducemean": ("head", "Conv", "relu0", "spatial_mean", "logits", "logits",
                                  "logits", (), 8),
    "conv1x1_after_gap": ("head", "Conv", "pool", "flatten", "head", "logits", "logits",
                          ("Squeeze",), 8),
    "mlp_head": ("fc2", "Gemm", "hidden", "flatten", "logits", "logits", "logits", (), 32),
    "softmax_output": ("head", "Gemm", "feat", "flatten", "head", "prob", "probabilities",
                       ("Softmax",), 16),
    "log_softmax_output": ("head", "Gemm", "feat", "flatten", "head", "prob",
                           "log_probabilities", ("LogSoftmax",), 16),
    "primitive_softmax": ("head", "Gemm", "feat", "flatten", "head", "prob", "probabilities",
                          SOFTMAX, 16),
    "primitive_softmax_no_max": ("head", "Gemm", "feat", "flatten", "head", "prob",
                                 "probabilities", SOFTMAX, 16),
    "two_outputs": ("head", "Gemm", "feat", "flatten", "head", "probabilities", "probabilities",
                    ("Softmax",), 16),
    "constant_node_weights": ("head", "Gemm", "feat", "flatten", "logits", "logits", "logits",
                              (), 16),
    "identity_transpose_weights": ("head", "Gemm", "feat", "flatten", "logits", "logits",
                                   "logits", (), 16),
    "constant_of_shape_bias": ("head", "Gemm", "feat", "flatten", "logits", "logits", "logits",
                               (), 16),
    "opset9_initializers_as_inputs": ("head", "Gemm", "flatten", "flatten", "head", "prob",
                                      "probabilities", ("Softmax",), 8),
    "two_inputs": ("head", "Gemm", "features", "flatten", "logits", "logits", "logits", (), 12),
    "conv_flatten_gemm": ("head", "Gemm", "flatten", "flatten", "logits", "logits", "logits",
                          (), 64),
}


def _softmax(u: np.ndarray) -> np.ndarray:
    e = np.exp(u - u.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _features(values: np.ndarray, reduce: str) -> np.ndarray:
    values = values.astype(np.float64)
    if reduce == "spatial_mean":
        return values.reshape(values.shape[0], values.shape[1], -1).mean(axis=2)
    return values.reshape(values.shape[0], -1)


def assert_head_matches_ort(model, head: Head, feeds: dict) -> None:
    """U = Z Wᵀ + b against ONNX Runtime, and the output against U (up to its kind)."""
    out = corpus.run_ort(model, feeds, [head.features, head.logits])
    z = _features(out[head.features], head.features_reduce)
    u = out[head.logits].reshape(z.shape[0], -1).astype(np.float64)
    assert z.shape[1] == head.n_features and u.shape[1] == head.n_classes
    np.testing.assert_allclose(z @ head.weight.T + head.bias, u, rtol=1e-4, atol=1e-5)
    if head.scores is not None:
        scores = out[head.scores].reshape(u.shape)
        expect = {"logits": u, "probabilities": _softmax(u),
                  "log_probabilities": np.log(_softmax(u))}[head.output_kind]
        np.testing.assert_allclose(scores, expect, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(corpus.CORPUS))
def test_every_corpus_head_matches_ort(name):
    model = load_model(corpus.CORPUS[name]())
    head = find_head(model)
    assert head.n_classes == corpus.N_CLASSES
    assert head.weight.dtype == np.float64 and head.bias.shape == (head.n_classes,)
    assert_head_matches_ort(model, head, corpus.random_feeds(model, batch=3))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_head_records(name):
    head = find_head(load_model(corpus.CORPUS[name]()))
    node, op, features, reduce, logits, output, kind, path, n_features = EXPECTED[name]
    got = (head.node_name, head.op_type, head.features, head.features_reduce, head.logits,
           head.output, head.output_kind, head.path, head.n_features)
    assert got == (node, op, features, reduce, logits, output, kind, path, n_features)
    assert head.outputs_softmax == (kind == "probabilities")


def test_bias_node_and_missing_bias():
    head = find_head(load_model(corpus.matmul_add_head(bias_first=True)))
    assert head.bias_node == "head_bias" and np.any(head.bias != 0)
    head = find_head(load_model(corpus.matmul_head_no_bias()))
    assert head.bias_node is None and not np.any(head.bias)
    head = find_head(load_model(corpus.constant_of_shape_bias()))
    np.testing.assert_allclose(head.bias, 0.5)


def test_label_output_is_ignored_and_noted():
    head = find_head(load_model(corpus.two_outputs()))
    assert head.output == "probabilities" and "label" in head.note


def test_no_head_message_names_last_node_and_fix():
    for kind, op in (("resize", "Resize"), ("elementwise", "Mul")):
        with pytest.raises(HeadNotFoundError) as err:
            find_head(load_model(corpus.no_linear_head(kind)))
        msg = str(err.value)
        assert f"'{op}'" in msg and "--head NODE" in msg and "onnxdiag inspect MODEL" in msg


def test_named_head_and_features_overrides():
    model = load_model(corpus.mlp_head())
    hidden = find_head(model, head="fc1")
    assert (hidden.features, hidden.logits, hidden.n_classes, hidden.output) == \
        ("x", "fc1", 32, None)
    model = load_model(corpus.conv_bn_chain())
    feeds = corpus.random_feeds(model, batch=2)
    spatial = find_head(model, head="head", features="relu1")
    assert spatial.features_reduce == "spatial_mean"
    assert_head_matches_ort(model, spatial, feeds)
    pooled = find_head(model, features="pool")
    assert (pooled.features, pooled.features_reduce) == ("pool", "flatten")
    assert_head_matches_ort(model, pooled, feeds)
    named = find_head(load_model(corpus.matmul_add_head()), head="head")
    assert (named.logits, named.bias_node, named.output) == ("logits", "head_bias", "logits")


def test_bad_overrides_raise_with_candidates():
    model = load_model(corpus.conv_bn_chain())
    with pytest.raises(HeadNotFoundError, match="candidate linear nodes: head"):
        find_head(model, head="nope")
    with pytest.raises(HeadNotFoundError, match="cannot be the head"):
        find_head(model, head="conv0")
    with pytest.raises(HeadNotFoundError, match="expects 16"):
        find_head(model, features="relu0")
    with pytest.raises(HeadNotFoundError, match="not in the model"):
        find_head(model, features="nope")


def test_candidates():
    assert find_head_candidates(load_model(corpus.mlp_head())) == ["fc1", "fc2"]
    assert find_head_candidates(load_model(corpus.residual_block())) == ["proj", "head"]
    assert find_head_candidates(load_model(corpus.no_linear_head())) == []


def test_find_head_never_modifies_model():
    model = load_model(corpus.conv1x1_before_gap())
    before = model.SerializeToString()
    find_head(model)
    analyze_structure(model)
    assert model.SerializeToString() == before


def test_head_to_dict_is_json():
    head = find_head(load_model(corpus.softmax_output()))
    d = json.loads(json.dumps(head.to_dict()))
    assert d["weight"]["shape"] == [5, 16] and d["outputs_softmax"] is True
    full = head.to_dict(arrays=True)
    np.testing.assert_allclose(np.array(full["weight"]), head.weight)


@pytest.mark.parametrize("zipmap", [True, False])
def test_skl2onnx_mlp_on_digits(zipmap):
    pytest.importorskip("skl2onnx")
    from skl2onnx import to_onnx
    from sklearn.datasets import load_digits
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32)
    clf = MLPClassifier(hidden_layer_sizes=(16,), max_iter=30, random_state=0)
    with pytest.warns(Warning):  # ConvergenceWarning: 30 iterations keep the test fast
        clf.fit(x[:400], y[:400])
    options = None if zipmap else {id(clf): {"zipmap": False}}
    model = load_model(to_onnx(clf, x[:1], options=options, target_opset=17))
    head = find_head(model)
    assert (head.op_type, head.n_classes, head.n_features) == ("MatMul", 10, 16)
    assert head.output_kind == "probabilities" and head.bias_node is not None
    assert (head.scores != head.output) == zipmap
    out = corpus.run_ort(model, {"X": x[:20]}, [head.features, head.logits])
    z, u = out[head.features].astype(np.float64), out[head.logits]
    np.testing.assert_allclose(z @ head.weight.T + head.bias, u, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_softmax(u.astype(np.float64)), clf.predict_proba(x[:20]),
                               atol=1e-4)


def _torch_export(training: str) -> bytes:
    torch = pytest.importorskip("torch")
    nn = torch.nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
                        nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(16, 5), nn.Softmax(dim=1))
    with torch.no_grad():  # non-trivial BN statistics
        for m in net:
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    net.eval()
    buf = io.BytesIO()
    torch.onnx.export(net, torch.randn(1, 3, 8, 8), buf, dynamo=False, input_names=["x"],
                      output_names=["prob"], dynamic_axes={"x": {0: "N"}, "prob": {0: "N"}},
                      opset_version=17, training=getattr(torch.onnx.TrainingMode, training))
    return buf.getvalue()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
@pytest.mark.parametrize("training", ["EVAL", "PRESERVE"])
def test_torch_export(training):
    model = load_model(_torch_export(training))
    structure = analyze_structure(model)
    head = structure.head
    assert (head.op_type, head.n_classes, head.n_features) == ("Gemm", 5, 16)
    assert head.output == "prob" and head.output_kind == "probabilities"
    assert_head_matches_ort(model, head, corpus.random_feeds(model, batch=3))
    convs = [la for la in structure.layers if la.op_type == "Conv"]
    assert len(convs) == 2
    if training == "EVAL":  # the TorchScript exporter folds BN into the convs in eval mode
        assert all(la.bn_folded and la.bn_node is None for la in convs)
    else:
        assert all(la.bn_position == "after" and not la.bn_folded for la in convs)
    assert all(la.activation == "Relu" for la in convs)
    assert [g.prunable for g in structure.groups] == [True, True, False]
