#!/usr/bin/env python3
"""Per layer, what each RR evaluation scheme costs (METHODS §C2, "Cost"), and which one
``auto`` picks.

    python benchmarks/bench_rr_layers.py --model R50/model.onnx --data R50/calib.npz
    python benchmarks/bench_rr_layers.py --smoke     # the bundled CNN, 16 images, seconds

The RR capture pass runs once (the first --n images, DEFAULT_POSITIONS positions per
image, columns kept per layer); then every layer is folded and finished on this thread
under ``incremental`` and under ``gram`` (forced), --repeat times, best of. The table
gives each layer's seconds under both, and the totals of the choice of ``auto`` (rows
known: the whole costs of rr_strategy.choose_strategy), of the per-sample rule it
replaced (rows unknown), and of the better of the two per layer.

Consistency check (every run): both schemes give the same curves (RR to 1e-4 relative).
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT, check  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models/sample/model.onnx"))
    ap.add_argument("--data", default=str(ROOT / "models/sample/calib.npz"))
    ap.add_argument("--n", type=int, default=64, help="calibration images (RR's default)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--top", type=int, default=12, help="layers listed (largest first)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.n, args.repeat, args.top = 16, 1, 4

    from onnxdiag.data.source import open_data
    from onnxdiag.graph import GraphIndex, analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model
    from onnxdiag.sparsity import DEFAULT_GRID, find_prunable
    from onnxdiag.sparsity.repairability import DEFAULT_POSITIONS, _plan
    from onnxdiag.sparsity.rr_capture import capture
    from onnxdiag.sparsity.rr_layer import finish_layer, fold_columns
    from onnxdiag.sparsity.rr_strategy import choose_strategy, layer_positions

    model = load_model(args.model)
    specs = get_input_specs(model)
    name = specs[0].name
    x = np.load(args.data)["input"][:args.n].astype(np.float32)
    feeds = [b.feeds for b in open_data({name: x}, specs,
                                        batch_size=args.batch_size).batches()]
    layers = find_prunable(analyze_structure(model))
    index = GraphIndex(model)
    grid = np.asarray(DEFAULT_GRID)
    pos = DEFAULT_POSITIONS
    plans = {s: [_plan(index, la, grid, s, pos, 0, len(x)) for la in layers]
             for s in ("incremental", "gram")}
    cols, seen, _ = capture(model, index, layers, plans["gram"], feeds, len(x), pos, 0,
                            fold=None, providers=None, threads=None)

    def cost(plan, batches) -> tuple[float, list]:
        best, curves = np.inf, None
        for _ in range(args.repeat):
            p = copy.deepcopy(plan)
            t = time.perf_counter()
            for c in batches:
                fold_columns(p, np.array(c), own=True)
            curves = finish_layer(p)[0]
            best = min(best, time.perf_counter() - t)
        return best, curves

    rows, worst = [], 0.0
    for i, la in enumerate(layers):
        (t_inc, c_inc), (t_gram, c_gram) = (cost(plans[s][i], cols[i])
                                            for s in ("incremental", "gram"))
        rr = [[(r + 1e-12) / (d + 1e-12) for d, r in c] for c in (c_inc, c_gram)]
        worst = max(worst, float(np.max(np.abs(np.subtract(*rr)) / np.maximum(
            np.abs(rr[1]), 1e-12))))
        per = layer_positions(la)
        n = seen * (min(pos, per) if per is not None else pos)
        g = plans["gram"][i]
        k = g["dense_rows"].shape[1]
        args_ = (la.n_out, k, g["groups"], len(grid))
        rows.append((la.node_name, la.n_out, k, g["groups"], n, t_inc, t_gram,
                     choose_strategy(*args_, n_samples=n), choose_strategy(*args_)))
    pick = {"incremental": 5, "gram": 6}
    total = {
        "auto (rows known)": sum(r[pick[r[7]]] for r in rows),
        "per-sample rule (rows unknown)": sum(r[pick[r[8]]] for r in rows),
        "all incremental": sum(r[5] for r in rows),
        "all gram": sum(r[6] for r in rows),
        "better of the two per layer": sum(min(r[5], r[6]) for r in rows),
    }
    print(f"{args.model}: {len(layers)} layers, {seen} images x {pos} positions, "
          f"{len(grid)}-point grid; {platform.processor() or platform.machine()}")
    print("\n| layer | C | K | groups | rows | incremental s | gram s | auto | per-sample rule |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for r in sorted(rows, key=lambda r: -max(r[5], r[6]))[:args.top]:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.3f} | {r[6]:.3f} | "
              f"{r[7]} | {r[8]} |")
    print("\n| fold + finish of every layer, one thread | seconds |\n|---|---:|")
    for k, v in total.items():
        print(f"| {k} | {v:.2f} |")
    check(worst < 1e-4, f"both schemes give the same RR curves (max relative "
                        f"difference {worst:.1e})")


if __name__ == "__main__":
    main()
