#!/usr/bin/env python3
"""Cost of the RR curves (SPEC C2) against one dense pass and against the naive method.

    python benchmarks/bench_rr.py [--model models/sample/model.onnx] [--n 1000]

On N calibration images (models/sample/calib.npz), in one process:
  dense   one plain ONNX Runtime pass over the N images (the baseline, 1.00x)
  rr      compute_rr_curves for every prunable layer on a 20-point grid {0, 0.05, ..., 0.95}:
          one capture pass exposing the layers' inputs, then each layer evaluated offline
  naive   for every layer and every grid level: prune that layer alone (apply_masks), build
          an ORT session exposing its output, run the full network over the N images and
          accumulate the same moments (the dense outputs are captured once and reused)
The naive curves must equal the fast ones (max |ΔRR| is printed). Timings: best of --repeat
after a warm-up for dense and rr; the naive method runs once (it is the slow one).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GRID = tuple(round(0.05 * i, 2) for i in range(20))


def best_of(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def naive_curves(model, layers, feeds, grid) -> np.ndarray:
    """RR (L, G) by pruning one layer at one level and running the whole network."""
    from onnxdiag.instrument import expose_tensors
    from onnxdiag.runner import OrtRunner
    from onnxdiag.sparsity import magnitude_mask, read_weights
    from onnxdiag.sparsity.masks import apply_masks
    from onnxdiag.sparsity.repair import channel_rows
    from onnxdiag.sparsity.repairability import PairMoments, distortions

    weights = read_weights(model, layers)
    dense_runner = OrtRunner(expose_tensors(model, [la.output for la in layers]))
    dense = [dense_runner.run(f) for f in feeds]
    rr = np.zeros((len(layers), len(grid)))
    for i, la in enumerate(layers):
        for j, s in enumerate(grid):
            pruned = apply_masks(model, {la.node_name: magnitude_mask(weights[la.node_name], s)})
            runner = OrtRunner(expose_tensors(pruned, [la.output]))
            acc = PairMoments(la.n_out)
            for f, d in zip(feeds, dense):
                yp = runner.run(f, [la.output])[la.output]
                yd = channel_rows(d[la.output])
                acc.update(yd, yd - channel_rows(yp))
            raw, rep = distortions(acc)
            rr[i, j] = (rep + 1e-12) / (raw + 1e-12)
    return rr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models/sample/model.onnx"))
    ap.add_argument("--data", default=str(ROOT / "models/sample/calib.npz"))
    ap.add_argument("--n", type=int, default=1000, help="calibration images")
    ap.add_argument("--batch-size", type=int, default=250)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args(argv)

    from onnxdiag.graph import analyze_structure
    from onnxdiag.model_io import load_model
    from onnxdiag.runner import OrtRunner
    from onnxdiag.sparsity import compute_rr_curves, find_prunable
    from onnxdiag.sparsity.repairability import choose_strategy

    model = load_model(args.model)
    layers = find_prunable(analyze_structure(model))
    data = np.load(args.data)
    name = model.graph.input[0].name
    x = data["input"][:args.n]
    feeds = [{name: x[i:i + args.batch_size]} for i in range(0, len(x), args.batch_size)]
    plain = OrtRunner(model)

    def dense_pass():
        for f in feeds:
            plain.run(f)

    def rr_pass():
        return compute_rr_curves(model, layers, feeds, grid=GRID, n_images=len(x))

    t_dense = best_of(dense_pass, args.repeat)
    t_rr = best_of(rr_pass, args.repeat)
    fast = rr_pass()
    t_forced = {s: best_of(lambda s=s: compute_rr_curves(model, layers, feeds, grid=GRID,
                                                         n_images=len(x), strategy=s),
                           args.repeat) for s in ("incremental", "gram")}
    result = {"model": args.model, "n_images": len(x), "n_layers": len(layers),
              "grid_points": len(GRID), "dense_s": t_dense, "rr_s": t_rr,
              "rr_over_dense": t_rr / t_dense, "target_rr_over_dense": 3.0,
              "rr_s_every_layer_incremental": t_forced["incremental"],
              "rr_s_every_layer_gram": t_forced["gram"],
              "machine": platform.platform(), "python": sys.version.split()[0]}
    if not args.skip_naive:
        t0 = time.perf_counter()
        slow = naive_curves(model, layers, feeds, GRID)
        result["naive_s"] = time.perf_counter() - t0
        result["speedup_over_naive"] = result["naive_s"] / t_rr
        # s = 0: the fast RR is 1 by definition (D_raw = 0); the naive one is the ratio of
        # two float32 noise terms (two ORT sessions fuse differently), so compare s > 0
        result["max_abs_rr_diff_naive_vs_fast"] = float(np.max(np.abs(slow - fast.rr)[:, 1:]))
        result["naive_rr_at_s0"] = [float(v) for v in slow[:, 0]]
        result["strategies"] = {la.node_name: choose_strategy(
            la.n_out, int(np.prod(la.kernel or (1,))) * la.n_in // la.groups, la.groups,
            len(GRID)) for la in layers}
    print(json.dumps(result, indent=2))
    print(f"\n| {len(x)} images, {len(layers)} layers, {len(GRID)}-point grid | seconds | "
          "x dense |\n|---|---:|---:|")
    print(f"| one dense ORT pass | {t_dense:.3f} | 1.00 |")
    print(f"| RR curves, all layers (compute_rr_curves, auto) | {t_rr:.3f} | "
          f"{t_rr / t_dense:.1f} |")
    for s, t in t_forced.items():
        print(f"| RR curves, every layer {s} | {t:.3f} | {t / t_dense:.1f} |")
    if "naive_s" in result:
        print(f"| naive: prune one layer at one level, full network, every (layer, level) | "
              f"{result['naive_s']:.3f} | {result['naive_s'] / t_dense:.1f} |")
        print(f"\nspeed-up over naive: {result['speedup_over_naive']:.1f}x; max |RR naive - "
              f"RR fast| over s > 0 = {result['max_abs_rr_diff_naive_vs_fast']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
