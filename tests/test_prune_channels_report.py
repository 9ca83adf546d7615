"""prune-channels' report in the shared vocabulary (section = sidecar, schema, every
option echoed), the CLI's literal choices, ``--help`` without numpy/onnx, and issue 15:
``--features`` honoured on a head that must be named, ``--ratio 0`` refused, and a plan
that removes nothing saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields

import click
import corpus
import numpy as np
import onnx
import pytest
from cli_helpers import assert_user_error, run
from onnx import numpy_helper
from structured_data import write_named, write_tiny

import onnxdiag.commands.prune_channels as prune_channels
from onnxdiag.model.io import save_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    return (folder, *write_tiny(folder))


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    folder = tmp_path_factory.mktemp("named")
    return (folder, *write_named(folder))


def test_prune_channels_section_is_its_sidecar_in_the_shared_vocabulary(tiny, tmp_path):
    """The report section and the sidecar hold the same facts under the shared keys; the
    report validates against the published schema; every option is echoed."""
    from onnxdiag.commands.channel_pruning import Recovery
    from onnxdiag.commands.prune_channels import ChannelPruneOptions

    folder, model, data = tiny
    out = tmp_path / "small.onnx"
    result = run("prune-channels", model, "--score", "magnitude", "--eval-data", data, "-o",
                 out, "--out", tmp_path / "rep", "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    section, side = report["prune_channels"], json.loads((tmp_path / "small.onnx.json").read_text())
    assert section == side
    small = onnx.load(out)
    n = sum(int(np.prod(t.dims)) for t in small.graph.initializer)
    assert section["emitted"] == {**section["emitted"], "path": str(out),
                                  "file_bytes": os.path.getsize(out), "params": n}
    assert section["source"]["sha256"] == report["metadata"]["model_sha256"]
    assert section["source"]["file_bytes"] == os.path.getsize(model)
    assert section["source"]["params"] > section["emitted"]["params"]
    assert section["checks"]["full_checker"] == "passed"
    assert section["checks"]["max_abs_output_diff"] <= 1e-6  # reloaded bytes = in memory
    lat = section["latency_ms"]
    assert lat["providers"] == "cpu" and set(lat["speedup"]) == {"1", "32"}
    assert lat["speedup"]["32"] == pytest.approx(lat["source"]["32"] / lat["emitted"]["32"])
    assert section["comparison"]["data"] == "evaluation"
    assert section["accuracy"]["before_recovery"] is None  # no recovery asked for
    assert 0 <= section["accuracy"]["emitted"]["accuracy"] <= 1
    assert section["nothing_removed"] is None
    meta = report["metadata"]
    assert set(meta["data"]) == {"evaluation"}
    params = meta["parameters"]
    assert {f.name for f in fields(ChannelPruneOptions)} <= set(params)
    assert params["recovery"] == {f.name: f.default for f in fields(Recovery)}
    assert params["eval_data"]["source"] == str(data) and params["data"] is None
    pytest.importorskip("jsonschema")
    from onnxdiag.report.schema import validate_report

    validate_report(report)


def test_cli_choices_and_defaults_are_the_librarys():
    """cli/structured.py keeps literal copies (no numpy at import): they equal the library's."""
    from onnxdiag.cli import structured as cli_structured
    from onnxdiag.commands import prune_sweep
    from onnxdiag.commands.channel_pruning import Recovery
    from onnxdiag.commands.prune_channels import ChannelPruneOptions
    from onnxdiag.structured import choice, plan

    assert cli_structured.SCORES == choice.SCORES
    assert cli_structured.TARGETS == choice.TARGETS
    assert (cli_structured.DEFAULT_ALPHA, cli_structured.DEFAULT_BETA) == (
        choice.DEFAULT_ALPHA, choice.DEFAULT_BETA)
    assert cli_structured.BUDGETS == plan.BUDGETS == prune_sweep.SWEEP_BUDGETS
    assert cli_structured.DEFAULT_RATIOS == prune_sweep.DEFAULT_RATIOS
    assert cli_structured.RECOVERY == tuple(f.name for f in fields(Recovery))
    for command, record in ((cli_structured.prune_channels_cmd, ChannelPruneOptions),
                            (cli_structured.prune_sweep_cmd, prune_sweep.PruneSweepOptions),
                            (cli_structured.prune_sweep_cmd, Recovery)):
        ctx = click.Context(command)
        defaults = {p.name: p.get_default(ctx) for p in command.params}
        for f in fields(record):
            if f.name in defaults and f.name not in ("ratios", "scores"):
                assert defaults[f.name] == f.default, (command.name, f.name)
    assert prune_sweep.PruneSweepOptions().scores == choice.SCORES


