#!/usr/bin/env python3
"""Cost of the RR curves (METHODS §C2) against one dense pass and against the naive method.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_rr.py [--n 1000] [--repeat 3]
    python benchmarks/bench_rr.py --smoke      # 64 images, 4-point grid, seconds

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

Consistency checks (every run): the exact curves match the naive method's to 1e-4 over
s > 0 (unless --skip-naive), and two configurations with the same images and positions
give identical curves.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT, best_of, check  # noqa: E402

GRID = tuple(round(0.05 * i, 2) for i in range(20))
SMOKE_GRID = (0.0, 0.3, 0.6, 0.9)


def naive_curves(model, layers, feeds, grid) -> np.ndarray:
    """RR (L, G) by pruning one layer at one level and running the whole network."""
    from onnxdiag.model.expose import expose_tensors
    from onnxdiag.runtime.runner import OrtRunner
    from onnxdiag.sparsity import magnitude_mask, read_weights
    from onnxdiag.sparsity.masks import apply_masks
    from onnxdiag.sparsity.repair import channel_rows
    from onnxdiag.sparsity.rr_layer import PairMoments, distortions

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


def parse_args(argv=None) -> tuple[argparse.Namespace, tuple]:
    """The command line, and the grid (the small one with --smoke)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models/sample/model.onnx"))
    ap.add_argument("--data", default=str(ROOT / "models/sample/calib.npz"))
    ap.add_argument("--n", type=int, default=1000, help="calibration images")
    ap.add_argument("--batch-size", type=int, default=250)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--tradeoff", default="64,256,1000:2,4,16",
                    help="IMAGES:POSITIONS lists timed against exact (or 'none')")
    ap.add_argument("--smoke", action="store_true",
                    help="64 images in batches of 32, one repeat, the grid "
                         f"{SMOKE_GRID}, trade-off 32,64:4,16 (seconds)")
    args = ap.parse_args(argv)
    grid = GRID
    if args.smoke:
        args.n, args.batch_size, args.repeat, args.tradeoff = 64, 32, 1, "32,64:4,16"
        grid = SMOKE_GRID
    return args, grid


def main(argv=None) -> int:
    args, grid = parse_args(argv)
    from onnxdiag.commands.pruning import PrunerOptions
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

    def dense_pass():
        for f in feeds:
            plain.run(f)

    configs = {  # label: (images, positions)
        "default": (min(PrunerOptions().rr_images, len(x)), DEFAULT_POSITIONS),
        "sampled": (len(x), DEFAULT_POSITIONS),
        "exact": (len(x), "all"),
    }

    def rr(images, positions):
        return compute_rr_curves(model, layers, feeds, grid=grid, n_images=images,
                                 positions=positions)

    t_dense = best_of(dense_pass, args.repeat)
    times = {k: best_of(lambda v=v: rr(*v), args.repeat) for k, v in configs.items()}
    curves = {k: rr(*v).rr for k, v in configs.items()}
    result = summary(args, layers, grid, t_dense, configs, times, curves)
    if args.tradeoff != "none":
        result["tradeoff"] = tradeoff(args.tradeoff, len(x), rr, args.repeat, t_dense,
                                      curves["exact"])
    if not args.skip_naive:
        t0 = time.perf_counter()
        slow = naive_curves(model, layers, feeds, grid)
        result["naive_s"] = time.perf_counter() - t0
        for k in configs:
            result["configs"][k]["speedup_over_naive"] = result["naive_s"] / times[k]
        # s = 0: the fast RR is 1 by definition (D_raw = 0); the naive one is the ratio of
        # two float32 noise terms (two ORT sessions fuse differently), so compare s > 0
        result["max_abs_rr_diff_naive_vs_exact"] = float(
            np.max(np.abs(slow - curves["exact"])[:, 1:]))
    print(json.dumps(result, indent=2))
    print_tables(result, configs, times)
    checks(result, configs, curves)
    return 0


