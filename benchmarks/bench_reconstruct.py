#!/usr/bin/env python3
"""What does the LS reconstruction repair (docs/METHODS.md §E1) cost next to one dense pass?

    python benchmarks/bench_reconstruct.py [--model M] [--images 512] [--batch 64]
        [--sparsity 0.8] [--positions all,16] [--dense-positions 16,8] [--runs 3]
        [--fold-bn] [--json OUT]

Prunes ``--model`` (default: the bundled CNN sample, models/sample) to ``--sparsity`` with
ERK and times, interleaved in one process and repeated ``--runs`` times (median and min
reported): one dense ONNX Runtime pass over the ``--images`` calibration images (the
denominator), the ``ls`` repair of every reached layer at each ``--positions`` setting
('all' = every conv position, exact; N = N sampled positions per image), the same
repair with dense inputs (``--ls-inputs dense``: one dense pass fits every layer) at each
``--dense-positions`` setting, and the ``bn`` repair for scale. It also prints the FLOPs
floor: the products Σ 2·P·K·(K + C_out) (H_pp, plus x_p·y_dᵀ where the input was
reached) against the dense pass's 2·P·K·C_out of the same layers.
``--fold-bn`` first folds every BatchNormalization into its conv (a BN-folded export).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "sample" / "model.onnx"))
    ap.add_argument("--data", default=str(ROOT / "models" / "sample" / "calib.npz"))
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.8)
    ap.add_argument("--positions", default="all,16")
    ap.add_argument("--dense-positions", default="16,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fold-bn", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny run (16 images, 1 run)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.images, args.batch, args.runs = 16, 8, 1
    return args


def flops_floor(model, structure, layers, masks, positions=None) -> tuple[float, float]:
    """(Gram FLOPs of the sequential LS, dense-pass FLOPs of the same layers) per
    calibration image: 2·P·K² for H_pp, plus 2·P·K·C_out/g for the cross term x_p·y_dᵀ
    where pruning reached the input, P the layer's output positions (``positions``
    sampled ones when fewer)."""
    from onnxdiag.graph import GraphIndex
    from onnxdiag.sparsity.recal import affected_tensors

    affected = affected_tensors(GraphIndex(model), [n for n, m in masks.items()
                                                    if not np.all(m)])
    gram = dense = 0.0
    for la in layers:
        if la.node_name not in masks or la.flops is None:
            continue
        if np.all(masks[la.node_name]) and la.input not in affected:
            continue
        per_group_k = la.n_in // la.groups * int(np.prod(la.kernel or (1,)))
        every = la.flops / 2 / (per_group_k * la.n_out)
        p = every if positions is None else min(every, positions)
        cross = la.n_out // la.groups if la.input in affected else 0
        gram += 2 * p * la.groups * per_group_k * (per_group_k + cross)
        dense += la.flops
    return gram, dense


def compare_solvers(model, structure, masks, batches) -> dict:
    """none / exact / SparseGPT on the same masks: mean layer error after, agreement."""
    from onnxdiag.sparsity.ls_repair import LSSettings
    from onnxdiag.sparsity.sweep import Pruner

    pruner = Pruner(model, structure, batches)
    out = {}
    print("| solver | mean layer error before | mean layer error after | agreement % |")
    print("|---|---:|---:|---:|")
    for solver in ("exact", "sparsegpt"):
        pruner.ls = LSSettings(solver=solver)
        pruned, rec = pruner.prune(None, "ls", masks=masks)
        errs = [(v.error_before, v.error_after) for v in rec.layers.values()]
        before, after = (float(np.mean([e[i] for e in errs])) for i in (0, 1))
        agr = pruner.agreement(pruned)
        out[solver] = {"mean_error_before": before, "mean_error_after": after,
                       "agreement": agr, "record": rec}
        print(f"| {solver} | {before:.3f} | {after:.3f} | {100 * agr:.1f} |")
    none = pruner.agreement(pruner.prune(None, "none", masks=masks)[0])
    print(f"| (no repair) | | | {100 * none:.1f} |")
    return out


def main(argv=None) -> int:
    from common import check

    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import load_model
    from onnxdiag.runtime.runner import OrtRunner
    from onnxdiag.sparsity import (
        allocate_sparsity,
        describe_layers,
        find_prunable,
        make_masks,
        read_weights,
        repair_model,
    )
    from onnxdiag.sparsity.ls_repair import LSSettings

    args = parse_args(argv)
    model = load_model(args.model)
    if args.fold_bn:
        from onnxdiag.model.optimize import optimize_for_inference

        model = optimize_for_inference(model)[0]
    structure = analyze_structure(model)
    layers = find_prunable(structure)
    weights = read_weights(model, layers)
    alloc = allocate_sparsity("erk", describe_layers(model, layers), args.sparsity,
                              weights=weights)
    masks = make_masks(alloc, weights)
    with np.load(args.data) as z:
        x = z[[k for k in z.files if k != "labels"][0]][:args.images].astype(np.float32)
    name = model.graph.input[0].name
    batches = [{name: x[i:i + args.batch]} for i in range(0, len(x), args.batch)]
    runner = OrtRunner(model)
    positions = [None if p == "all" else int(p) for p in args.positions.split(",")]

    def dense():
        for b in batches:
            runner.run(b)

    jobs = {"dense pass": dense,
            "bn repair": lambda: repair_model(model, structure, masks, batches, method="bn")}
    for p in positions:
        jobs[f"ls, positions {p or 'all'}"] = (lambda p=p: repair_model(
            model, structure, masks, batches, method="ls", ls=LSSettings(positions=p)))
    for p in [None if p == "all" else int(p) for p in args.dense_positions.split(",")]:
        jobs[f"ls dense inputs, positions {p or 'all'}"] = (lambda p=p: repair_model(
            model, structure, masks, batches, method="ls",
            ls=LSSettings(positions=p, inputs="dense")))
    times = {k: [] for k in jobs}
    load_before = os.getloadavg()[0]
    for _ in range(args.runs):
        for k, fn in jobs.items():  # interleaved: load hits every job alike
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    gram, dense_flops = flops_floor(model, structure, structure.layers, masks)
    gram16 = flops_floor(model, structure, structure.layers, masks, 16)[0]
    base = statistics.median(times["dense pass"])
    folded = " (BN folded)" if args.fold_bn else ""
    print(f"# LS reconstruction cost: {Path(args.model).name}{folded}, {len(x)} images, "
          f"batch {args.batch}, S = {args.sparsity} (ERK), {args.runs} runs, "
          f"{platform.machine()} {platform.python_version()}, load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| job | median s | min s | / dense pass (median) | / dense pass (min) |")
    print("|---|---:|---:|---:|---:|")
    rows = {}
    for k, ts in times.items():
        med = statistics.median(ts)
        rows[k] = {"median_s": med, "min_s": min(ts), "ratio": med / base,
                   "ratio_min": min(ts) / min(times["dense pass"])}
        print(f"| {k} | {med:.3f} | {min(ts):.3f} | {med / base:.2f} | "
              f"{rows[k]['ratio_min']:.2f} |")
    print(f"FLOPs floor of the sequential LS products (H_pp and x_p·y_dᵀ): every position "
          f"{gram / max(dense_flops, 1):.1f}x, 16 positions {gram16 / max(dense_flops, 1):.1f}x "
          f"the reached layers' dense FLOPs ({gram / 1e6:.1f} / {gram16 / 1e6:.1f} vs "
          f"{dense_flops / 1e6:.1f} MFLOP per image)")
    solvers = compare_solvers(model, structure, masks, batches)
    rec = solvers["exact"]["record"]
    worse = [k for k, v in rec.layers.items() if v.error_after > v.error_before + 1e-6]
    check(not worse, f"LS lowers every refitted layer's output error ({len(rec.layers)} layers)")
    check(all(v["mean_error_after"] >= solvers["exact"]["mean_error_after"] - 1e-9
              for v in solvers.values()), "the exact solves have the lowest mean layer error")
    rows["solvers"] = {k: {kk: vv for kk, vv in v.items() if kk != "record"}
                       for k, v in solvers.items()}
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "jobs": rows,
                                               "gram_flops_per_image": gram,
                                               "dense_flops_per_image": dense_flops}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
