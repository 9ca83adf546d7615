"""The ``orthogonality`` verb and the §B4 depth table of ``channels`` (docs/METHODS.md §B4).

Equivalence: a checkpoint made by moving one layer's weight along the closed-form gradient
of its total input capture (computed from the input moments of the previous checkpoint)
gives cos = 1 for that layer and update.  CLI: help, happy path, user errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import corpus
import corpus_dense
import numpy as np
import onnx
import pytest
from cli_helpers import assert_user_error, run
from onnx import numpy_helper

from onnxdiag.channels.gradients import information_gradients
from onnxdiag.channels.inputs import collect_input_moments, find_input_layers
from onnxdiag.data.request import DataRequest
from onnxdiag.graph import analyze_structure
from onnxdiag.model.io import get_input_specs

ROOT = Path(__file__).resolve().parents[1]


def _data(folder, n=24):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3, 8, 8)).astype(np.float32)
    np.savez(folder / "data.npz", x=x, labels=np.arange(n) % corpus.N_CLASSES)
    return folder / "data.npz", x


def _with_weight(model, name, value):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))
    return out


def _series(tmp_path):
    """ckpt_0 = residual_block; ckpt_1 = ckpt_0 with c1 moved along ∇ΣI_X (other layers
    unchanged); ckpt_2 = another seed's weights (a plain update)."""
    data, x = _data(tmp_path)
    model = corpus.residual_block()
    structure = analyze_structure(model)
    source = DataRequest(str(data)).open(get_input_specs(model))
    layers = find_input_layers(model, structure, ["c1"])
    m = collect_input_moments(model, structure, source, layers, targets="labels")["c1"]
    grad = information_gradients(m.W, m.cov_x, m.cov_xt, m.var_t).input_capture_grad
    w0 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "c1.weight"))
    step = 1e-3 * grad.reshape(w0.shape) / np.abs(grad).max()
    paths = []
    for i, proto in enumerate((model, _with_weight(model, "c1.weight", w0 + step),
                               corpus.residual_block(seed=1))):
        paths.append(tmp_path / "ckpts" / f"ckpt_{i}.onnx")
        paths[-1].parent.mkdir(exist_ok=True)
        onnx.save(proto, paths[-1])
    return paths, data


def test_update_along_the_gradient_has_cosine_one(tmp_path):
    paths, data = _series(tmp_path)
    res = run("orthogonality", tmp_path / "ckpts", "--data", data, "--out", tmp_path / "rep",
              "--format", "json")
    assert res.exit_code == 0, res.output
    section = json.loads(res.stdout)["orthogonality"]
    rows = {(r["layer"], r["t"]): r for r in section["rows"]}
    assert rows[("c1", 0)]["cos_input_capture"] == pytest.approx(1.0, abs=1e-4)
    for name in section["layers"]:
        if name != "c1":  # unchanged weights: no update, no cosine
            assert rows[(name, 0)]["update_norm"] == 0.0
            assert rows[(name, 0)]["cos_input_capture"] is None
        r = rows[(name, 1)]
        assert -1 <= r["cos_input_capture"] <= 1 and -1 <= r["cos_task_info"] <= 1
    assert rows[("c1", 0)]["chance_abs_cos"] == pytest.approx((2 / (np.pi * 8 * 8 * 9)) ** 0.5)
    assert len(section["rows"]) == 2 * len(section["layers"])
    assert section["depth"]["layers"] and "single_share" in section["depth"]["trends"]
    csv = (tmp_path / "rep" / "orthogonality.csv").read_text().splitlines()
    assert len(csv) == 1 + len(section["rows"]) and csv[0].startswith("layer,depth,t,")
    _validate(json.loads(res.stdout))


def _validate(report):
    pytest.importorskip("jsonschema")
    from onnxdiag.report.schema import validate_report

    validate_report(report)


