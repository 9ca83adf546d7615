"""CLI for structured pruning (METHODS §B6): prune-channels and prune-sweep on tiny corpus
models — outputs, plan replay to the same bytes, refusals (exit 1, one line, nothing
written), the sweep's FLOPs matching, normalised AUC and one statistics pass per sweep.

Tests whose name contains "finetune" and need onnxruntime.training run in CI's training
environment (``.ci/run``) and skip in the main one."""

from __future__ import annotations

import json
import os
import sys

import corpus
import numpy as np
import onnx
import pytest
from cli_helpers import assert_user_error, run
from structured_data import write_named, write_tiny

import onnxdiag.commands.prune_sweep as prune_report
from onnxdiag.commands.prune_sweep import normalized_auc
from onnxdiag.model.io import save_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """residual_block saved to disk with learnable labelled data (labels = argmax of a fixed
    projection of the channel means)."""
    folder = tmp_path_factory.mktemp("tiny")
    return (folder, *write_tiny(folder))


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    """named_head_model (its head needs --head head --features feat) with labelled data."""
    folder = tmp_path_factory.mktemp("named")
    return (folder, *write_named(folder))


def test_help_lists_the_options():
    for verb, option in (("prune-channels", "--plan-out"), ("prune-sweep", "--ratios")):
        result = run(verb, "--help")
        assert result.exit_code == 0 and option in result.output and "--finetune" in result.output


def test_prune_channels_writes_a_smaller_model_sidecar_and_plan(tiny, tmp_path):
    folder, model, data = tiny
    out = tmp_path / "small.onnx"
    result = run("prune-channels", model, "--ratio", 0.5, "--score", "two_axis", "--data", data,
                 "--eval-data", data, "-o", out, "--plan-out", tmp_path / "plan.json",
                 "--out", tmp_path / "rep", "--format", "json", "--latency-budget", 0.5)
    assert result.exit_code == 0, result.output
    small = onnx.load(out)
    onnx.checker.check_model(small, full_check=True)
    big = onnx.load(model)
    n = lambda m: sum(int(np.prod(t.dims)) for t in m.graph.initializer)  # noqa: E731
    assert n(small) < n(big)
    feeds = corpus.random_feeds(big, batch=2)
    assert corpus.run_ort(small, feeds)["logits"].shape == (2, corpus.N_CLASSES)
    side = json.loads((tmp_path / "small.onnx.json").read_text())
    assert 0 < side["flops_ratio"] < 1 and 0 < side["params_ratio"] < 1
    assert set(side["latency_ms"]["emitted"]) == {"1", "32"}
    assert side["latency_ms"]["budget_s"] == 0.5 and side["latency_ms"]["threads"] == 1
    assert all(5 <= n <= 21 for n in side["latency_ms"]["rounds_run"].values())
    assert side["accuracy"]["source"]["accuracy"] is not None
    assert side["plan"]["score"] == "two_axis" and side["emitted"]["file_bytes"] > 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["schema"].startswith("onnxdiag.plan/")
    for gid, chans in plan["removed"].items():  # uniform: ⌊0.5·n⌋ per group
        assert len(chans) == plan["n_channels"][gid] // 2
    report = json.loads(result.stdout)
    assert report["prune_channels"]["file_size_ratio"] < 1
    assert (tmp_path / "rep" / "report.txt").is_file()


def test_plan_replays_to_the_same_bytes_and_only_on_its_model(tiny, tmp_path):
    folder, model, data = tiny
    first, again = tmp_path / "a.onnx", tmp_path / "b.onnx"
    plan = tmp_path / "plan.json"
    assert run("prune-channels", model, "--ratio", 0.5, "--score", "ix", "--data", data,
               "-o", first, "--plan-out", plan, "--out", tmp_path / "r1").exit_code == 0
    # replay needs neither data nor the score: the plan says which channels
    result = run("prune-channels", model, "--plan", plan, "-o", again, "--out", tmp_path / "r2")
    assert result.exit_code == 0, result.output
    assert first.read_bytes() == again.read_bytes()
    # another checkpoint of the architecture (same topology hash): the plan transfers
    # (docs/METHODS.md §A5); another architecture is refused before anything is written
    other = save_model(corpus.residual_block(seed=1), tmp_path / "other.onnx")
    result = run("prune-channels", other, "--plan", plan, "-o", tmp_path / "c.onnx",
                 "--out", tmp_path / "r3")
    assert result.exit_code == 0 and "plan transferred" in result.output, result.output
    foreign = save_model(corpus.concat_block(), tmp_path / "foreign.onnx")
    assert_user_error(run("prune-channels", foreign, "--plan", plan, "-o", tmp_path / "d.onnx",
                          "--out", tmp_path / "r4"),
                      "another architecture", tmp_path / "d.onnx", tmp_path / "r4")


