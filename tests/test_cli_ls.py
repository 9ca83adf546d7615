"""CLI of the reconstruction repair (docs/METHODS.md §E1): ``prune --repair ls`` on the
bundled sample, ``sweep`` with the ls repairs, and the options' user errors."""

from __future__ import annotations

import json

import onnx
from cli_helpers import run

from onnxdiag.data.sample import get_sample
from onnxdiag.model.io import file_hash

SAMPLE = get_sample()


def _prune(tmp_path, repair, S=0.9):
    out = tmp_path / f"{repair}.onnx"
    result = run("prune", SAMPLE.model, "--sparsity", S, "--allocation", "erk", "--repair",
                 repair, "--data", SAMPLE.calibration, "--eval-data", SAMPLE.evaluation,
                 "--limit", 256, "-o", out, "--out", tmp_path / f"rep-{repair}",
                 "--format", "json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)["prune"]


def test_prune_repair_ls_on_the_bundled_sample_beats_no_repair(tmp_path):
    """S = 0.9 (ERK): the emitted model passes the checks, its sidecar records every
    refitted layer with a lower output error than before, and agreement with the dense
    model and top-1 on the eval data both rise over --repair none."""
    before = file_hash(SAMPLE.model)
    out, ls = _prune(tmp_path, "ls")
    _, none = _prune(tmp_path, "none")
    assert file_hash(SAMPLE.model) == before
    onnx.checker.check_model(onnx.load(out), full_check=True)
    assert ls["checks"]["onnxruntime_load"] and ls["checks"]["max_abs_output_diff"] < 1e-4
    sidecar = json.loads((tmp_path / "ls.onnx.json").read_text())
    rep = sidecar["repair"]
    assert rep["method"] == "ls" and rep["ls"]["ridge"] == 0.01 and rep["ls"]["prior"] == "weights"
    assert len(rep["layers"]) >= 5 and "/fc/Gemm" in rep["layers"]  # the head is refitted too
    for rec in rep["layers"].values():
        assert rec["error_after"] < rec["error_before"] and rec["solver"] == "exact"
    assert ls["sparsity_achieved"] == none["sparsity_achieved"]
    assert ls["agreement"]["top1_agreement"] > none["agreement"]["top1_agreement"] + 0.1
    assert ls["accuracy"]["emitted"]["accuracy"] > none["accuracy"]["emitted"]["accuracy"] + 0.1
    text = (tmp_path / "rep-ls" / "report.txt").read_text()
    assert "LS reconstruction: relative output error" in text and "err_after" in text


def test_sweep_lists_the_ls_repairs_beside_bn(tmp_path):
    out = tmp_path / "rep"
    result = run("sweep", SAMPLE.model, "--sparsity", "0.8", "--allocations", "erk",
                 "--repairs", "none,bn,ls,ls+bn", "--data", SAMPLE.calibration, "--limit", 64,
                 "--out", out, "--format", "json")
    assert result.exit_code == 0, result.output
    cells = {c["repair"]: c for c in json.loads(result.stdout)["sweep"]["cells"]}
    assert set(cells) == {"none", "bn", "ls", "ls+bn"}
    assert cells["ls"]["agreement"] > cells["none"]["agreement"]
    assert "== agreement % after repair ls+bn" in (out / "report.txt").read_text()


def test_ls_options_are_checked_by_click(tmp_path):
    result = run("prune", SAMPLE.model, "--sparsity", 0.5, "--repair", "ls", "--ls-ridge", 0,
                 "--data", SAMPLE.calibration, "-o", tmp_path / "p.onnx")
    assert result.exit_code == 2 and "--ls-ridge" in result.output
    assert not (tmp_path / "p.onnx").exists()


def test_prune_ls_inputs_dense_records_one_dense_pass(tmp_path):
    """``--ls-inputs dense --ls-positions 8``: the sidecar records the settings, one dense
    pass and no sequential one, and every pruned layer's error falls; a bad choice is a
    click error naming the option."""
    out = tmp_path / "d.onnx"
    result = run("prune", SAMPLE.model, "--sparsity", 0.8, "--allocation", "erk", "--repair",
                 "ls", "--ls-inputs", "dense", "--ls-positions", 8, "--data",
                 SAMPLE.calibration, "--limit", 128, "-o", out, "--out", tmp_path / "rep",
                 "--format", "json")
    assert result.exit_code == 0, result.output
    rep = json.loads((tmp_path / "d.onnx.json").read_text())["repair"]
    assert rep["ls"]["inputs"] == "dense" and rep["ls"]["positions"] == 8
    assert rep["passes"] == {"dense": 1, "sequential": 0, "segments": 0}
    assert rep["layers"] and all(r["error_after"] < r["error_before"]
                                 for r in rep["layers"].values())
    bad = run("prune", SAMPLE.model, "--sparsity", 0.5, "--repair", "ls", "--ls-inputs",
              "both", "--data", SAMPLE.calibration, "-o", tmp_path / "p.onnx")
    assert bad.exit_code == 2 and "--ls-inputs" in bad.output