def test_orthogonality_on_linear_layers_of_the_vit_sample(tmp_path):
    ckpts = ROOT / "models" / "vit" / "checkpoints"
    res = run("orthogonality", ckpts / "ckpt_000.onnx", ckpts / "ckpt_001.onnx", "--data",
              ROOT / "models" / "sample" / "calib.npz", "--limit", 24, "--out",
              tmp_path / "rep", "--format", "json")
    assert res.exit_code == 0, res.output
    section = json.loads(res.stdout)["orthogonality"]
    assert any("MatMul" in name for name in section["layers"])
    assert all(r["cos_task_info"] is not None for r in section["rows"])


def test_orthogonality_user_errors(tmp_path):
    paths, data = _series(tmp_path)
    assert_user_error(run("orthogonality", paths[0], "--data", data, "--out", tmp_path / "a"),
                      "at least 2 checkpoints", out=tmp_path / "a")
    other = tmp_path / "other.onnx"
    onnx.save(corpus.conv_bn_chain(), other)
    assert_user_error(run("orthogonality", paths[0], other, "--data", data, "--out",
                          tmp_path / "b"), "one architecture", out=tmp_path / "b")
    dense = tmp_path / "seg.onnx"
    onnx.save(corpus_dense.seg_conv_head(), dense)
    assert_user_error(run("channels", dense, "--data", data, "--out", tmp_path / "c"),
                      "applied at every position", out=tmp_path / "c")
    assert run("orthogonality", "--help").exit_code == 0


def test_channels_reports_the_depth_table(tmp_path):
    data, _ = _data(tmp_path, 40)
    path = tmp_path / "m.onnx"
    onnx.save(corpus.residual_block(), path)
    res = run("channels", path, "--data", data, "--out", tmp_path / "rep", "--format", "json",
              "--triplet-partners", 4)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    depth = report["channels"]["depth"]
    assert [r["layer"] for r in depth["layers"]] == [r["layer"] for r in
                                                     report["channels"]["layers"]]
    assert depth["params"]["triplet_partners"] == 4
    assert report["metadata"]["parameters"]["triplet_partners"] == 4
    assert all(0 <= r["r2_single"] <= r["r2_multi"] + 1e-12 <= 1 + 1e-12
               for r in depth["layers"])
    header = (tmp_path / "rep" / "channels.csv").read_text().splitlines()[0].split(",")
    assert {"r2_single", "triplet_synergy"} <= set(header)
    assert "higher-order structure by depth" in (tmp_path / "rep" / "report.txt").read_text()
    _validate(report)


def test_input_moments_of_a_gemm_on_token_rows_of_hf_gpt2(tmp_path):
    """GPT-2's Conv1D is exported as a Gemm on N·T rows (a 2-D input): its rows are the
    inputs' tokens, T per input. With every token taken (n_positions ≥ T) the moments are
    the plain covariance of all N·T rows (numpy.cov), from N inputs."""
    import exports

    from onnxdiag.graph import GraphIndex
    from onnxdiag.graph.verify import run_exposed
    from onnxdiag.model.io import load_model

    export = exports.hf_gpt2(tmp_path)
    model = load_model(export.path)
    n, t = export.feeds["input_ids"].shape
    np.savez(tmp_path / "d.npz", **export.feeds, labels=np.arange(n) % 3)
    structure = analyze_structure(model)
    source = DataRequest(str(tmp_path / "d.npz")).open(get_input_specs(model))
    gemm = next(la for la in find_input_layers(model, structure) if la.op_type == "Gemm")
    name = GraphIndex(model).get_node(gemm.name).input[0]
    x = run_exposed(model, export.feeds, [name])[name].astype(np.float64)
    assert x.shape == (n * t, gemm.W.shape[1])  # N·T rows, not N
    m = collect_input_moments(model, structure, source, [gemm], targets="labels",
                              n_positions=4 * t)[gemm.name]
    assert (m.n_rows, m.n_images) == (n * t, n)
    np.testing.assert_allclose(m.cov_x, np.cov(x.T), rtol=1e-6, atol=1e-9)
