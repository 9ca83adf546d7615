"""CLI of the structured reconstruction (docs/METHODS.md §E2, §E3): ``--reconstruct``
(auto: on without BatchNormalization), ``--score recon`` / ``wanda``, in prune-channels
and prune-sweep — what ran is stated, the emitted model equals the library's
reconstruction, and the refusals are one-line user errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import assert_user_error, run
from structured_data import write_tiny

ROOT = Path(__file__).resolve().parents[1]
VIT = ROOT / "models" / "vit" / "model.onnx"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def vit_data(tmp_path_factory):
    """200 calibration / 200 evaluation images of the bundled sample (the ViT's data)."""
    folder = tmp_path_factory.mktemp("vitdata")
    with np.load(ROOT / "models" / "sample" / "calib.npz") as z:
        np.savez(folder / "calib.npz", input=z["input"][:200], labels=z["labels"][:200])
    with np.load(ROOT / "models" / "sample" / "eval.npz") as z:
        np.savez(folder / "eval.npz", input=z["input"][:200], labels=z["labels"][:200])
    return folder / "calib.npz", folder / "eval.npz"


def test_reconstruction_is_the_default_without_batchnorm(vit_data, tmp_path):
    calib, evaluation = vit_data
    out = tmp_path / "vit.onnx"
    result = run("prune-channels", VIT, "--ratio", 0.5, "--score", "magnitude", "--data", calib,
                 "--eval-data", evaluation, "-o", out, "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    side = json.loads((tmp_path / "vit.onnx.json").read_text())
    rec = side["reconstruction"]
    names = {la["node_name"] for la in rec["layers"]}
    assert rec["n_reconstructed"] == 6  # per block: the heads' out projection and fc2
    assert sum("attn/out" in n for n in names) == 3 and sum("mlp.2" in n for n in names) == 3
    assert rec["mean_error_after"] < rec["mean_error_before"]
    assert any("recovery auto: reconstruction on" in n for n in side["notes"])
    text = (tmp_path / "rep" / "report.txt").read_text()
    assert "after reconstruction" in text and "mlp.2/MatMul" in text
    _valid(tmp_path / "rep" / "report.json")
    onnx.checker.check_model(onnx.load(out), full_check=True)
    # the emitted model is the library's reconstruction of the same plan
    from onnxdiag.model.io import load_model
    from onnxdiag.runtime.runner import OrtRunner
    from onnxdiag.structured.choice import consumer_moments
    from onnxdiag.structured.plan import Plan
    from onnxdiag.structured.reconstruct import prune_reconstructed

    plan = Plan.from_dict(side["plan"])
    m = load_model(VIT)
    from onnxdiag import DataRequest
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs

    s = analyze_structure(m)
    moments = consumer_moments(m, s, DataRequest(str(calib)).open(get_input_specs(m)))
    mine, _, _ = prune_reconstructed(m, s, plan.removed, moments)
    x = {"input": np.load(evaluation)["input"][:32]}
    np.testing.assert_allclose(OrtRunner(out).run(x)["logits"], OrtRunner(mine).run(x)["logits"],
                               rtol=1e-4, atol=1e-4)
    off = run("prune-channels", VIT, "--ratio", 0.5, "--score", "magnitude", "--data", calib,
              "--no-reconstruct", "-o", tmp_path / "off.onnx", "--out", tmp_path / "rep2")
    assert off.exit_code == 0, off.output
    side = json.loads((tmp_path / "off.onnx.json").read_text())
    assert side["reconstruction"] is None and not any("auto" in n for n in side["notes"])


def test_batchnorm_models_keep_reconstruction_off_unless_asked(tmp_path):
    model, data = write_tiny(tmp_path)
    result = run("prune-channels", model, "--ratio", 0.5, "--score", "magnitude", "--data", data,
                 "--eval-data", data, "-o", tmp_path / "a.onnx", "--out", tmp_path / "ra")
    assert result.exit_code == 0, result.output
    side = json.loads((tmp_path / "a.onnx.json").read_text())
    assert side["reconstruction"] is None
    assert any("reconstruction off: the model has BatchNormalization" in n for n in side["notes"])
    both = run("prune-channels", model, "--ratio", 0.5, "--score", "recon", "--data", data,
               "--eval-data", data, "--reconstruct", "--recalibrate-bn", "-o", tmp_path / "b.onnx",
               "--out", tmp_path / "rb")
    assert both.exit_code == 0, both.output
    side = json.loads((tmp_path / "b.onnx.json").read_text())
    assert side["reconstruction"]["n_reconstructed"] > 0 and side["recalibration"]
    assert "after reconstruction + BN recalibration" in (tmp_path / "rb" / "report.txt").read_text()


def test_reconstruct_refusals(tmp_path):
    model, data = write_tiny(tmp_path)
    assert_user_error(run("prune-channels", model, "--score", "magnitude", "--reconstruct",
                          "-o", tmp_path / "x.onnx", "--out", tmp_path / "r"), "--data")
    assert_user_error(run("prune-channels", model, "--score", "wanda", "-o", tmp_path / "y.onnx",
                          "--out", tmp_path / "r2"), "--data")
    assert not (tmp_path / "x.onnx").exists()


def test_prune_sweep_compares_choices_under_reconstruction(vit_data, tmp_path):
    calib, evaluation = vit_data
    result = run("prune-sweep", VIT, "--ratios", "0.5", "--scores", "magnitude,wanda,recon",
                 "--data", calib, "--eval-data", evaluation, "--out", tmp_path / "sw",
                 "--format", "json")
    assert result.exit_code == 0, result.output
    sweep = json.loads(result.stdout)["prune_sweep"]
    assert sweep["recovery"] == "reconstruction"
    rows = sweep["rows"]
    assert {r["score"] for r in rows} == {"magnitude", "wanda", "recon"}
    assert len({r["flops_ratio"] for r in rows}) == 1  # equal FLOPs
    assert all(r["recon_error_after"] < r["recon_error_before"] for r in rows)
    assert all(r["accuracy_after"] is not None for r in rows)
    _valid(tmp_path / "sw" / "report.json")
    # a cell is what prune-channels makes of the same score and ratio
    one = run("prune-channels", VIT, "--ratio", 0.5, "--score", "recon", "--data", calib,
              "--eval-data", evaluation, "-o", tmp_path / "r.onnx", "--out", tmp_path / "one")
    assert one.exit_code == 0, one.output
    side = json.loads((tmp_path / "r.onnx.json").read_text())
    cell = next(r for r in rows if r["score"] == "recon")
    assert cell["accuracy_after"] == pytest.approx(side["accuracy"]["emitted"]["accuracy"])
    assert cell["recon_error_after"] == pytest.approx(side["reconstruction"]["mean_error_after"])


def _valid(path):
    pytest.importorskip("jsonschema")
    from onnxdiag.report.schema import validate_report

    validate_report(json.loads(path.read_text()))