def summary(args, layers, grid, t_dense, configs, times, curves) -> dict:
    exact = curves["exact"]

    def diffs(rr):
        d = np.abs(rr - exact)
        return {"max_abs_rr_diff_vs_exact": float(d.max()),
                "mean_abs_rr_diff_vs_exact": float(d.mean()),
                "max_rel_rr_diff_vs_exact": float((d / exact).max())}

    return {"model": args.model, "n_images": configs["exact"][0],
            "n_layers": len(layers), "grid_points": len(grid), "dense_s": t_dense,
            "target_over_dense": 3.0, "machine": platform.platform(),
            "python": sys.version.split()[0],
            "configs": {k: {"images": v[0], "positions": v[1], "seconds": times[k],
                            "over_dense": times[k] / t_dense, **diffs(curves[k])}
                        for k, v in configs.items()},
            "rr_exact_range": [float(exact.min()), float(exact.max())]}


def tradeoff(spec: str, n: int, rr, repeat: int, t_dense: float, exact) -> list[dict]:
    imgs, poss = (tuple(int(v) for v in part.split(",")) for part in spec.split(":"))
    rows = []
    for images in imgs:
        for positions in poss:
            t = best_of(lambda i=images, p=positions: rr(min(i, n), p), repeat)
            d = np.abs(rr(min(images, n), positions).rr - exact)
            rows.append({"images": min(images, n), "positions": positions,
                         "seconds": t, "over_dense": t / t_dense,
                         "max_abs_rr_diff_vs_exact": float(d.max()),
                         "mean_abs_rr_diff_vs_exact": float(d.mean())})
    return rows


def print_tables(result: dict, configs: dict, times: dict) -> None:
    n, t_dense = result["n_images"], result["dense_s"]
    print(f"\n| {n} images, {result['n_layers']} layers, {result['grid_points']}-point grid | "
          "images | positions / image | seconds | x dense | speed-up over naive | "
          "max abs dRR vs exact |\n|---|---:|---:|---:|---:|---:|---:|")
    print(f"| one dense ORT pass (baseline) | {n} | - | {t_dense:.3f} | 1.00 | | |")
    naive_s = result.get("naive_s")
    for k, (images, positions) in configs.items():
        c = result["configs"][k]
        up = f"{naive_s / times[k]:.0f}x" if naive_s else "-"
        print(f"| RR curves, {k} | {images} | {positions} | {times[k]:.3f} | "
              f"{c['over_dense']:.2f} | {up} | {c['max_abs_rr_diff_vs_exact']:.4f} |")
    if naive_s:
        print(f"| naive (prune, full network, every layer x level) | {n} | all | "
              f"{naive_s:.2f} | {naive_s / t_dense:.0f} | 1x | "
              f"{result['max_abs_rr_diff_naive_vs_exact']:.1e} (s > 0) |")
    if result.get("tradeoff"):
        print("\n| images | positions / image | seconds | x dense | max abs dRR vs exact | "
              "mean abs dRR |\n|---:|---:|---:|---:|---:|---:|")
        for r in result["tradeoff"]:
            print(f"| {r['images']} | {r['positions']} | {r['seconds']:.3f} | "
                  f"{r['over_dense']:.2f} | {r['max_abs_rr_diff_vs_exact']:.4f} | "
                  f"{r['mean_abs_rr_diff_vs_exact']:.4f} |")


def checks(result: dict, configs: dict, curves: dict) -> None:
    if "max_abs_rr_diff_naive_vs_exact" in result:
        d = result["max_abs_rr_diff_naive_vs_exact"]
        check(d < 1e-4, f"exact RR curves = the naive method's over s > 0 ({d:.1e} < 1e-4)")
    seen = {}
    for k, v in configs.items():
        if v in seen:
            same = np.array_equal(curves[k], curves[seen[v]])
            check(same, f"configurations {seen[v]} and {k} ({v[0]} images, {v[1]} positions) "
                        "give identical curves")
        seen.setdefault(v, k)


if __name__ == "__main__":
    sys.exit(main())
