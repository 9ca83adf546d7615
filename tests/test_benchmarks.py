"""Every benchmark runs: its ``--smoke`` mode in a fresh process, tables and checks included.

A benchmark that breaks (an API it calls changed, a key it reads was renamed, a consistency
check failed) fails here rather than on the day someone re-measures RESULTS.md. Each smoke
run exercises every code path its full run measures on tiny inputs, in seconds; those that
need torch or Ray skip without them. ``benchmarks/gpu_check.sh`` is run in its degraded
(CPU-only) mode in the current environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

#: script -> (module it needs or None, lines its smoke output must contain)
SMOKES = {
    "bench_core.py": (None, ["channels_output_taps", "peak RSS"]),
    "bench_readouts.py": ("torch", ["torch pipeline", "head-gradient norm"]),
    "bench_executor.py": ("ray", ["Ray start-up", "Identical readouts"]),
    "bench_prune.py": (None, ["channels removed ", "| batch | threads | clock |"]),
    "bench_prune_sweep.py": (None, ["| score | kept 0.75 | kept 0.50 |", "FLOPs ratio"]),
    "bench_rr.py": (None, ["RR curves, exact", "naive (prune, full network"]),
    "bench_rr_layers.py": (None, ["| layer | C | K | groups |", "better of the two per layer"]),
    "bench_reconstruct.py": (None, ["| ls, positions all |",
                                    "FLOPs floor of the sequential LS products"]),
    "bench_selection.py": (None, ["Targets: `labels`", "Targets: `expected`", "Baselines"]),
    "bench_channel_alignment.py": (None, ["| width |", "| ratio | --round-to |"]),
    "bench_reconstruct_channels.py": (None, ["| calibration images |", "| none | bn | recon |",
                                             "magnitude none | magnitude recon"]),
    "bench_passes.py": (None, ["x baseline", "plain_nospin", "stats_session", "segments", "prune",
                           "channels_overlap", "peak RSS"]),
    # the training environment of .ci/run runs it (-k finetune); the main one skips it
    "bench_finetune_sparse.py": ("onnxruntime.training",
                                 ["| model | S | dense | none | ls | finetune | ls+finetune |"]),
}
#: run by gpu_check.sh (test_gpu_check_runs_degraded_on_a_cpu_machine), not twice
BY_GPU_CHECK = {"bench_gpu.py"}


def _env(**extra) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("RAY_ADDRESS", "local")  # a fresh local Ray instance, never another's
    return env


def _run(cmd, timeout=300, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(**extra), capture_output=True, text=True,
                          timeout=timeout)


def test_every_benchmark_has_a_smoke_test():
    assert sorted(p.name for p in BENCH.glob("bench_*.py")) == sorted({*SMOKES, *BY_GPU_CHECK})


@pytest.mark.parametrize("script", sorted(SMOKES))
def test_benchmark_smoke_runs(script):
    """``python benchmarks/SCRIPT --smoke`` exits 0, prints its tables and passes its
    consistency checks (each printed as ``check ok``)."""
    needs, expected = SMOKES[script]
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{script} needs {needs}")
    result = _run([sys.executable, str(BENCH / script), "--smoke"])
    out = result.stdout
    assert result.returncode == 0, \
        f"{script} --smoke failed:\n{out[-3000:]}\n{result.stderr[-3000:]}"
    assert "CONSISTENCY CHECK FAILED" not in out + result.stderr
    for line in expected:
        assert line in out, (script, line, out[-2000:])
    assert "check ok:" in out, out[-2000:]


def test_gpu_check_runs_degraded_on_a_cpu_machine(tmp_path):
    """gpu_check.sh with GPU_CHECK_CPU_ONLY=1 (and the current interpreter instead of a
    fresh venv): the gpu tests skip, ``bench_gpu.py --smoke`` prints the table with the CPU
    column and "not measured" for CUDA, and bench_gpu.json has CPU ratios only."""
    result = _run(["bash", str(BENCH / "gpu_check.sh")], GPU_CHECK_CPU_ONLY="1",
                  GPU_CHECK_PYTHON=sys.executable, GPU_CHECK_SMOKE="1",
                  GPU_CHECK_OUT=str(tmp_path))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "degraded mode, CPU only: GPU_CHECK_CPU_ONLY=1" in out
    assert "tests marked gpu" in out and "skipped" in out
    for row in ("plain ONNX Runtime inference", "readout pass", "channel-statistics pass",
                "RR curves", "50 % channel-pruned model, batch 1",
                "50 % channel-pruned model, batch 32"):
        assert f"| {row}" in out, row
    assert "not measured" in out and "CONSISTENCY CHECK FAILED" not in out
    saved = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert "cpu" in saved and "cuda" not in saved
    assert saved["cpu"]["ratios"]["plain"] == 1.0
    assert (tmp_path / "gpu_check.log").read_text().strip()


def _bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_gpu_compares_two_providers(capsys):
    """The CUDA-vs-CPU checks of bench_gpu.py, run on two CPU measurements: equal results
    pass; readouts 5 % off fail."""
    bench = _bench_gpu()
    inputs = bench.prepare(n=64, rr_n=64, batch_size=32)
    cpu = bench.measure("cpu", inputs, repeat=1, latency_repeats=1)
    bench.consistency({"cpu": cpu, "cuda": cpu})
    assert capsys.readouterr().out.count("check ok:") == 2
    off = dict(cpu, readouts={k: v * 1.05 if isinstance(v, float) else v
                              for k, v in cpu["readouts"].items()})
    with pytest.raises(SystemExit, match="readouts on CUDA = CPU"):
        bench.consistency({"cpu": cpu, "cuda": off})


@pytest.mark.parametrize("script", ["study_readouts.py", "study_channels.py",
                                    "study_repair.py"])
def test_study_scripts_parse_their_options(script):
    """The zoo studies (tools/study_*.py) need a trained zoo to run; their command line and
    imports are checked here."""
    result = _run([sys.executable, str(ROOT / "tools" / script), "--help"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--zoo" in result.stdout


@pytest.mark.parametrize("script, width, n_depthwise", [("resnet50", 1 / 16, 0),
                                                         ("mobilenetv2", 0.25, 17)])
def test_full_size_builders_smoke_export_what_torch_computes(tmp_path, script, width,
                                                             n_depthwise):
    """``benchmarks/resnet50.py --smoke`` exports a plain-torch bottleneck ResNet (53 convs:
    a stem, 16 blocks of 3, 4 projections; one linear head), ``benchmarks/mobilenetv2.py
    --smoke`` a MobileNetV2 (52 convs: a stem, 17 inverted residual blocks — the first
    without expansion — and the last 1×1; 17 of them depthwise). ONNX Runtime runs each on
    its calibration file and reproduces its torch outputs."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    res = _run([sys.executable, str(BENCH / f"{script}.py"), str(tmp_path), "--smoke"])
    assert res.returncode == 0, res.stderr[-2000:]
    import onnx
    import onnxruntime as ort
    import torch

    sys.path.insert(0, str(BENCH))
    builder = importlib.import_module(script)
    model = onnx.load(str(tmp_path / "model.onnx"))
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    groups = [next((a.i for a in n.attribute if a.name == "group"), 1) for n in convs]
    assert len(convs) == (53 if script == "resnet50" else 52)
    assert sum(g > 1 for g in groups) == n_depthwise
    x = np.load(tmp_path / "calib.npz")["input"]
    assert x.shape == (8, 3, 64, 64)
    sess = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": x})[0]
    with torch.no_grad():
        ref = builder.build(width)(torch.from_numpy(x)).numpy()
    assert got.shape == (8, 1000)
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4)


