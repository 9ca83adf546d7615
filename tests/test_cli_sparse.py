"""CLI of the METHODS §C verbs: rr, prune, sweep — help, happy paths, user errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from cli_helpers import assert_user_error, run
from corpus import residual_block
from exports import digits_mlp

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
    from onnxdiag.cli import options
    from onnxdiag.runtime import latency

    assert cli_sparse.RULE_CHOICES == RULES and cli_sparse.REPAIR_CHOICES == METHODS
    assert (options.LATENCY_BUDGET_S, options.MIN_ROUNDS) == (latency.LATENCY_BUDGET_S,
                                                              latency.MIN_ROUNDS)


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
    assert info["accuracy"]["source"]["n_samples"] == 2000
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
    assert params["pruner"]["rr_positions"] == (value if expected is None else expected)
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


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return digits_mlp(tmp_path_factory.mktemp("cli_mlp"))


def test_prune_of_an_skl2onnx_mlp_prunes_every_layer(mlp, tmp_path):
    """Issue 16: no refusal any more; S = 0.5 removes 592 of the 1,184 weights."""
    model, data = mlp
    out = tmp_path / "p.onnx"
    result = run("prune", model, "--sparsity", 0.5, "--data", data, "-o", out,
                 "--out", tmp_path / "rep", "--format", "json", "--latency-budget", 0)
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)["prune"]
    assert (info["n_pruned"], info["n_weights"]) == (592, 1184)
    # a zero latency budget times the floor of rounds at each batch size
    assert info["latency_ms"]["budget_s"] == 0 and info["latency_ms"]["rounds_run"] == {
        "1": 5, "32": 5}
    assert sorted(info["layer_sparsity"]) == ["MatMul", "MatMul1"] and out.exists()


def test_prune_of_a_model_without_a_prunable_layer_is_refused_in_one_line(tmp_path):
    """The one refusal left: no Conv / Gemm / MatMul with a constant weight (here the
    head's weight is computed by a Transpose)."""
    from corpus import identity_transpose_weights

    model = tmp_path / "m.onnx"
    onnx.save(identity_transpose_weights(), model)
    data = tmp_path / "d.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
    out = tmp_path / "p.onnx"
    result = run("prune", model, "--sparsity", 0.5, "--data", data, "-o", out,
                 "--out", tmp_path / "rep")
    assert_user_error(result, "The model has no prunable layer (a Conv, Gemm or MatMul with "
                      "a constant weight)", out, tmp_path / "p.onnx.json", tmp_path / "rep")


def test_prune_sparsity_zero_is_a_reported_no_op(mlp, tmp_path):
    model, data = mlp
    out = tmp_path / "p.onnx"
    result = run("prune", model, "--sparsity", 0, "--data", data, "-o", out,
                 "--out", tmp_path / "rep", "--format", "json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)["prune"]
    assert info["no_op"] == "sparsity 0 removes no weight" and info["n_pruned"] == 0
    assert "no-op" in info["notes"][0]
    assert "Pruning nothing: sparsity 0 removes no weight" in result.stderr
    text = (tmp_path / "rep" / "report.txt").read_text()
    assert "NO-OP: sparsity 0 removes no weight; the emitted model is the source model" in text
    assert json.loads((tmp_path / "p.onnx.json").read_text())["no_op"] == info["no_op"]


def test_cli_sparse_imports_neither_numpy_nor_onnx():
    """cli/sparse.py (with the option groups) imports and prints every --help with numpy,
    onnx and onnxruntime blocked; the verb modules load only when a command runs."""
    import subprocess
    import sys

    code = """
import sys, types, click
from pathlib import Path
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('numpy', 'onnx', 'onnxruntime'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
import onnxdiag
pkg = types.ModuleType('onnxdiag.cli')
pkg.__path__ = [str(Path(onnxdiag.__file__).parent / 'cli')]
pkg.cli = click.Group('cli')
sys.modules['onnxdiag.cli'] = pkg
from click.testing import CliRunner
import onnxdiag.cli.sparse
for name in sorted(pkg.cli.commands):
    res = CliRunner().invoke(pkg.cli, [name, '--help'])
    assert res.exit_code == 0 and 'Usage:' in res.output, res.output
print(sorted(pkg.cli.commands))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['prune',", "'rr',", "'sweep']"]


@pytest.mark.parametrize("rr_images, dense_passes", [(32, 0), (16, 1)])
def test_prune_takes_the_dense_moments_from_the_rr_capture_on_the_same_images(
        corpus_files, tmp_path, rr_images, dense_passes):
    """RR on every calibration image (32 here) also gives the repair its dense moments:
    the report's repair ran no dense pass of its own; on fewer images it runs one."""
    result = run("prune", corpus_files / "res.onnx", "--data", corpus_files / "calib.npz",
                 "--sparsity", 0.7, "--allocation", "rr", "--repair", "cr+bn",
                 "--rr-images", rr_images, "-o", tmp_path / "p.onnx", "--out",
                 tmp_path / "rep", "--format", "json")
    assert result.exit_code == 0, result.output
    repair = json.loads(result.stdout)["prune"]["repair"]
    assert repair["passes"]["dense"] == dense_passes and repair["n_images"] == 32