def test_emitted_model_folds_bn_by_default_and_equals_the_unfolded_one(tiny, tmp_path):
    """Default: no BatchNormalization left in the emitted model, its logits equal the
    --no-fold-bn model's to 1e-5 relative, the sidecar lists the folded pairs and the
    check against the unfolded model, and both settings replay their plan to the same
    bytes; the report gives the max |Δlogit| against the source."""
    folder, model, data = tiny
    plan = tmp_path / "plan.json"
    folded, kept = tmp_path / "f.onnx", tmp_path / "k.onnx"
    result = run("prune-channels", model, "--ratio", 0.5, "--score", "magnitude",
                 "--eval-data", data, "-o", folded, "--plan-out", plan, "--out", tmp_path / "r1")
    assert result.exit_code == 0, result.output
    assert run("prune-channels", model, "--plan", plan, "--no-fold-bn", "-o", kept,
               "--out", tmp_path / "r2").exit_code == 0
    f, k = onnx.load(folded), onnx.load(kept)
    onnx.checker.check_model(f, full_check=True)
    bn = [n.name for n in k.graph.node if n.op_type == "BatchNormalization"]
    assert len(bn) == 6 and not any(n.op_type == "BatchNormalization" for n in f.graph.node)
    x = {"x": np.load(data)["x"][:64]}
    a, b = corpus.run_ort(k, x)["logits"], corpus.run_ort(f, x)["logits"]
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    side = json.loads((tmp_path / "f.onnx.json").read_text())
    opt = side["optimization"]
    assert opt["fold_bn"] is True and sorted(p[1] for p in opt["folded"]) == sorted(bn)
    assert opt["max_rel_output_diff"] < 1e-5
    assert json.loads((tmp_path / "k.onnx.json").read_text())["optimization"]["folded"] == []
    assert side["comparison"]["max_abs_logit_diff"] > 0
    text = (tmp_path / "r1" / "report.txt").read_text()
    assert "6 Conv+BatchNormalization pairs folded" in text and "max |Δlogit|" in text
    assert "--no-fold-bn" in (tmp_path / "r2" / "report.txt").read_text()
    for flag, first in (("--fold-bn", folded), ("--no-fold-bn", kept)):
        again = tmp_path / f"again{flag}.onnx"
        assert run("prune-channels", model, "--plan", plan, flag, "-o", again,
                   "--out", tmp_path / f"r{flag}").exit_code == 0
        assert again.read_bytes() == first.read_bytes()


def test_reference_budget_reuses_another_plans_counts(tiny, tmp_path):
    folder, model, data = tiny
    ref = tmp_path / "ref.json"
    assert run("prune-channels", model, "--ratio", 0.4, "--score", "magnitude", "--budget",
               "global", "-o", tmp_path / "g.onnx", "--plan-out", ref,
               "--out", tmp_path / "r1").exit_code == 0
    result = run("prune-channels", model, "--score", "peer", "--data", data, "--budget",
                 "reference", "--reference", ref, "-o", tmp_path / "p.onnx", "--plan-out",
                 tmp_path / "p.json", "--out", tmp_path / "r2")
    assert result.exit_code == 0, result.output
    want = json.loads(ref.read_text())
    got = json.loads((tmp_path / "p.json").read_text())
    assert {g: len(c) for g, c in got["removed"].items() if c} == {
        g: len(c) for g, c in want["removed"].items() if c}
    assert got["flops_after"] == want["flops_after"]  # FLOPs-matched with the reference