def test_the_statistics_memory_child_reports_its_own_peak_not_its_parents(tmp_path):
    """``bench_passes.py``'s peak-memory children print their own high-water mark: spawned
    from a process holding 600 MiB, a child that holds little reports far less (the
    ``ru_maxrss`` it used to print keeps the parent's RSS from before exec)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_passes; "
            "print(bench_passes.peak_rss_kib())")
    held = np.ones(600 * 2**20 // 8)  # touched: the parent's RSS is now above 600 MiB
    out = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True,
                         text=True, check=True).stdout
    assert held.sum() > 0 and int(out) < 300 * 1024, out


def test_bench_passes_times_the_statistics_pass_at_the_positions_asked(tmp_path):
    """``bench_passes.py --positions k`` makes the statistics session and runs the pass at k
    positions per image (a session made for another k need not expose the same tensors),
    and says so in its JSON."""
    out = tmp_path / "res.json"
    got = _run([sys.executable, str(BENCH / "bench_passes.py"), "--smoke", "--passes",
                "channels,stats_session", "--positions", "1", "--memory", "", "--json",
                str(out)])
    assert got.returncode == 0, got.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["positions"] == 1 and {"channels", "stats_session"} <= set(res["ratio"])


def test_bench_passes_runs_the_fold_on_the_threads_asked(tmp_path):
    """``--fold-threads 2`` runs the statistics pass folding each batch after its run on
    two threads beside ``channels_overlap`` (one worker), and says so in its JSON."""
    out = tmp_path / "res.json"
    got = _run([sys.executable, str(BENCH / "bench_passes.py"), "--smoke", "--passes",
                "channels,channels_overlap", "--fold-threads", "2", "--memory", "",
                "--json", str(out)])
    assert got.returncode == 0, got.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["fold_threads"] == 2 and {"channels", "channels_overlap"} <= set(res["ratio"])
