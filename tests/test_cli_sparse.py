"""CLI of the SPEC C verbs: rr, prune, sweep — help, happy paths, user errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from cli_helpers import assert_user_error, run
from corpus import residual_block

from onnxdiag.cli import sparse as cli_sparse
from onnxdiag.data.sample import get_sample
from onnxdiag.model.io import file_hash
from onnxdiag.sparsity import METHODS, RULES

SAMPLE = get_sample()




@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_sparse")
    onnx.save(residual_block(), d / "res.onnx")
    rng = np.random.default_rng(0)
    np.savez(d / "calib.npz", x=rng.standard_normal((32, 3, 8, 8)).astype(np.float32))
    return d


def test_cli_choices_match_the_library():
    assert cli_sparse.RULE_CHOICES == RULES and cli_sparse.REPAIR_CHOICES == METHODS


@pytest.mark.parametrize("command", ["rr", "prune", "sweep"])
def test_help(command):
    result = run(command, "--help")
    assert result.exit_code == 0 and "Usage:" in result.output and "--keep-dense" in result.output


def test_rr_on_a_corpus_model(corpus_files, tmp_path):
    out = tmp_path / "rep"
    result = run("rr", corpus_files / "res.onnx", "--data", corpus_files / "calib.npz",
                 "--rr-images", 16, "--band-sparsity", "0.5,0.9", "--out", out)
    assert result.exit_code == 0, result.output
    assert "Relative repairability" in result.stdout and "RR 0.9" in result.stdout
    assert "[4/4] S=0.9 rr bn" in result.stderr  # progress lines go to stderr
    report = json.loads((out / "report.json").read_text())
    assert report["metadata"]["command"] == "rr"
    assert report["metadata"]["parameters"]["defaults"]["rr_images"] == 64
    assert (out / "rr_curves.csv").exists() and (out / "transition.csv").exists()


def test_prune_bundled_sample(tmp_path):
    out = tmp_path / "pruned.onnx"
    before = file_hash(SAMPLE.model)
    result = run("prune", SAMPLE.model, "--sparsity", 0.5, "--allocation", "rr", "--repair",
                 "cr+bn", "--data", SAMPLE.calibration, "--eval-data", SAMPLE.evaluation,
                 "--limit", 128, "--keep-dense", "/stem/stem.0/Conv", "-o", out,
                 "--out", tmp_path / "rep", "--format", "json")
    assert result.exit_code == 0, result.output
    assert file_hash(SAMPLE.model) == before
    report = json.loads(result.stdout)
    info = report["prune"]
    assert info["layer_sparsity"]["/stem/stem.0/Conv"] == 0.0
    assert info["sparsity_achieved"] == pytest.approx(0.5, abs=1e-4)
    assert info["accuracy_dense"]["n_samples"] == 2000
    onnx.checker.check_model(onnx.load(out), full_check=True)
    assert (tmp_path / "pruned.onnx.json").exists() and (tmp_path / "rep" / "report.txt").exists()


def test_sweep_bundled_sample(tmp_path):
    out = tmp_path / "rep"
    result = run("sweep", SAMPLE.model, "--sparsity", "0.3:0.5:0.2", "--allocations",
                 "erk,rr", "--repairs", "cr+bn,bn", "--data", SAMPLE.calibration,
                 "--eval-data", SAMPLE.evaluation, "--limit", 64, "--rr-images", 32,
                 "--out", out)
    assert result.exit_code == 0, result.output
    assert "== top-1 % after repair cr+bn" in result.stdout
    assert "rr - erk (cr+bn)" in result.stdout
    assert "[8/8] S=0.5 rr bn" in result.stderr
    lines = (out / "sweep.csv").read_text().strip().splitlines()
    assert lines[0].startswith("sparsity,allocation,repair,agreement,accuracy") and len(lines) == 9


def test_prune_refuses_to_overwrite_the_input(tmp_path):
    model = tmp_path / "m.onnx"
    shutil.copy(SAMPLE.model, model)
    before = file_hash(model)
    result = run("prune", model, "--sparsity", 0.5, "--data", SAMPLE.calibration, "--limit",
                 16, "-o", model, "--overwrite", "--out", tmp_path / "rep")
    assert_user_error(result, "never overwrites an input", tmp_path / "rep",
                      tmp_path / "m.onnx.json")
    assert file_hash(model) == before


def test_prune_refuses_an_existing_output_without_overwrite(tmp_path):
    out = tmp_path / "p.onnx"
    out.write_bytes(b"old")
    result = run("prune", SAMPLE.model, "--sparsity", 0.5, "--data", SAMPLE.calibration,
                 "--limit", 16, "-o", out, "--out", tmp_path / "rep")
    assert_user_error(result, "already exists; choose another -o or pass --overwrite",
                      tmp_path / "rep", tmp_path / "p.onnx.json")
    assert out.read_bytes() == b"old"


@pytest.mark.parametrize("args, fragment", [
    (["sweep", "--sparsity", "0.9:0.97", "--allocations", "erk"], "needs start:stop:step"),
    (["sweep", "--sparsity", "0.9", "--allocations", "erk,magic"], "Unknown allocation 'magic'"),
    (["sweep", "--sparsity", "0.9", "--repairs", "cr+bn,crbn"], "Unknown repair 'crbn'"),
    (["sweep", "--sparsity", "1.5"], "outside [0, 1)"),
    (["rr", "--keep-dense", "/nope/Conv"], "--keep-dense names '/nope/Conv'"),
    (["rr", "--band-sparsity", "0.5:x:0.1"], "not a number"),
])
def test_user_errors(tmp_path, args, fragment):
    out = tmp_path / "rep"
    command, rest = args[0], args[1:]
    result = run(command, SAMPLE.model, *rest, "--data", SAMPLE.calibration, "--limit", 16,
                 "--out", out)
    assert_user_error(result, fragment, out)


def test_prune_lamp_beyond_its_limit_is_a_user_error(corpus_files, tmp_path):
    out = tmp_path / "p.onnx"
    result = run("prune", corpus_files / "res.onnx", "--sparsity", 1.0, "--allocation", "lamp",
                 "--data", corpus_files / "calib.npz", "-o", out, "--out", tmp_path / "rep")
    assert_user_error(result, "LAMP keeps each layer's largest weight", out, tmp_path / "rep")


def test_rr_format_csv_prints_the_curves(corpus_files, tmp_path):
    result = run("rr", corpus_files / "res.onnx", "--data", corpus_files / "calib.npz",
                 "--rr-images", 8, "--band-sparsity", "none", "--grid", "0,0.5,0.9",
                 "--format", "csv", "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "layer,sparsity,d_raw,d_repair,rr"
    assert len(lines) == 1 + 7 * 3  # 6 convs + the head, 3 grid points
    assert not (tmp_path / "rep" / "transition.csv").exists()


@pytest.mark.parametrize("value, expected", [("all", None), ("5", 5)])
def test_rr_positions_option(corpus_files, tmp_path, value, expected):
    out = tmp_path / "rep"
    result = run("rr", corpus_files / "res.onnx", "--data", corpus_files / "calib.npz",
                 "--rr-images", 8, "--rr-positions", value, "--band-sparsity", "none",
                 "--grid", "0,0.5,0.9", "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    params = report["metadata"]["parameters"]
    assert params["rr_positions"] == (value if expected is None else expected)
    assert params["defaults"]["rr_positions"] == 16
    curves = report["repairability"]["curves"]
    assert curves["positions"] == expected
    # the stem sees 8x8 = 64 output positions per image: all of them, or 5 sampled
    assert curves["n_samples"][0] == 8 * (64 if expected is None else expected)


def test_rr_positions_rejects_non_positive(corpus_files, tmp_path):
    result = run("rr", corpus_files / "res.onnx", "--data", corpus_files / "calib.npz",
                 "--rr-positions", "0", "--out", tmp_path / "rep")
    assert result.exit_code == 2 and "positive integer or 'all'" in result.output
    assert not (tmp_path / "rep").exists()