def test_prune_channels_refusals(tiny, tmp_path, monkeypatch):
    folder, model, data = tiny
    before = model.read_bytes()
    out, rep = tmp_path / "x.onnx", tmp_path / "rep"
    assert_user_error(run("prune-channels", model, "-o", model, "--out", rep),
                      "never overwrites an input", rep)
    assert model.read_bytes() == before
    assert_user_error(run("prune-channels", model, "--score", "relevance", "-o", out,
                          "--out", rep), "needs calibration data", out, rep)
    assert_user_error(run("prune-channels", model, "--score", "magnitude", "--finetune",
                          "-o", out, "--out", rep), "--train-data", out, rep)
    assert_user_error(run("prune-channels", model, "--plan", tmp_path / "none.json", "-o", out,
                          "--out", rep), "Cannot read pruning plan", out, rep)
    out.write_bytes(b"keep me")
    assert_user_error(run("prune-channels", model, "--score", "magnitude", "-o", out,
                          "--out", rep), "already exists; pass --overwrite", rep)
    assert out.read_bytes() == b"keep me"
    result = run("prune-channels", model, "--score", "magnitude", "-o", out, "--out", rep,
                 "--overwrite")
    assert result.exit_code == 0 and out.read_bytes() != b"keep me"
    assert_user_error(run("prune-channels", model, "--score", "magnitude", "-o",
                          tmp_path / "y.onnx", "--plan-out", tmp_path / "y.onnx.json",
                          "--out", tmp_path / "rep2"), "collides", tmp_path / "y.onnx")
    # without onnxruntime.training (the main environment) --finetune says how to install it
    monkeypatch.setitem(sys.modules, "onnxruntime.training", None)
    assert_user_error(run("prune-channels", model, "--score", "magnitude", "--finetune",
                          "--train-data", data, "-o", tmp_path / "z.onnx", "--out",
                          tmp_path / "rep3"), "pip install -e '.[training]'",
                      tmp_path / "z.onnx", tmp_path / "rep3")


def test_normalized_auc_closed_forms():
    kept = [1.0, 0.75, 0.5, 0.25]
    assert normalized_auc(kept, [0.8] * 4, 0.8) == pytest.approx(1.0)
    # linear fall from dense at 1.0 to 0 at 0.25: half of the rectangle
    assert normalized_auc(kept, [0.8, 0.8 * 2 / 3, 0.8 / 3, 0.0], 0.8) == pytest.approx(0.5)
    # hand trapezoid, unsorted input
    acc = {1.0: 0.9, 0.5: 0.6, 0.75: 0.3}
    area = 0.25 * (0.3 + 0.6) / 2 + 0.25 * (0.9 + 0.3) / 2
    got = normalized_auc(list(acc), list(acc.values()), 0.9)
    assert got == pytest.approx(area / (0.9 * 0.5))
    assert normalized_auc([1.0], [0.9], 0.9) is None


def test_prune_sweep_one_statistics_pass_flops_matched(tiny, tmp_path, monkeypatch):
    folder, model, data = tiny
    calls = []
    real = prune_report.stat_scores

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(prune_report, "stat_scores", counting)
    result = run("prune-sweep", model, "--ratios", "0.25,0.5", "--scores",
                 "magnitude,ix,relevance,peer,random", "--data", data, "--eval-data", data,
                 "--out", tmp_path / "sw", "--format", "json")
    assert result.exit_code == 0, result.output
    assert len(calls) == 1  # statistics once per sweep, not once per cell
    sweep = json.loads(result.stdout)["prune_sweep"]
    assert len(sweep["rows"]) == 10
    assert all(v["matched"] for v in sweep["flops_matched"].values())
    for sc, entry in sweep["auc"].items():
        mine = [r for r in sweep["rows"] if r["score"] == sc]
        kept = [1.0] + [r["kept_fraction"] for r in mine]
        accs = [sweep["dense_accuracy"]] + [r["accuracy_before"] for r in mine]
        assert entry["before"] == pytest.approx(
            normalized_auc(kept, accs, sweep["dense_accuracy"]))
    assert set(sweep["local_vs_target"]["before"]) >= {"best_local", "local_minus_target_pp"}
    csv_lines = (tmp_path / "sw" / "sweep.csv").read_text().strip().splitlines()
    assert len(csv_lines) == 11 and csv_lines[0].startswith("score,ratio,kept_fraction")
    text = (tmp_path / "sw" / "report.txt").read_text()
    assert "best local-axis" in text and "AUC" in text


