"""``channels``, ``lesion`` and ``analyze`` on MLPs and transformers through the CLI
(docs/METHODS.md §B, §D): real converter exports (tests/exports.py) and the bundled ViT
sample; exit 0, the tables in the text report, the analysed layers in report.json."""

from __future__ import annotations

import json
from pathlib import Path

import exports
import numpy as np
import pytest
from cli_helpers import run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]
BERT_FC1 = "/model/bert/encoder/layer.0/intermediate/dense/MatMul"


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return exports.digits_mlp(tmp_path_factory.mktemp("mlp"))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    export = exports.hf_bert(folder)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (24, 8))
    mask = np.ones_like(ids)
    mask[::3, 5:] = 0  # right padding
    np.savez(folder / "tokens.npz", input_ids=ids * mask, attention_mask=mask,
             labels=rng.integers(0, 3, 24))
    return export.path, folder / "tokens.npz"


def _report(out):
    return json.loads((out / "report.json").read_text()), (out / "report.txt").read_text()


def test_channels_on_the_mlp(mlp, tmp_path):
    model, data = mlp
    res = run("channels", model, "--data", data, "--out", tmp_path / "c")
    assert res.exit_code == 0, res.output
    report, text = _report(tmp_path / "c")
    section = report["channels"]
    assert [la["layer"] for la in section["layers"]] == ["MatMul"]  # the head is left out
    assert section["kinds"] == {"linear": 1} and section["layers"][0]["op_type"] == "MatMul"
    assert "analysed: 1 linear layer(s)" in text and "rho(I_X,I_T)" in text


def test_lesion_on_the_mlp(mlp, tmp_path):
    model, data = mlp
    res = run("lesion", model, "--layer", "MatMul", "--data", data, "--eval-data", data,
              "--substitute", "--out", tmp_path / "l")
    assert res.exit_code == 0, res.output
    report, text = _report(tmp_path / "l")
    rows = report["lesion"]["rows"]
    assert [r["channel"] for r in rows] == list(range(16))
    assert any(r["damage"] > 0 for r in rows) and "damage_test" in report["lesion"]
    assert "mean damage" in text and "which score predicts damage" in text


def test_channels_on_bert(bert, tmp_path):
    model, data = bert
    res = run("channels", model, "--data", data, "--out", tmp_path / "c")
    assert res.exit_code == 0, res.output
    report, text = _report(tmp_path / "c")
    layers = report["channels"]["layers"]
    assert len(layers) == 13 and report["channels"]["kinds"] == {"linear": 13}
    assert {la["normalization"] for la in layers[:12]} == {"layernorm"}
    assert all(la["n_above_floor"] is not None for la in layers)
    assert BERT_FC1 in text and "analysed: 13 linear layer(s)" in text


def test_lesion_and_substitution_on_bert(bert, tmp_path):
    model, data = bert
    res = run("lesion", model, "--layer", BERT_FC1, "--sample", 4, "--substitute",
              "--data", data, "--eval-data", data, "--out", tmp_path / "l")
    assert res.exit_code == 0, res.output
    report, text = _report(tmp_path / "l")
    rows = report["lesion"]["rows"]
    assert len(rows) == 4 and all(r["sub_damage"] is not None for r in rows)
    assert BERT_FC1 in text and "weights and bias zeroed" in text


def test_analyze_channel_section_on_bert(bert, tmp_path):
    model, data = bert
    res = run("analyze", model, "--data", data, "--out", tmp_path / "a")
    assert res.exit_code == 0, res.output
    report, text = _report(tmp_path / "a")
    section = report["channels"]
    assert "skipped" not in section and len(section["layers"]) == 13
    axes = section["layers"][0]["axes"]
    assert len(axes["input_capture"]) == len(axes["task_info"]) == 32
    assert "== Channels: two axes" in text


def test_channels_on_the_vit_sample_analyses_every_linear_layer(tmp_path):
    res = run("channels", ROOT / "models" / "vit" / "model.onnx", "--data",
              ROOT / "models" / "sample" / "calib.npz", "--limit", 128, "--out", tmp_path / "c")
    assert res.exit_code == 0, res.output
    report, text = _report(tmp_path / "c")
    section = report["channels"]
    assert section["kinds"] == {"conv": 1, "linear": 18} and len(section["layers"]) == 19
    assert all(la["op_type"] == "MatMul" for la in section["layers"][1:])
    assert "analysed: 1 conv layer(s) (Conv), 18 linear layer(s)" in text
