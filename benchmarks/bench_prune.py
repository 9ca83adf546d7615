#!/usr/bin/env python3
"""What structured channel pruning (METHODS §B6, issue 6) buys on ONNX Runtime CPU.

    python benchmarks/bench_prune.py [--model models/sample/model.onnx] [--ratio 0.5]
    python benchmarks/bench_prune.py --smoke      # 2 rounds of short blocks, seconds

Removes ``--ratio`` of every prunable channel group (uniform budget, magnitude score: with
the uniform budget every score gives the same shapes, so the same speed), then measures in
one process: parameters, FLOPs, file size, and the median ONNX Runtime CPU latency of the
dense and the pruned model at batch 1 and batch 32 on real Fashion-MNIST test images, with
1 intra-op thread and with ORT's default threads. Dense and pruned timings are interleaved
round by round (each round times a block of runs) so machine noise hits both alike.

Consistency check (every run): another score (bn_scale) under the same uniform budget
gives the same channel widths and FLOPs, so the timings hold for every score.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT, check, load_fashion_mnist_test  # noqa: E402


def prune(model_path: str, ratio: float, score: str):
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.finalize import finalize_model
    from onnxdiag.model.io import load_model
    from onnxdiag.structured import plan_pruning, prune_channels
    from onnxdiag.structured.choice import layer_scores

    model = load_model(model_path)
    structure = analyze_structure(model)
    scores, _ = layer_scores(score, model, structure, None)
    plan = plan_pruning(model, structure, scores, ratio, score_name=score)
    pruned, record = prune_channels(model, structure, plan.removed)
    return model, finalize_model(pruned), plan, record


def session(model, threads: int | None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def latency(sessions: dict, x: np.ndarray, rounds: int, block: int) -> dict:
    """Median over ``rounds`` of the mean time (ms) of ``block`` runs, interleaved."""
    feeds = {name: {s.get_inputs()[0].name: x} for name, s in sessions.items()}
    for name, s in sessions.items():
        for _ in range(3):
            s.run(None, feeds[name])
    times = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, s in sessions.items():
            t0 = time.perf_counter()
            for _ in range(block):
                s.run(None, feeds[name])
            times[name].append((time.perf_counter() - t0) / block)
    return {name: 1000 * float(np.median(t)) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models/sample/model.onnx"))
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--score", default="magnitude")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--smoke", action="store_true",
                        help="2 rounds of blocks of 10 (batch 1) / 2 (batch 32) runs")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    args = parser.parse_args(argv)
    blocks = ((1, 200), (32, 20))
    if args.smoke:
        args.rounds, blocks = 2, ((1, 10), (32, 2))

    import onnxruntime as ort

    from onnxdiag.model.io import save_model

    dense, pruned, plan, record = prune(args.model, args.ratio, args.score)
    with tempfile.TemporaryDirectory() as tmp:
        d_bytes = save_model(dense, Path(tmp) / "dense.onnx").stat().st_size
        p_bytes = save_model(pruned, Path(tmp) / "pruned.onnx").stat().st_size
    x, _ = load_fashion_mnist_test(32)
    x = x[:, None] if x.ndim == 3 else x
    results = {"ratio": args.ratio, "score": args.score,
               "channels_removed": plan.n_removed,
               "channels_total": sum(plan.n_channels.values()),
               "params": [record.params_before, record.params_after],
               "flops": [record.flops_before, record.flops_after],
               "file_bytes": [d_bytes, p_bytes],
               "source_file_bytes": Path(args.model).stat().st_size, "latency_ms": {},
               "machine": platform.platform(), "onnxruntime": ort.__version__}
    for threads in (1, None):
        sessions = {"dense": session(dense, threads), "pruned": session(pruned, threads)}
        for batch, block in blocks:
            ms = latency(sessions, x[:batch], args.rounds, block)
            results["latency_ms"][f"b{batch}_t{threads or 'default'}"] = ms
    print(f"channels removed {plan.n_removed}/{results['channels_total']} "
          f"(ratio {args.ratio}, uniform)")
    print(f"params {record.params_before:,} -> {record.params_after:,} "
          f"({record.params_after / record.params_before:.3f})")
    print(f"FLOPs  {record.flops_before:,} -> {record.flops_after:,} "
          f"({record.flops_after / record.flops_before:.3f})")
    print(f"file   {d_bytes:,} -> {p_bytes:,} bytes ({p_bytes / d_bytes:.3f}; both re-saved "
          f"with inferred shapes; the shipped file is {results['source_file_bytes']:,} bytes, "
          f"ratio {p_bytes / results['source_file_bytes']:.3f})")
    print("| batch | threads | dense ms | pruned ms | speed-up |")
    print("|---:|---|---:|---:|---:|")
    for key, ms in results["latency_ms"].items():
        batch, threads = key[1:].split("_t")
        print(f"| {batch} | {threads} | {ms['dense']:.4f} | {ms['pruned']:.4f} | "
              f"{ms['dense'] / ms['pruned']:.2f}x |")
    _, _, _, other = prune(args.model, args.ratio, "bn_scale")
    check(other.widths == record.widths and other.flops_after == record.flops_after,
          f"bn_scale under the same uniform budget gives the same widths and FLOPs as "
          f"{args.score} ({other.flops_after:,})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
