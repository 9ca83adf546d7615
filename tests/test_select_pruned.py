"""select --prune / --prune-channels (docs/METHODS.md §A5): each checkpoint's pruned model
is the one the pruning verb makes for it alone; the topology hash; plans that transfer."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from cli_helpers import assert_user_error, run
from onnx import numpy_helper

from onnxdiag.model.io import load_model, model_hash
from onnxdiag.model.topology import topology_hash

SAMPLE = "models/sample"
CKPTS = [f"{SAMPLE}/checkpoints/ckpt_{i:03d}.onnx" for i in (6, 11)]
DATA = ["--data", f"{SAMPLE}/calib.npz", "--limit", "32"]
EVAL = ["--eval-data", f"{SAMPLE}/eval.npz"]


def _weights(path) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def _report(folder) -> dict:
    return json.loads((folder / "report.json").read_text())["pruned_selection"]


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    """select --prune 0.8 on two sample checkpoints, pruned models written."""
    d = tmp_path_factory.mktemp("select_prune")
    result = run("select", *CKPTS, *DATA, *EVAL, "--prune", "0.8", "--jobs", "1",
                 "--write-pruned", d / "pruned", "--out", d / "report")
    assert result.exit_code == 0, result.output
    return d, _report(d / "report")


def test_pruned_model_equals_prune_alone(sparse_run, tmp_path):
    """The must-show claim: the model select prunes for a checkpoint is bit for bit the one
    `onnxdiag prune` writes for that checkpoint alone (same data, same options)."""
    d, section = sparse_run
    for unit in section["checkpoints"]:
        out = tmp_path / f"alone{unit['index']}.onnx"
        result = run("prune", unit["path"], "-o", out, "--sparsity", "0.8", *DATA, *EVAL,
                     "--out", tmp_path / f"r{unit['index']}")
        assert result.exit_code == 0, result.output
        sidecar = json.loads(out.with_name(out.name + ".json").read_text())
        assert unit["pruned_sha256"] == sidecar["emitted"]["sha256"]
        mine, alone = _weights(unit["pruned_model"]), _weights(out)
        assert mine.keys() == alone.keys()
        assert all(np.array_equal(mine[k], alone[k]) for k in mine)
        # the reported numbers are the prune report's
        assert unit["agreement"]["top1_agreement"] == sidecar["agreement"]["top1_agreement"]
        assert unit["pruned"]["evaluation"]["accuracy"] == pytest.approx(
            sidecar["accuracy"]["emitted"]["accuracy"], abs=1e-12)
        assert unit["prune"]["n_pruned"] == sidecar["n_pruned"]


def test_gaps_against_the_oracle_pruned_checkpoint(sparse_run):
    """Each criterion's gap is the oracle pruned accuracy minus the pruned accuracy of its
    pick; "best dense then prune" picks the best dense checkpoint."""
    _, s = sparse_run
    acc, dense = s["pruned_accuracy"], s["dense_accuracy"]
    ev = s["evaluation"]
    assert ev["oracle_window"]["accuracy"] == max(acc)
    best_dense = ev["readouts"]["dense:accuracy"]["selected"]
    assert best_dense["index"] == int(np.argmax(dense))
    assert best_dense["gap_window_pp"] == pytest.approx(100 * (max(acc) - acc[best_dense["index"]]))
    from onnxdiag.report.schema import validate_report

    validate_report(json.loads((sparse_run[0] / "report" / "report.json").read_text()))
    agr = s["criteria"]["agreement"]["values"]
    pick = ev["readouts"]["agreement"]["selected"]["index"]
    assert agr[pick] == max(agr) and s["criteria"]["agreement"]["label_free"]
    assert sorted(s["ranking"]) == [0, 1] and len(s["topology_hashes"]) == 1


def test_topology_hash_same_run_equal_other_architecture_different():
    a, b = (load_model(p) for p in CKPTS)
    assert model_hash(a) != model_hash(b)
    assert topology_hash(a) == topology_hash(b)
    vit = [load_model(f"models/vit/checkpoints/ckpt_{i:03d}.onnx") for i in (0, 5)]
    assert topology_hash(vit[0]) == topology_hash(vit[1]) != topology_hash(a)


def test_topology_hash_ignores_names_and_initializer_order_not_shapes():
    m = load_model(CKPTS[0])
    renamed = onnx.ModelProto()
    renamed.CopyFrom(m)
    names = {t.name: f"t{i}" for i, t in enumerate(renamed.graph.initializer)}
    for t in renamed.graph.initializer:
        t.name = names[t.name]
    for n in renamed.graph.node:
        n.name = "x" + n.name
        n.input[:] = [names.get(x, x) for x in n.input]
    inits = list(renamed.graph.initializer)
    del renamed.graph.initializer[:]
    renamed.graph.initializer.extend(reversed(inits))
    assert topology_hash(renamed) == topology_hash(m)
    w = renamed.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(np.zeros([*w.dims, 1], np.float32)
                                       if w.data_type == 1 else numpy_helper.to_array(w)[:0],
                                       w.name))
    assert topology_hash(renamed) != topology_hash(m)


def test_channel_plan_transfers_to_another_checkpoint(tmp_path):
    """prune-channels --plan-out records the topology hash; the plan replays on another
    checkpoint of the architecture (same channels), and select --plan uses it for all."""
    plan = tmp_path / "plan.json"
    r = run("prune-channels", CKPTS[0], "-o", tmp_path / "a.onnx", "--ratio", "0.25",
            "--score", "magnitude", "--plan-out", plan, "--out", tmp_path / "ra")
    assert r.exit_code == 0, r.output
    saved = json.loads(plan.read_text())
    assert saved["settings"]["topology_hash"] == topology_hash(load_model(CKPTS[0]))
    r = run("prune-channels", CKPTS[1], "-o", tmp_path / "b.onnx", "--plan", plan,
            "--out", tmp_path / "rb")
    assert r.exit_code == 0, r.output
    side = json.loads((tmp_path / "b.onnx.json").read_text())
    assert any("plan transferred" in n for n in side["notes"])
    assert side["plan"]["removed"] == saved["removed"]
    r = run("select", *CKPTS, *DATA, "--plan", plan, "--jobs", "1", "--out", tmp_path / "rs")
    assert r.exit_code == 0, r.output
    units = _report(tmp_path / "rs")["checkpoints"]
    n_removed = sum(map(len, saved["removed"].values()))
    assert [u["prune"]["n_removed"] for u in units] == [n_removed] * 2


def test_plan_of_another_architecture_is_refused(tmp_path):
    plan = tmp_path / "plan.json"
    r = run("prune-channels", CKPTS[0], "-o", tmp_path / "a.onnx", "--ratio", "0.25",
            "--score", "magnitude", "--plan-out", plan, "--out", tmp_path / "ra")
    assert r.exit_code == 0, r.output
    out = tmp_path / "v.onnx"
    r = run("prune-channels", "models/vit/checkpoints/ckpt_000.onnx", "-o", out, "--plan", plan,
            "--out", tmp_path / "rv")
    assert_user_error(r, "another architecture", out)


def test_select_prune_user_errors(tmp_path):
    r = run("select", *CKPTS, *DATA, "--prune", "0.5", "--prune-channels", "0.3",
            "--out", tmp_path / "r")
    assert_user_error(r, "not both")
    r = run("select", *CKPTS, *DATA, "--prune-channels", "0.3", "--repair", "cr+bn",
            "--out", tmp_path / "r")
    assert_user_error(r, "reconstruct+bn or none; got --repair cr+bn")


@pytest.mark.parametrize("repair, score, flags, jobs", [
    (None, "magnitude", ["--recalibrate-bn"], "2"),
    ("reconstruct+bn", "recon", ["--reconstruct", "--recalibrate-bn"], "1"),
])
def test_channel_pruned_model_equals_prune_channels_alone(tmp_path, repair, score, flags, jobs):
    """The structured form (on two worker processes for the default repair): each
    checkpoint's pruned model is what prune-channels --no-fold-bn writes for it alone with
    the same recovery (BN recalibration; reconstruction + recalibration, repair-aware score)."""
    r = run("select", *CKPTS, *DATA, "--prune-channels", "0.25", "--score", score,
            *(["--repair", repair] if repair else []), "--jobs", jobs, "--out", tmp_path / "rs")
    assert r.exit_code == 0, r.output
    for unit in _report(tmp_path / "rs")["checkpoints"]:
        assert unit["prune"]["repair"] == (repair or "bn")
        out = tmp_path / f"alone{unit['index']}.onnx"
        r = run("prune-channels", unit["path"], "-o", out, "--ratio", "0.25", "--score",
                score, *flags, "--no-fold-bn", *DATA, "--out", tmp_path / f"r{unit['index']}")
        assert r.exit_code == 0, r.output
        assert unit["pruned_sha256"] == model_hash(load_model(out))
        assert unit["prune"]["params_after"] < unit["prune"]["params_before"]


def test_rank_by_names_a_criterion(tmp_path):
    r = run("select", *CKPTS, *DATA, "--prune", "0.5", "--rank-by", "pruned:nonsense",
            "--out", tmp_path / "r")
    assert_user_error(r, "Unknown --rank-by")