def test_prune_sweep_reference_budget_is_flops_matched_global_is_not_required(tiny, tmp_path):
    folder, model, data = tiny
    result = run("prune-sweep", model, "--ratios", "0.5", "--scores", "magnitude,random",
                 "--budget", "reference", "--eval-data", data, "--out", tmp_path / "r",
                 "--format", "json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["prune_sweep"]["rows"]
    assert rows[0]["channels_removed"] == rows[1]["channels_removed"]
    assert rows[0]["flops_ratio"] == rows[1]["flops_ratio"]


def test_prune_sweep_refusals(tiny, tmp_path):
    folder, model, data = tiny
    rep = tmp_path / "rep"
    assert_user_error(run("prune-sweep", model, "--scores", "magnitude,lion", "--eval-data",
                          data, "--out", rep), "Unknown score 'lion'", rep)
    assert_user_error(run("prune-sweep", model, "--ratios", "0.5,1.2", "--eval-data", data,
                          "--out", rep), "must be in (0, 1)", rep)
    assert_user_error(run("prune-sweep", model, "--scores", "ix", "--eval-data", data,
                          "--out", rep), "need calibration data", rep)
    assert_user_error(run("prune-sweep", model, "--scores", "random", "--eval-data", data,
                          "--finetune", "--out", rep), "--train-data", rep)
    result = run("prune-sweep", model, "--ratios", "a,b", "--eval-data", data)
    assert result.exit_code == 2 and "--ratios" in result.output


def test_prune_channels_recalibrate_bn_sets_the_pruned_models_bn_statistics(tiny, tmp_path):
    """--recalibrate-bn: the emitted model's BNs hold the mean / unbiased variance of their
    inputs in the emitted model itself on --data; the sidecar records the recalibration
    and the accuracy before recovery; the text says what recovered it. (--no-fold-bn keeps
    the BNs in the emitted model, to read their statistics.)"""
    from onnxdiag.graph import GraphIndex

    folder, model, data = tiny
    out = tmp_path / "bn.onnx"
    result = run("prune-channels", model, "--ratio", 0.5, "--score", "magnitude", "--data",
                 data, "--eval-data", data, "--recalibrate-bn", "--no-fold-bn", "-o", out,
                 "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    side = json.loads((tmp_path / "bn.onnx.json").read_text())
    small = onnx.load(out)
    onnx.checker.check_model(small, full_check=True)
    bns = [n for n in small.graph.node if n.op_type == "BatchNormalization"]
    assert len(side["recalibration"]["bns"]) == len(bns) > 0
    assert side["recalibration"]["n_images"] == 160
    assert 0 <= side["accuracy"]["before_recovery"]["accuracy"] <= 1
    x = np.load(data)["x"]
    index = GraphIndex(small)
    outs = corpus.run_ort(small, {"x": x}, [b.input[0] for b in bns])
    for bn in bns:
        v = np.moveaxis(outs[bn.input[0]].astype(np.float64), 1, -1).reshape(
            -1, outs[bn.input[0]].shape[1])
        np.testing.assert_allclose(index.get_constant(bn.input[3]), v.mean(0), rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(index.get_constant(bn.input[4]), v.var(0, ddof=1),
                                   rtol=1e-4, atol=1e-6)
    text = (tmp_path / "rep" / "report.txt").read_text()
    assert "after BN recalibration" in text and f"{len(bns)} BatchNormalization" in text


def test_prune_sweep_recalibrate_bn_is_an_after_curve(tiny, tmp_path):
    """Label-free recovery in the sweep: every cell has an accuracy after BN recalibration
    that equals recalibrating that cell's pruned model directly, the after-AUC uses the
    recalibrated dense model, and the report names the recovery."""
    folder, model, data = tiny
    result = run("prune-sweep", model, "--ratios", "0.5", "--scores", "magnitude,random",
                 "--data", data, "--eval-data", data, "--recalibrate-bn",
                 "--out", tmp_path / "sw", "--format", "json")
    assert result.exit_code == 0, result.output
    sweep = json.loads(result.stdout)["prune_sweep"]
    assert sweep["recovery"] == "BN recalibration" and sweep["finetune"] is False
    assert all(v["after"] is not None for v in sweep["auc"].values())
    one = run("prune-channels", model, "--ratio", 0.5, "--score", "magnitude", "--data", data,
              "--eval-data", data, "--recalibrate-bn", "-o", tmp_path / "m.onnx",
              "--out", tmp_path / "one")
    assert one.exit_code == 0, one.output
    side = json.loads((tmp_path / "m.onnx.json").read_text())
    cell = next(r for r in sweep["rows"] if r["score"] == "magnitude")
    assert cell["accuracy_after"] == pytest.approx(side["accuracy"]["emitted"]["accuracy"])
    assert cell["accuracy_before"] == pytest.approx(
        side["accuracy"]["before_recovery"]["accuracy"])
    assert "after recovery (BN recalibration)" in (tmp_path / "sw" / "report.txt").read_text()


def test_round_to_and_the_width_note(tiny, tmp_path, monkeypatch):
    """Widths off the CPU's channel block get a note naming --round-to; with --round-to
    every narrowed width is a multiple and the note is gone; the plan records it."""
    import onnxdiag.runtime.latency as emit

    folder, model, data = tiny
    monkeypatch.setattr(emit, "cpu_conv_block", lambda cpuinfo=None: 8)
    base = ["prune-channels", model, "--ratio", 0.6, "--score", "magnitude"]
    plain = run(*base, "-o", tmp_path / "a.onnx", "--out", tmp_path / "ra")
    assert plain.exit_code == 0, plain.output
    side = json.loads((tmp_path / "a.onnx.json").read_text())
    assert any(after % 8 for _, after in side["record"]["widths"].values())
    assert any("--round-to 8" in n for n in side["notes"])
    rounded = run(*base, "--round-to", 8, "-o", tmp_path / "b.onnx", "--out", tmp_path / "rb",
                  "--plan-out", tmp_path / "plan.json")
    assert rounded.exit_code == 0, rounded.output
    side = json.loads((tmp_path / "b.onnx.json").read_text())
    assert side["record"]["widths"] and all(after % 8 == 0 for _, after in
                                             side["record"]["widths"].values())
    assert not any("--round-to" in n for n in side["notes"])
    assert json.loads((tmp_path / "plan.json").read_text())["settings"]["round_to"] == 8
    for bad in ("0", "eight"):
        assert_user_error(run("prune-channels", model, "-o", tmp_path / "c.onnx", "--round-to",
                              bad, "--out", tmp_path / "rc"),
                          "--round-to must be a positive integer or 'auto'", tmp_path / "c.onnx",
                          out=tmp_path / "rc")
    auto = run(*base, "--round-to", "auto", "-o", tmp_path / "e.onnx", "--out", tmp_path / "re")
    assert auto.exit_code == 0, auto.output
    side = json.loads((tmp_path / "e.onnx.json").read_text())
    assert side["plan"]["settings"]["round_to"] == 8  # this (patched) CPU's block
    assert all(after % 8 == 0 for _, after in side["record"]["widths"].values())
    assert_user_error(run("prune-channels", model, "--plan", tmp_path / "plan.json",
                          "--round-to", 8, "-o", tmp_path / "d.onnx", "--out", tmp_path / "rd"),
                      "a replayed --plan keeps its channels", tmp_path / "d.onnx",
                      out=tmp_path / "rd")


def test_prune_sweep_round_to_reaches_every_cell(tiny, tmp_path):
    folder, model, data = tiny
    result = run("prune-sweep", model, "--ratios", "0.6", "--scores", "magnitude,random",
                 "--eval-data", data, "--round-to", 8, "--out", tmp_path / "sw",
                 "--format", "json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["prune_sweep"]["rows"]
    # groups of 8 keep 8 (4 kept rounds up), groups of 16 keep 8 (7 rounds up): 2 x 8 removed
    assert [r["channels_removed"] for r in rows] == [16, 16]
    assert rows[0]["flops_ratio"] == rows[1]["flops_ratio"]


def test_recalibrate_bn_needs_calibration_data(tiny, tmp_path):
    folder, model, data = tiny
    rep = tmp_path / "rep"
    for verb, extra in (("prune-channels", ["-o", tmp_path / "x.onnx"]), ("prune-sweep", [])):
        assert_user_error(run(verb, model, "--score" if verb == "prune-channels" else "--scores",
                              "magnitude", "--eval-data", data, "--recalibrate-bn",
                              "--out", rep, *extra), "--recalibrate-bn needs calibration", rep)
    assert not (tmp_path / "x.onnx").exists()


# -- fine-tuning: runs in CI's training environment ------------------------------------------
@pytest.fixture(scope="module")
def training():
    if os.environ.get("ONNXDIAG_REQUIRE_TRAINING") == "1":
        import onnxruntime.training

        return onnxruntime.training
    return pytest.importorskip("onnxruntime.training")


def test_prune_channels_finetune_recovers_and_loads_in_plain_ort(training, tiny, tmp_path):
    import onnxruntime as ort

    folder, model, data = tiny
    out = tmp_path / "ft.onnx"
    result = run("prune-channels", model, "--ratio", 0.5, "--score", "magnitude", "--eval-data",
                 data, "--finetune", "--train-data", data, "--epochs", 3, "--lr", 1e-2,
                 "--batch-size", 32, "-o", out, "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    ft = json.loads((tmp_path / "ft.onnx.json").read_text())["finetune"]
    assert ft["steps"] == 15 and ft["epoch_losses"][-1] < ft["epoch_losses"][0]
    assert ft["eval_loss_after"] < ft["eval_loss_before"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = np.load(data)["x"][:4]
    assert session.run(None, {"x": x})[0].shape == (4, corpus.N_CLASSES)


def test_prune_sweep_finetune_reports_accuracy_after_recovery(training, tiny, tmp_path):
    folder, model, data = tiny
    result = run("prune-sweep", model, "--ratios", "0.5", "--scores", "magnitude,random",
                 "--eval-data", data, "--finetune", "--train-data", data, "--epochs", 1,
                 "--max-batches", 3, "--lr", 1e-2, "--out", tmp_path / "sw", "--format", "json")
    assert result.exit_code == 0, result.output
    sweep = json.loads(result.stdout)["prune_sweep"]
    assert all(0 <= r["accuracy_after"] <= 1 for r in sweep["rows"])
    assert all(v["after"] is not None for v in sweep["auc"].values())
    assert 0 <= sweep["dense_accuracy_after_recovery"] <= 1  # the after-curve's reference


def test_prune_channels_recalibrate_then_finetune(training, tiny, tmp_path):
    """Both recoveries: BN recalibration first, then fine-tuning from the recalibrated
    model (its first step's loss is the recalibrated model's loss, not the pruned one's)."""
    folder, model, data = tiny
    out = tmp_path / "both.onnx"
    result = run("prune-channels", model, "--ratio", 0.5, "--score", "magnitude", "--data", data,
                 "--eval-data", data, "--recalibrate-bn", "--finetune", "--train-data", data,
                 "--epochs", 1, "--max-batches", 2, "--lr", 1e-3, "-o", out,
                 "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    side = json.loads((tmp_path / "both.onnx.json").read_text())
    assert side["recalibration"]["bns"] and side["finetune"]["steps"] == 2
    only = run("prune-channels", model, "--ratio", 0.5, "--score", "magnitude", "--data", data,
               "--eval-data", data, "--recalibrate-bn", "-o", tmp_path / "bn.onnx",
               "--out", tmp_path / "rep_bn")
    assert only.exit_code == 0, only.output
    recalibrated = json.loads((tmp_path / "bn.onnx.json").read_text())["accuracy"]["emitted"]
    assert side["finetune"]["accuracy_before"] == pytest.approx(recalibrated["accuracy"])
    text = (tmp_path / "rep" / "report.txt").read_text()
    assert "after BN recalibration + fine-tuning" in text


def test_prune_channels_finetune_with_a_named_head_and_features(training, named, tmp_path):
    """Fine-tuning analyses the pruned model with the named head and features too."""
    folder, model, data = named
    result = run("prune-channels", model, "--head", "head", "--features", "feat", "--score",
                 "magnitude", "--eval-data", data, "--finetune", "--train-data", data,
                 "--epochs", 1, "--max-batches", 2, "--lr", 1e-3, "-o", tmp_path / "ft.onnx",
                 "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    side = json.loads((tmp_path / "ft.onnx.json").read_text())
    assert side["finetune"]["steps"] == 2 and side["finetune"]["logits"] == "logits"
    assert side["accuracy"]["before_recovery"]["n_samples"] == 96
