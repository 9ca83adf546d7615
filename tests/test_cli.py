"""CLI: help, happy paths on the bundled sample, and every user-error path (exit 1,
one-line message, no traceback, no partial output)."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from cli_helpers import assert_user_error, run

from onnxdiag.data.sample import get_sample

SAMPLE = get_sample()




@pytest.mark.parametrize("command", [[], ["analyze"], ["inspect"], ["readouts"], ["select"]])
def test_help(command):
    result = run(*command, "--help")
    assert result.exit_code == 0
    assert "Usage:" in result.output


def test_analyze_bundled_sample(tmp_path):
    out = tmp_path / "rep"
    result = run("analyze", "--out", out, "--limit", 256)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["schema"].startswith("onnxdiag.report/")
    meta = report["metadata"]
    assert meta["providers"] == ["CPUExecutionProvider"]
    assert "onnxruntime" in meta["onnxruntime"]["distributions"]
    assert len(meta["model_sha256"]) == 64
    assert len(meta["data"]["calibration"]["indices"]) == 256
    assert report["structure"]["head"]["n_classes"] == 10
    ro = report["readouts"]
    assert ro["head_rel_error"] < 1e-4
    assert ro["readouts"]["targets"] == "labels"
    assert 0.5 < ro["evaluation"]["accuracy"] <= 1.0
    text = (out / "report.txt").read_text()
    assert "== Structure ==" in text and "== Readouts (docs/METHODS.md §A) ==" in text
    assert "head_grad_feature" in result.output


def test_inspect_json_lists_layers_with_bn():
    result = run("inspect", SAMPLE.model, "--json")
    assert result.exit_code == 0
    structure = json.loads(result.output)
    convs = [la for la in structure["layers"] if la["op_type"] == "Conv"]
    assert convs and all(la["bn_node"] for la in convs)


def test_readouts_json_format(tmp_path):
    result = run("readouts", SAMPLE.model, "--data", SAMPLE.calibration, "--limit", 64,
                 "--targets", "pseudo", "--format", "json", "--out", tmp_path / "r")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["readouts"]["readouts"]["targets"] == "pseudo"


def test_select_reports_and_skips_a_broken_checkpoint(tmp_path):
    ckpts = sorted(SAMPLE.checkpoints.glob("*.onnx"))
    series = tmp_path / "series"
    series.mkdir()
    for i, c in enumerate(ckpts[-3:]):
        shutil.copy(c, series / f"ckpt_{i}.onnx")
    (series / "ckpt_3.onnx").write_bytes(b"not a model")
    result = run("select", series, "--data", SAMPLE.calibration, "--eval-data",
                 SAMPLE.evaluation, "--limit", 64, "--jobs", 1, "--out", tmp_path / "sel")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "sel" / "report.json").read_text())
    sel = report["selection"]
    assert sel["n_scored"] == 3
    assert [f["path"].endswith("ckpt_3.onnx") for f in sel["failed"]] == [True]
    assert "SKIPPED" in result.output and "not a valid ONNX file" in result.output
    assert sel["evaluation"]["oracle_overall"]["index"] in range(3)


# ----------------------------------------------------------------------------- user errors

def test_missing_model(tmp_path):
    out = tmp_path / "rep"
    assert_user_error(run("analyze", tmp_path / "nope.onnx", "--out", out), "does not exist", out)


def test_not_onnx_and_truncated(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00garbage" * 10)
    out = tmp_path / "rep"
    assert_user_error(run("analyze", bad, "--out", out), "not a valid ONNX", out)
    data = SAMPLE.model.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    result = run("analyze", bad, "--out", out)
    assert result.exit_code == 1 and not out.exists()


def test_no_linear_head(tmp_path):
    import corpus
    import onnx

    path = tmp_path / "nohead.onnx"
    onnx.save(corpus.no_linear_head(), path)
    assert_user_error(run("inspect", path), "--head NODE")


def _npz(tmp_path, name, **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("case, fragment", [
    ("shape", "expects"),
    ("name", "is not an input of the model"),
    ("nan", "NaN"),
    ("empty", "empty"),
    ("labels", "labels"),
])
def test_bad_data(tmp_path, case, fragment):
    x = np.random.default_rng(0).random((8, 1, 28, 28), dtype=np.float32)
    y = np.arange(8) % 10
    arrays = {
        "shape": dict(input=x[:, :, :20], labels=y),
        "name": dict(images=x, labels=y),
        "nan": dict(input=np.where(np.arange(8)[:, None, None, None] == 3, np.nan, x),
                    labels=y),
        "empty": dict(input=x[:0], labels=y[:0]),
        "labels": dict(input=x, labels=y[:5]),
    }[case]
    data = _npz(tmp_path, f"{case}.npz", **arrays)
    out = tmp_path / "rep"
    assert_user_error(run("analyze", SAMPLE.model, "--data", data, "--out", out), fragment, out)


def test_existing_report_folder_is_not_overwritten(tmp_path):
    out = tmp_path / "rep"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_user_error(run("analyze", "--out", out, "--limit", 8), "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"


def test_unwritable_output(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_user_error(run("analyze", "--out", blocker / "sub" / "rep", "--limit", 8),
                      "Cannot create output folder")


def test_console_script_exit_code_and_debug(tmp_path):
    """The installed entry point: exit 1 with one line; --debug shows the traceback."""
    cmd = [sys.executable, "-m", "onnxdiag.cli"]
    plain = subprocess.run(cmd + ["inspect", str(tmp_path / "x.onnx")], capture_output=True,
                           text=True)
    assert plain.returncode == 1
    assert plain.stderr.strip().count("\n") == 0 and "Traceback" not in plain.stderr
    debug = subprocess.run(cmd + ["--debug", "inspect", str(tmp_path / "x.onnx")],
                           capture_output=True, text=True)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_format_csv_matches_the_json_report(tmp_path):
    import csv
    import io

    sample = get_sample()
    args = ["readouts", sample.model, "--data", sample.calibration, "--limit", 80]
    res = run(*args, "--format", "csv", "--out", tmp_path / "csv")
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    report = json.loads((tmp_path / "csv" / "report.json").read_text())
    values = report["readouts"]["readouts"]["values"]
    assert len(rows) == 1 and rows[0]["model"] == str(sample.model)
    for name, v in values.items():
        assert float(rows[0][name]) == pytest.approx(v, rel=1e-12)
    assert (tmp_path / "csv" / "readouts.csv").read_text() == res.stdout


def test_format_csv_without_a_table_is_a_user_error(tmp_path):
    res = run("analyze", get_sample().model, "--format", "csv", "--out", tmp_path / "r")
    assert_user_error(res, "no table to print as CSV")


def test_every_report_folder_holds_its_main_table_as_csv(tmp_path):
    sample = get_sample()
    out = tmp_path / "ch"
    res = run("channels", sample.model, "--data", sample.calibration, "--limit", 60,
              "--format", "csv", "--out", out)
    assert res.exit_code == 0, res.output
    assert (out / "channels.csv").read_text() == res.stdout
    header = res.stdout.splitlines()[0].split(",")
    assert header[:2] == ["layer", "channel"] and "task_info" in header
    report = json.loads((out / "report.json").read_text())
    n_channels = sum(layer["n_channels"] for layer in report["channels"]["layers"])
    assert len(res.stdout.splitlines()) == 1 + n_channels


def test_outputs_get_the_usual_permissions(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        sample = get_sample()
        res = run("prune", sample.model, "--data", sample.calibration, "--limit", 40,
                  "--sparsity", 0.5, "--allocation", "erk", "--repair", "bn",
                  "-o", tmp_path / "p.onnx", "--out", tmp_path / "r")
        assert res.exit_code == 0, res.output
    finally:
        os.umask(old)
    for path, mode in [(tmp_path / "r", 0o755), (tmp_path / "r" / "report.json", 0o644),
                       (tmp_path / "p.onnx", 0o644), (tmp_path / "p.onnx.json", 0o644)]:
        assert stat.S_IMODE(path.stat().st_mode) == mode, path


def test_no_help_text_prints_a_doubled_percent_sign():
    """click prints help verbatim: a ``%%`` written for %-formatting shows as is."""
    from onnxdiag.cli import COMMANDS

    for command in [None, *COMMANDS]:
        result = run(*([command] if command else []), "--help")
        assert result.exit_code == 0, result.output
        assert "%%" not in result.output, command


def test_verbose_is_a_group_option_and_does_not_leak(monkeypatch):
    import os

    monkeypatch.delenv("ONNXDIAG_VERBOSE", raising=False)
    assert "-v, --verbose" in run("--help").output
    result = run("-vv", "inspect", "--json")
    assert result.exit_code == 0, result.output
    assert "ONNXDIAG_VERBOSE" not in os.environ  # restored after the command


def test_every_report_records_the_runtime_and_providers(tmp_path):
    """README: every report states the ONNX Runtime distribution and the providers in use."""
    import json

    from onnxdiag.data.sample import get_sample

    s = get_sample()
    runs = {"channels": [s.model, "--data", s.calibration, "--limit", 64],
            "lesion": [s.model, "--layer", "/stem/stem.0/Conv", "--sample", 1, "--eval-data",
                       s.evaluation],
            "prune": [s.model, "--sparsity", 0.5, "--data", s.calibration, "--limit", 64,
                      "-o", tmp_path / "p.onnx"]}
    for verb, args in runs.items():
        result = run(verb, *args, "--providers", "cpu", "--out", tmp_path / verb)
        assert result.exit_code == 0, result.output
        meta = json.loads((tmp_path / verb / "report.json").read_text())["metadata"]
        assert meta["providers"] == ["CPUExecutionProvider"], verb
        assert meta["onnxruntime"]["version"], verb
