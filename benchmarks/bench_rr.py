#!/usr/bin/env python3
"""Cost of the RR curves (METHODS §C2) against one dense pass and against the naive method.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_rr.py [--n 1000] [--repeat 3]

On N calibration images (models/sample/calib.npz), in one process, with a 20-point grid
{0, 0.05, ..., 0.95} for every prunable layer:
  dense    one plain ONNX Runtime pass over the N images (the baseline, 1.00x)
  default  what `onnxdiag rr` / `sweep` / `prune` compute by default: the first --rr-images
           (64) images, DEFAULT_POSITIONS (16) sampled conv output positions per image
  sampled  all N images, DEFAULT_POSITIONS positions per image
  exact    all N images, every position (positions="all")
  naive    for every layer and every grid level: prune that layer alone (apply_masks), build
           an ORT session exposing its output, run the full network over the N images and
           accumulate the same moments (the dense outputs are captured once and reused)
Accuracy: max |RR - RR_exact| over layers x grid for default and sampled; naive vs exact
(s > 0). Timings: best of --repeat after a warm-up; the naive method runs once.
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
    from onnxdiag.model.expose import expose_tensors
    from onnxdiag.runtime.runner import OrtRunner
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
    ap.add_argument("--tradeoff", default="64,256,1000:2,4,16",
                    help="IMAGES:POSITIONS lists timed against exact (or 'none')")
    args = ap.parse_args(argv)

    from onnxdiag.commands.pruning import DEFAULTS
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import load_model
    from onnxdiag.runtime.runner import OrtRunner
    from onnxdiag.sparsity import compute_rr_curves, find_prunable
    from onnxdiag.sparsity.repairability import DEFAULT_POSITIONS

    model = load_model(args.model)
    layers = find_prunable(analyze_structure(model))
    data = np.load(args.data)
    name = model.graph.input[0].name
    x = data["input"][:args.n]
    feeds = [{name: x[i:i + args.batch_size]} for i in range(0, len(x), args.batch_size)]
    plain = OrtRunner(model)
    n_default = min(DEFAULTS["rr_images"], len(x))

    def dense_pass():
        for f in feeds:
            plain.run(f)

    configs = {  # label: (images, positions)
        "default": (n_default, DEFAULT_POSITIONS),
        "sampled": (len(x), DEFAULT_POSITIONS),
        "exact": (len(x), "all"),
    }

    def rr(images, positions):
        return compute_rr_curves(model, layers, feeds, grid=GRID, n_images=images,
                                 positions=positions)

    t_dense = best_of(dense_pass, args.repeat)
    times = {k: best_of(lambda v=v: rr(*v), args.repeat) for k, v in configs.items()}
    curves = {k: rr(*v) for k, v in configs.items()}
    exact = curves["exact"].rr
    result = {"model": args.model, "n_images": len(x), "n_layers": len(layers),
              "grid_points": len(GRID), "dense_s": t_dense, "target_over_dense": 3.0,
              "machine": platform.platform(), "python": sys.version.split()[0],
              "configs": {k: {"images": v[0], "positions": v[1], "seconds": times[k],
                              "over_dense": times[k] / t_dense,
                              "max_abs_rr_diff_vs_exact": float(np.abs(curves[k].rr - exact)
                                                                .max()),
                              "mean_abs_rr_diff_vs_exact": float(np.abs(curves[k].rr - exact)
                                                                 .mean()),
                              "max_rel_rr_diff_vs_exact": float((np.abs(curves[k].rr - exact)
                                                                 / exact).max())}
                          for k, v in configs.items()},
              "rr_exact_range": [float(exact.min()), float(exact.max())]}
    if args.tradeoff != "none":
        imgs, poss = (tuple(int(v) for v in part.split(",")) for part in args.tradeoff.split(":"))
        rows = []
        for images in imgs:
            for positions in poss:
                t = best_of(lambda i=images, p=positions: rr(min(i, len(x)), p), args.repeat)
                d = np.abs(rr(min(images, len(x)), positions).rr - exact)
                rows.append({"images": min(images, len(x)), "positions": positions,
                             "seconds": t, "over_dense": t / t_dense,
                             "max_abs_rr_diff_vs_exact": float(d.max()),
                             "mean_abs_rr_diff_vs_exact": float(d.mean())})
        result["tradeoff"] = rows
    if not args.skip_naive:
        t0 = time.perf_counter()
        slow = naive_curves(model, layers, feeds, GRID)
        result["naive_s"] = time.perf_counter() - t0
        for k in configs:
            result["configs"][k]["speedup_over_naive"] = result["naive_s"] / times[k]
        # s = 0: the fast RR is 1 by definition (D_raw = 0); the naive one is the ratio of
        # two float32 noise terms (two ORT sessions fuse differently), so compare s > 0
        result["max_abs_rr_diff_naive_vs_exact"] = float(np.max(np.abs(slow - exact)[:, 1:]))
    print(json.dumps(result, indent=2))
    print(f"\n| {len(x)} images, {len(layers)} layers, {len(GRID)}-point grid | images | "
          "positions / image | seconds | x dense | speed-up over naive | max abs dRR vs exact |"
          "\n|---|---:|---:|---:|---:|---:|---:|")
    print(f"| one dense ORT pass (baseline) | {len(x)} | - | {t_dense:.3f} | 1.00 | | |")
    naive_s = result.get("naive_s")
    for k, (images, positions) in configs.items():
        c = result["configs"][k]
        up = f"{naive_s / times[k]:.0f}x" if naive_s else "-"
        print(f"| RR curves, {k} | {images} | {positions} | {times[k]:.3f} | "
              f"{c['over_dense']:.2f} | {up} | {c['max_abs_rr_diff_vs_exact']:.4f} |")
    if naive_s:
        print(f"| naive (prune, full network, every layer x level) | {len(x)} | all | "
              f"{naive_s:.2f} | {naive_s / t_dense:.0f} | 1x | "
              f"{result['max_abs_rr_diff_naive_vs_exact']:.1e} (s > 0) |")
    if result.get("tradeoff"):
        print("\n| images | positions / image | seconds | x dense | max abs dRR vs exact | "
              "mean abs dRR |\n|---:|---:|---:|---:|---:|---:|")
        for r in result["tradeoff"]:
            print(f"| {r['images']} | {r['positions']} | {r['seconds']:.3f} | "
                  f"{r['over_dense']:.2f} | {r['max_abs_rr_diff_vs_exact']:.4f} | "
                  f"{r['mean_abs_rr_diff_vs_exact']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