def test_structured_help_imports_neither_numpy_nor_onnx():
    code = """
import sys, types
for name in ("channels", "readouts", "sparse"):  # other families: their own tests
    sys.modules["onnxdiag.cli." + name] = types.ModuleType("onnxdiag.cli." + name)
from click.testing import CliRunner
from onnxdiag.cli import cli
for verb in ("prune-channels", "prune-sweep"):
    result = CliRunner().invoke(cli, [verb, "--help"])
    assert result.exit_code == 0, result.output
print(sorted(m for m in ("numpy", "onnx", "onnxruntime") if m in sys.modules))
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


# -- issue 15: --features, --ratio 0, nothing removed ------------------------------------------
def test_prune_channels_honours_features_on_a_head_that_must_be_named(named, tmp_path):
    """A head found only with --head and --features: the plan, the statistics, the pruned
    model's analysis and the plan replay all use the named features, and the pruned model
    equals the source with the removed channels zeroed (their BN output set to 0)."""
    folder, model, data = named
    base = ["prune-channels", model, "--head", "head", "--features", "feat"]
    out, plan = tmp_path / "small.onnx", tmp_path / "plan.json"
    result = run(*base, "--score", "magnitude", "--eval-data", data, "-o", out,
                 "--plan-out", plan, "--out", tmp_path / "rep", "--format", "json")
    assert result.exit_code == 0, result.output
    section = json.loads(result.stdout)["prune_channels"]
    assert section["record"]["widths"] == {"c0": [8, 4]}
    assert section["accuracy"]["emitted"]["n_samples"] == 96
    saved = json.loads(plan.read_text())
    assert (saved["head"], saved["features"]) == ("head", "feat")
    source = onnx.load(model)
    zeroed = onnx.ModelProto()
    zeroed.CopyFrom(source)
    removed = saved["removed"]["0"]
    for init in zeroed.graph.initializer:
        if init.name in ("c0_bn.scale", "c0_bn.bias"):
            value = numpy_helper.to_array(init).copy()
            value[removed] = 0
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    x = {"x": np.load(data)["x"][:16]}
    np.testing.assert_allclose(corpus.run_ort(onnx.load(out), x)["logits"],
                               corpus.run_ort(zeroed, x)["logits"], rtol=1e-5, atol=1e-5)
    again = run("prune-channels", model, "--plan", plan, "-o", tmp_path / "again.onnx",
                "--out", tmp_path / "rep2")  # the plan carries the head and its features
    assert again.exit_code == 0, again.output
    assert (tmp_path / "again.onnx").read_bytes() == out.read_bytes()
    stats = run(*base, "--score", "ix", "--data", data, "--recalibrate-bn", "--eval-data", data,
                "-o", tmp_path / "ix.onnx", "--out", tmp_path / "rep3")
    assert stats.exit_code == 0, stats.output
    sweep = run("prune-sweep", model, "--head", "head", "--features", "feat", "--ratios", "0.5",
                "--scores", "magnitude,ix", "--data", data, "--eval-data", data,
                "--recalibrate-bn", "--out", tmp_path / "sw", "--format", "json")
    assert sweep.exit_code == 0, sweep.output
    rows = json.loads(sweep.stdout)["prune_sweep"]["rows"]
    assert all(r["channels_removed"] == 4 and r["accuracy_after"] is not None for r in rows)


def test_ratio_zero_is_refused(tiny, tmp_path):
    folder, model, data = tiny
    out, rep = tmp_path / "x.onnx", tmp_path / "rep"
    assert_user_error(run("prune-channels", model, "--ratio", 0, "--score", "magnitude",
                          "-o", out, "--out", rep),
                      "--ratio 0 removes no channel and would write the model unchanged", out,
                      rep)


def test_nothing_removable_says_why_and_skips_the_statistics(tmp_path, monkeypatch):
    """A model whose only layer is the head: a reported no-op, the reason in the text and
    the JSON, and no statistics pass (its result could not change anything)."""
    model = save_model(corpus.gemm_head(), tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((32, 16)).astype(np.float32),
             labels=rng.integers(0, corpus.N_CLASSES, 32))

    def no_pass(*args, **kwargs):
        raise AssertionError("the statistics pass must be skipped")

    monkeypatch.setattr(prune_channels, "stat_scores", no_pass)
    result = run("prune-channels", model, "--score", "ix", "--data", tmp_path / "d.npz",
                 "-o", tmp_path / "s.onnx", "--out", tmp_path / "rep", "--format", "json")
    assert result.exit_code == 0, result.output
    why = json.loads(result.stdout)["prune_channels"]["nothing_removed"]
    assert why.startswith("no channel group can be pruned") and "output channels are the " \
        "classes" in why
    text = (tmp_path / "rep" / "report.txt").read_text()
    assert "0 of 0 channels removed" in text and f"note: nothing removed: {why}" in text
    assert_user_error(run("prune-sweep", model, "--scores", "magnitude", "--eval-data",
                          tmp_path / "d.npz", "--out", tmp_path / "sw"),
                      "nothing to compare: no channel group can be pruned", tmp_path / "sw")


@pytest.mark.parametrize("args, why", [
    (["--ratio", 0.05], "every prunable group is too narrow: the widest has 16 channels); a "
                        "ratio of at least 0.0625 removes one"),
    (["--ratio", 0.25, "--round-to", 16], "--round-to 16 rounds the kept count of every "
                                          "narrowed group up to its full width"),
])
def test_a_plan_that_removes_nothing_says_why(tiny, tmp_path, args, why):
    folder, model, data = tiny
    result = run("prune-channels", model, "--score", "magnitude", *args, "-o",
                 tmp_path / "s.onnx", "--out", tmp_path / "rep", "--format", "json")
    assert result.exit_code == 0, result.output
    section = json.loads(result.stdout)["prune_channels"]
    assert why in section["nothing_removed"] and section["plan"]["n_channels"]
    assert not any(section["plan"]["removed"].values())
    assert why in (tmp_path / "rep" / "report.txt").read_text()
