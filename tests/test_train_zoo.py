"""tools/train_zoo.py: a tiny run exports valid ONNX checkpoints with BN kept (and one BN-folded
model) whose ONNX Runtime outputs reproduce the accuracies torch measured, and an interrupted run
resumes to exactly the checkpoints of an uninterrupted one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import train_zoo as tz  # noqa: E402

SCHED = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True,
         "weight_decay": 5e-4, "lr_schedule": "cosine", "noise": 0.0, "epochs": 4.0,
         "n_train": 64, "checkpoint_epochs": [1, 2, 4]}


@pytest.fixture(autouse=True)
def _restore_torch_flags():
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(threads)


def _data():
    rng = np.random.default_rng(0)
    return {"x_train": rng.random((64, 1, 28, 28), dtype=np.float32),
            "y_train": rng.integers(0, 10, 64),
            "x_calib": rng.random((8, 1, 28, 28), dtype=np.float32),
            "y_calib": rng.integers(0, 10, 8),
            "x_eval": rng.random((40, 1, 28, 28), dtype=np.float32),
            "y_eval": rng.integers(0, 10, 40)}


def _args(out: Path) -> argparse.Namespace:
    return argparse.Namespace(out=out, epochs_scale=1.0, width_scale=0.125, opset=17,
                              batch_size=32, argv=["--test"], data_dir=Path("synthetic"),
                              threads=1)


def _session(path: Path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _ckpt_bytes(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "checkpoints").glob("*.onnx"))}


def test_tiny_run_exports_resumes_and_is_deterministic(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    data = _data()
    args = _args(tmp_path)
    # 2 steps per epoch, 8 steps: checkpoints at steps 0, 2, 4, 8
    m = tz.train_run("resnet18-cosine", "resnet18", "cosine", 0, data, args, sched=SCHED)
    run_dir = tmp_path / "resnet18-cosine"
    recs = m["checkpoints"]
    assert [r["step"] for r in recs] == [0, 2, 4, 8] and m["complete"]
    assert m["widths"]["stages"] == [1, 2, 4, 8]
    for r in recs:
        path = run_dir / "checkpoints" / r["path"]
        proto = onnx.load(str(path))
        onnx.checker.check_model(proto, full_check=True)
        ops = [n.op_type for n in proto.graph.node]
        assert ops.count("BatchNormalization") == m["n_batchnorm"] == 20
        assert "Identity" not in ops and ops[-1] == "Gemm"
        # ORT reproduces the accuracy torch measured on the same images
        logits = _session(path).run(["logits"], {"input": data["x_eval"]})[0]
        acc = 100.0 * float((logits.argmax(1) == data["y_eval"]).mean())
        assert acc == pytest.approx(r["test_acc"], abs=1e-6)
    # the BN-folded export of the last checkpoint: no BN, same function
    folded = run_dir / "model_bnfolded.onnx"
    assert "BatchNormalization" not in {n.op_type for n in onnx.load(str(folded)).graph.node}
    kept = _session(run_dir / "checkpoints" / recs[-1]["path"]).run(None, {"input": data["x_eval"]})
    fold = _session(folded).run(None, {"input": data["x_eval"]})
    np.testing.assert_allclose(fold[0], kept[0], atol=1e-4)
    assert m["export"]["do_constant_folding"] is False
    assert m["bn_folded_export"]["settings"]["do_constant_folding"] is True
    assert not (run_dir / "state.pt").exists()

    # a finished run is skipped: nothing is retrained or rewritten
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    tz.train_run("resnet18-cosine", "resnet18", "cosine", 0, data, args, sched=SCHED)
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before

    # interrupt a second copy while it exports its third checkpoint, then resume it
    real_export, calls = tz.export, []

    def flaky_export(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_export(*a, **k)

    args2 = _args(tmp_path / "again")
    monkeypatch.setattr(tz, "export", flaky_export)
    with pytest.raises(KeyboardInterrupt):
        tz.train_run("resnet18-cosine", "resnet18", "cosine", 0, data, args2, sched=SCHED)
    run2 = tmp_path / "again" / "resnet18-cosine"
    assert (run2 / "state.pt").exists() and not (run2 / "manifest.json").exists()
    assert len(json.loads((run2 / "checkpoints" / "checkpoints.json").read_text())) == 2
    monkeypatch.setattr(tz, "export", real_export)
    m2 = tz.train_run("resnet18-cosine", "resnet18", "cosine", 0, data, args2, sched=SCHED)
    strip = [{k: v for k, v in r.items() if k != "ort_vs_torch_max_abs"} for r in recs]
    assert [{k: v for k, v in r.items() if k != "ort_vs_torch_max_abs"}
            for r in m2["checkpoints"]] == strip
    # resumed training reproduces the uninterrupted weights bit for bit
    assert _ckpt_bytes(run2) == _ckpt_bytes(run_dir)


def test_plan_names_patterns_and_schedules():
    plan = tz.plan_runs()
    # issue 18: >= 5 seeds x 3 architectures of the tail schedule, cosine runs, init variants
    for arch in ("resnet18", "vgg16_bn", "mobilenetv2"):
        assert sum(r.arch == arch and r.schedule == "tail" for r in plan.values()) >= 5
    assert tz.run_name(tz.Run("vgg16_bn", "init", 2, 8, False)) == "init-vgg16_bn-w8-nobn-s2"
    assert tz.run_name(tz.Run("resnet18", "cosine", 0)) == "resnet18-cosine"
    assert tz.select_runs("resnet18-tail*") == ["resnet18-tail"] + [
        f"resnet18-tail-s{s}" for s in range(1, 5)]
    assert tz.select_runs("legacy") == list(tz.legacy_runs())
    arch, sched, seed = tz.all_runs()["resnet18-cosine-s1"]  # issue 7's tuples still unpack
    assert (arch, sched, seed) == ("resnet18", "cosine", 1)
    with pytest.raises(SystemExit, match="unknown run"):
        tz.select_runs("resnet99-*")
    ns = argparse.Namespace(epochs_scale=1.0, set={})
    mb = tz.schedule_for("mobilenetv2-tail", plan["mobilenetv2-tail"], ns)
    assert mb["noise"] == 0.15 and mb["lr_schedule"] == "constant" and mb["epochs"] == 20
    # the peak must be able to fall inside the tail window: >= 5 checkpoints after epoch 0
    for name, run in plan.items():
        if run.schedule == "tail":
            assert len(tz.schedule_for(name, run, ns)["checkpoint_epochs"]) >= 10


def test_init_without_bn_and_vit_runs(tmp_path):
    torch.set_num_threads(1)
    data = _data()
    args = _args(tmp_path)
    m = tz.train_run("init-vgg16_bn-w2-nobn-s1", "vgg16_bn", "init", 1, data, args,
                     sched=dict(tz.SCHEDULES["init"], n_train=64), width=2, bn=False)
    assert m["n_batchnorm"] == 0 and len(m["checkpoints"]) == 1 and not m["batchnorm"]
    assert m["widths"]["stages"][0] == [2, 2]  # 8 x 0.125 x 2
    path = tmp_path / "init-vgg16_bn-w2-nobn-s1" / "checkpoints" / "ckpt_000.onnx"
    assert "BatchNormalization" not in {n.op_type for n in onnx.load(str(path)).graph.node}
    # the training probe: the images trained on with the labels trained on
    probe = np.load(tmp_path / "init-vgg16_bn-w2-nobn-s1" / "probe_train.npz")
    assert np.array_equal(probe["input"], data["x_train"][:64])
    vit = dict(SCHED, optimizer="adamw", lr=1e-3, weight_decay=0.0, noise=0.25,
               lr_schedule="constant", epochs=2.0, checkpoint_epochs=[1, 2])
    m = tz.train_run("vit-tail", "vit", "tail", 0, data, args, sched=vit)
    assert m["n_batchnorm"] == 0 and m["export"]["do_constant_folding"] is True
    run_dir = tmp_path / "vit-tail"
    probe = np.load(run_dir / "probe_train.npz")
    clean = np.load(run_dir / "probe_train_clean_labels.npy")
    assert np.array_equal(clean, data["y_train"][:64])
    assert (probe["labels"] != clean).mean() == pytest.approx(0.25, abs=0.02)
    rec = m["checkpoints"][-1]
    logits = _session(run_dir / "checkpoints" / rec["path"]).run(None, {"input": data["x_eval"]})
    acc = 100.0 * float((logits[0].argmax(1) == data["y_eval"]).mean())
    assert acc == pytest.approx(rec["test_acc"], abs=1e-6) and "train_loss_noisy" in rec


def test_time_epoch_prints_every_selected_run(monkeypatch, capsys):
    """``--time-epoch`` builds each selected run's architecture and prints its parameter
    count and one timed epoch (it indexed a Run as a tuple until 2026-12-07)."""
    monkeypatch.setattr(tz, "load_data", lambda *args: _data())
    assert tz.main(["--runs", "mobilenetv2-tail,resnet18-tail", "--time-epoch",
                    "--width-scale", "0.125", "--n-train", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for line, (name, arch) in zip(lines, [("mobilenetv2-tail", "mobilenetv2"),
                                          ("resnet18-tail", "resnet18")]):
        n = sum(p.numel() for p in tz.build(arch, tz.arch_widths(arch, 0.125)).parameters())
        assert line.startswith(f"{name}: {n} params, one epoch of 64 images ")
    assert len(lines) == 2
