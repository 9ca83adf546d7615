"""Head discovery + verification on real converter exports (tests/exports.py).

Oracle: the features Z and logits U the source framework computed (a torch forward hook on
the head module, the hidden activations of scikit-learn's MLP from its coefficients, the
NumPy forward pass of the onnx.helper model) against Z, U read through the verified head.
Each export is skipped when its converter is not installed.
"""

from __future__ import annotations

import exports
import numpy as np
import pytest

from onnxdiag.evaluate import head_arrays
from onnxdiag.graph import GraphIndex, find_head
from onnxdiag.graph.verify import TOLERANCE, find_verified_head, run_exposed
from onnxdiag.model.io import load_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("exports")


def _check_head(export, model):
    head = find_verified_head(model, export.feeds)
    if export.head_node:
        assert head.node_name == export.head_node
    assert head.op_type == export.head_op and head.relation == export.relation
    assert head.rel_error <= TOLERANCE and head.relation_error <= TOLERANCE
    static = find_head(model)  # found without data too, the same node
    assert (static.node_name, static.features) == (head.node_name, head.features)
    return head


@pytest.mark.parametrize("name", sorted(set(exports.BUILDERS) - {"qdq_int8"}))
def test_export_head_is_verified_with_the_right_features(name, folder):
    export = exports.BUILDERS[name](folder)
    model = load_model(export.path)
    head = _check_head(export, model)
    z, u = head_arrays(run_exposed(model, export.feeds, [head.features, head.logits]), head)
    np.testing.assert_allclose(z, export.features, atol=export.atol, rtol=1e-4)
    np.testing.assert_allclose(u, export.logits, atol=export.atol, rtol=1e-4)
    node = GraphIndex(model).node_by_name[head.node_name]
    assert head.features == node.input[0] or head.features_reduce == "token"
    if name == "hf_gpt2":  # head on every token, then the last non-pad token picked
        assert head.features_reduce == "token" and head.logits == "logits"
        assert head.features == node.input[0]


def test_qdq_int8_head_weight_comes_through_dequantize_linear(folder):
    export = exports.qdq_int8(folder)
    model = load_model(export.path)
    head = _check_head(export, model)
    index = GraphIndex(model)
    node = index.node_by_name[head.node_name]
    weight_src = index.producer[node.input[1]]
    assert weight_src.op_type == "DequantizeLinear"
    assert index.initializers[weight_src.input[0]].data_type == 3  # int8
    assert index.producer[head.features].op_type == "DequantizeLinear"
    assert head.path == ("QuantizeLinear", "DequantizeLinear")
    float_head = find_head(load_model(export.notes["float"].path))
    step = np.abs(float_head.weight).max() / 127  # one int8 step of the symmetric weights
    assert np.abs(head.weight - float_head.weight).max() <= step
    assert np.abs(head.weight - float_head.weight).max() > 0  # really quantized


def test_readouts_through_the_cli_on_a_zipmap_export(folder, tmp_path):
    """skl2onnx's default export ends in a ZipMap (a sequence of maps): exposing the head's
    tensors keeps that output's type, so the readouts session loads and runs."""
    from cli_helpers import run

    export = exports.sklearn_mlp(folder)
    assert "ZipMap" in {n.op_type for n in load_model(export.path).graph.node}
    data = tmp_path / "digits.npz"
    np.savez(data, **export.feeds, labels=np.zeros(len(next(iter(export.feeds.values()))),
                                                    dtype=np.int64))
    result = run("readouts", export.path, "--data", data, "--out", tmp_path / "r")
    assert result.exit_code == 0, result.output
    assert "head_grad" in result.output and "[W]" not in result.output


def test_prune_on_a_zipmap_export_emits_a_checked_model(folder, tmp_path):
    """skl2onnx's default MLP export (ZipMap on): prune emits a model whose reload check
    compares the ZipMap outputs (a sequence of maps) key by key."""
    import json

    from cli_helpers import run

    export = exports.sklearn_mlp(folder)
    n = len(next(iter(export.feeds.values())))
    data = tmp_path / "digits.npz"
    np.savez(data, **export.feeds, labels=np.zeros(n, dtype=np.int64))
    out = tmp_path / "p.onnx"
    result = run("prune", export.path, "--sparsity", "0.5", "--data", data, "-o", out,
                 "--out", tmp_path / "r")
    assert result.exit_code == 0, result.output
    checks = json.loads(out.with_name("p.onnx.json").read_text())["checks"]
    assert checks["onnxruntime_load"] == "passed" and checks["max_abs_output_diff"] == 0.0


def test_prune_channels_on_a_zipmap_export_emits_a_checked_model(folder, tmp_path):
    """prune-channels' inference optimisation compares the pruned and optimised models'
    outputs; skl2onnx's ZipMap output (a sequence of maps) is compared key by key."""
    import json

    from cli_helpers import run

    export = exports.sklearn_mlp(folder)
    n = len(next(iter(export.feeds.values())))
    data = tmp_path / "digits.npz"
    np.savez(data, **export.feeds, labels=np.arange(n) % 10)
    out = tmp_path / "n.onnx"
    result = run("prune-channels", export.path, "--ratio", "0.5", "--score", "magnitude",
                 "--eval-data", data, "-o", out, "--out", tmp_path / "r")
    assert result.exit_code == 0, result.output
    sidecar = json.loads(out.with_name("n.onnx.json").read_text())
    assert sidecar["checks"]["onnxruntime_load"] == "passed"
    assert "ZipMap" in {n.op_type for n in load_model(out).graph.node}


@pytest.mark.parametrize("verb", ["rr", "sweep", "prune"])
def test_rr_verbs_on_an_int8_qdq_export_refuse_in_one_line(verb, folder, tmp_path):
    """An int8 QDQ model's weights come out of DequantizeLinear: nothing to prune. rr and
    sweep refuse before their progress line, so the error is stderr's only line; it names
    the first layer's obstacle and the fix."""
    from cli_helpers import assert_user_error, run

    export = exports.qdq_int8(folder)
    data = tmp_path / "x.npz"
    np.savez(data, **export.feeds, labels=np.arange(4) % 5)
    extra = {"rr": [], "sweep": ["--sparsity", "0.5"],
             "prune": ["--sparsity", "0.5", "-o", tmp_path / "p.onnx"]}[verb]
    result = run(verb, export.path, "--data", data, *extra, "--out", tmp_path / "r")
    assert_user_error(result, "no prunable layer", tmp_path / "p.onnx", out=tmp_path / "r")
    assert "'/stem/stem.0/Conv': weight is computed (by DequantizeLinear" in result.stderr
    assert "Prune the float model, then quantize it." in result.stderr
