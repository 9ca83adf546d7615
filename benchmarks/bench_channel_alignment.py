#!/usr/bin/env python3
"""Channel widths vs ONNX Runtime CPU latency, and what `--round-to` does to a pruned model.

    python benchmarks/bench_channel_alignment.py [--model M] [--ratios 0.25,0.3,0.5]
                                                 [--widths 32,34,...] [--repeats 50]

1. Width sweep: a stack of four 3×3 convs (+ReLU) on 14×14 maps, batch 32, C in = C out =
   each width; median ms per run. ONNX Runtime's blocked (NCHWc) CPU convolutions work in
   channel blocks (MLAS NchwcBlockSize: 16 with AVX-512F, 8 with AVX2).
2. The model pruned by magnitude (uniform budget) at each ratio with --round-to off / 8 /
   16, emitted as prune-channels writes it (Conv+BN folded): FLOPs ratio and ORT CPU
   latency at batch 1 and 32, 1 intra-op thread, median of --repeats single runs
   interleaved with the source's (runtime.latency.compare_latency), source alongside.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def conv_stack(c: int, hw: int = 14, depth: int = 4):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(depth):
        inits += [numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.05)
                                          .astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(np.zeros(c, np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["N", c, hw, hw])], [helper.make_tensor_value_info(
            x, TensorProto.FLOAT, ["N", c, hw, hw])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def width_sweep(widths, repeats: int) -> list[tuple[int, float]]:
    from onnxdiag.runtime.runner import OrtRunner

    rows = []
    for c in widths:
        runner = OrtRunner(conv_stack(c), providers="cpu")
        x = np.random.default_rng(1).random((32, c, 14, 14), dtype=np.float32)
        for _ in range(5):
            runner.run({"x": x})
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            runner.run({"x": x})
            times.append(time.perf_counter() - t)
        rows.append((c, 1000 * float(np.median(times))))
    return rows


def pruned_latency(model_path: str, ratios, repeats: int) -> list[dict]:
    """Per (ratio, --round-to): FLOPs ratio, kept widths and the emitted model's latency
    against the source, interleaved at 1 intra-op thread (runtime.latency.compare_latency;
    the emitted model as prune-channels writes it: Conv+BN folded)."""
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.finalize import finalize_model
    from onnxdiag.model.io import get_input_specs, load_model
    from onnxdiag.model.optimize import optimize_for_inference
    from onnxdiag.runtime.latency import compare_latency
    from onnxdiag.structured import magnitude_scores, plan_pruning, prune_channels

    model = load_model(model_path)
    structure = analyze_structure(model)
    spec = get_input_specs(model)[0]
    shape = [d if isinstance(d, int) else 1 for d in spec.shape[1:]]
    x = np.random.default_rng(0).random((32, *shape), dtype=np.float32)
    feeds = {1: {spec.name: x[:1]}, 32: {spec.name: x}}
    mags = magnitude_scores(model, structure)
    rows, source = [], {}
    for ratio in ratios:
        for round_to in (None, 8, 16):
            plan = plan_pruning(model, structure, mags, ratio, round_to=round_to)
            pruned, record = prune_channels(model, structure, plan.removed)
            emitted = optimize_for_inference(finalize_model(pruned))[0]
            lat = compare_latency(model, emitted, feeds, rounds=repeats, threads=1)
            source = {int(k): v for k, v in lat["source"].items()}
            widths = sorted({after for _, after in record.widths.values()})
            rows.append({"ratio": ratio, "round_to": round_to or "-",
                         "flops": record.flops_after / record.flops_before,
                         "widths": widths, "b1": lat["emitted"]["1"], "b32": lat["emitted"]["32"],
                         "speedup_b1": lat["speedup"]["1"], "speedup_b32": lat["speedup"]["32"]})
    return source, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "sample" / "model.onnx"))
    ap.add_argument("--ratios", default="0.25,0.3,0.5")
    ap.add_argument("--widths", default="32,34,36,40,44,45,47,48,52,56,60,62,63,64")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="widths 32,34, ratio 0.5, 3 repeats")
    args = ap.parse_args()
    if args.smoke:
        args.widths, args.ratios, args.repeats = "32,34", "0.5", 3
    from onnxdiag.runtime.latency import cpu_conv_block

    print(f"machine: {platform.machine()}, {__import__('os').cpu_count()} cores; ORT channel "
          f"block on this CPU: {cpu_conv_block()}")
    print("| width | ms (4 convs 3x3, 14x14, batch 32) |\n|---:|---:|")
    for c, ms in width_sweep([int(w) for w in args.widths.split(",")], args.repeats):
        print(f"| {c} | {ms:.3f} |")
    source, rows = pruned_latency(args.model, [float(r) for r in args.ratios.split(",")],
                                  args.repeats)
    print(f"\n{args.model}: source {source[1]:.3f} ms (b=1), {source[32]:.3f} ms (b=32)")
    print("| ratio | --round-to | FLOPs ratio | kept widths | ms b=1 | ms b=32 | speed-up b=1 "
          "| speed-up b=32 |\n|---|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if r["round_to"] != "-" and any(w % r["round_to"] for w in r["widths"]):
            raise SystemExit(f"CONSISTENCY CHECK FAILED: --round-to {r['round_to']} kept "
                             f"widths {r['widths']}")
    print("check ok: every narrowed width under --round-to N is a multiple of N")
    for r in rows:
        print(f"| {r['ratio']} | {r['round_to']} | {r['flops']:.3f} | "
              f"{','.join(map(str, r['widths'])) or '(none narrowed)'} | {r['b1']:.3f} | "
              f"{r['b32']:.3f} | {r['speedup_b1']:.2f}x | {r['speedup_b32']:.2f}x |")


if __name__ == "__main__":
    main()
