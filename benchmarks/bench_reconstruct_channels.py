#!/usr/bin/env python3
"""Structured reconstruction (docs/METHODS.md §E2, §E3): its cost, and what it recovers.

    python benchmarks/bench_reconstruct_channels.py cost
    python benchmarks/bench_reconstruct_channels.py recovery MODEL CALIB EVAL [MODEL ...]
        [--fold-bn] [--finetune TRAIN] [--ratios 0.25,0.5,0.75] [--latency]
    python benchmarks/bench_reconstruct_channels.py choice MODEL CALIB EVAL [MODEL ...]
    python benchmarks/bench_reconstruct_channels.py latency MODEL CALIB EVAL [MODEL ...]
    python benchmarks/bench_reconstruct_channels.py --smoke

``cost``: on the bundled sample (models/sample; its calibration images tiled to 1,000 and
4,000), one dense ONNX Runtime pass over the calibration data vs the whole reconstruction
of a 50 % magnitude plan (the consumers' input-moments pass, the fits, the fold, the
pruning and the finalizer), interleaved, median of 5 rounds (the target: ≤ 2×). The dense
pass is timed with ONNX Runtime's threads spinning (its default) and sleeping between
runs; the ratios are against the faster of the two. The reconstruction is also timed with
its conv input rows sampled in NumPy (``in_graph=False``) instead of inside the graph.

``recovery``: per model, kept fraction (magnitude score, uniform budget: FLOPs equal for
every recovery), top-1 % with no recovery / BN recalibration / reconstruction /
reconstruction + BN recalibration (/ fine-tuning of the unrepaired model with
``--finetune TRAIN``, in the ONNX Runtime training environment), FLOPs ratio and, with
``--latency``, the batch-32 CPU speed-up (1 thread). ``--fold-bn``: each MODEL's
Conv+BN pairs folded first (a BN-folded export: BN recalibration then re-standardises).

``choice``: at equal FLOPs (uniform budget), top-1 % of magnitude / wanda / recon
(repair-aware) choices, each unrepaired and reconstructed; several MODELs (training
seeds) give mean ± sd per cell.

``latency``: the CPU speed-up at batch 1 and 32 (1 thread, 41 interleaved rounds) vs the
FLOPs ratio of each magnitude plan.

``--smoke``: all four on tiny inputs (the sample, 200 calibration / 300 evaluation
images, one ratio). Consistency checks (every run): the reconstruction leaves a smaller
mean consumer output error than no repair, and reconstructing nothing is the identity.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import SAMPLE, check  # noqa: E402

RECOVERIES = ("none", "bn", "recon", "recon+bn")


def _setup(model_path, calib_path, eval_path, limit=None, eval_limit=None, fold_bn=False,
           batch_size=64):
    from onnxdiag import DataRequest
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model
    from onnxdiag.model.optimize import optimize_for_inference

    m = load_model(model_path)
    if fold_bn:
        m, _ = optimize_for_inference(m)
    s = analyze_structure(m)
    specs = get_input_specs(m)
    calib = DataRequest(str(calib_path), limit=limit, batch_size=batch_size).open(specs)
    evaluation = DataRequest(str(eval_path), limit=eval_limit).open(specs)
    return m, s, calib, evaluation


def _plan(m, s, name, ratio, moments):
    from onnxdiag.structured import plan_pruning
    from onnxdiag.structured.choice import layer_scores

    scores, _ = layer_scores(name, m, s, None, moments=moments)
    return plan_pruning(m, s, scores, ratio, budget="uniform", seed=0, score_name=name)


def _variants(m, s, plan, calib, moments, wanted, cache, train=None):
    """{recovery: model} for the ``wanted`` recoveries of one plan; the reconstruction
    record under "record"."""
    from onnxdiag.commands.base import HeadChoice
    from onnxdiag.commands.channel_pruning import (
        Recovery,
        finetune_pruned,
        recalibrate_pruned,
        reconstruct_pruned,
    )
    from onnxdiag.model.finalize import finalize_model
    from onnxdiag.structured.plan import prune_planned

    plain = finalize_model(prune_planned(m, s, plan.removed)[0])
    out = {"none": plain}
    if {"recon", "recon+bn"} & set(wanted):
        out["recon"], out["record"] = reconstruct_pruned(m, s, plan.removed, moments,
                                                         Recovery(reconstruct=True))
    if "bn" in wanted:
        out["bn"] = recalibrate_pruned(plain, calib, None, m, s, plan.removed, cache=cache)[0]
    if "recon+bn" in wanted:
        out["recon+bn"] = recalibrate_pruned(out["recon"], calib, None, m, s, plan.removed,
                                             cache=cache)[0]
    if "finetune" in wanted:
        rec = Recovery(finetune=True, epochs=1, max_batches=50)
        out["finetune"] = finetune_pruned(plain, train, rec, seed=0,
                                          head=HeadChoice(s.head.node_name))[0]
    return out


def _acc(model, evaluation) -> float:
    from onnxdiag.evaluate import evaluate
    from onnxdiag.graph import analyze_structure

    return 100 * evaluate(model, analyze_structure(model).head, evaluation).accuracy


# -- cost -------------------------------------------------------------------------------------
def cost(sizes=(1000, 4000), rounds=5) -> None:
    """The table of ``cost`` for calibration sets of each of ``sizes`` images (the sample's
    calibration images, tiled)."""
    print("\n### Cost on models/sample (50 % magnitude plan, batch 256; interleaved, median of "
          f"{rounds})\n")
    print("| calibration images | dense pass s (spinning / not) | reconstruction s | × dense "
          "pass | NumPy-sampled rows s | × dense pass |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-recon-") as tmp:
        with np.load(SAMPLE / "calib.npz") as z:
            x, y = z["input"], z["labels"]
        for n in sizes:
            reps = -(-n // len(x))
            path = Path(tmp) / f"calib_{n}.npz"
            np.savez(path, input=np.concatenate([x] * reps)[:n],
                     labels=np.concatenate([y] * reps)[:n])
            (d_spin, d_sleep), r, r_np, record = _cost_one(path, rounds)
            d = min(d_spin, d_sleep)  # the ratios against the faster dense pass
            print(f"| {n} | {d_spin:.3f} / {d_sleep:.3f} | {r:.3f} | {r / d:.2f} | "
                  f"{r_np:.3f} | {r_np / d:.2f} |")
            check(record["mean_error_after"] < record["mean_error_before"],
                  "reconstruction lowers the mean consumer output error")


def _cost_one(calib_path, rounds):
    """((dense s, dense with ORT threads not spinning s), reconstruction s, the same with
    NumPy-sampled rows s, record): medians of ``rounds`` interleaved rounds."""
    from onnxdiag.runtime.runner import OrtRunner
    from onnxdiag.structured.reconstruct import (
        collect_input_moments,
        consumer_sites,
        prune_reconstructed,
    )

    m, s, calib, _ = _setup(SAMPLE / "model.onnx", calib_path, SAMPLE / "eval.npz",
                            eval_limit=10, batch_size=256)
    plan = _plan(m, s, "magnitude", 0.5, None)
    runners = {"dense": OrtRunner(m), "dense, not spinning": OrtRunner(m, spinning=False)}
    times = {"dense": [], "dense, not spinning": [], True: [], False: []}
    for _ in range(rounds):
        for key, runner in runners.items():
            t0 = time.perf_counter()
            for batch in calib.batches():
                runner.run(batch.feeds)
            times[key].append(time.perf_counter() - t0)
        for in_graph in (True, False):
            t0 = time.perf_counter()
            moments = collect_input_moments(m, consumer_sites(s), calib, in_graph=in_graph)
            _, _, record = prune_reconstructed(m, s, plan.removed, moments)
            times[in_graph].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return (med["dense"], med["dense, not spinning"]), med[True], med[False], record.to_dict()


# -- recovery ---------------------------------------------------------------------------------
def recovery(models, ratios, fold_bn=False, train_path=None, latency=False, limits=(None, None)):
    from onnxdiag.structured.choice import consumer_moments
    from onnxdiag.structured.reconstruct import reconstruct_model

    wanted = RECOVERIES + (("finetune",) if train_path else ())
    header = ["model", "kept", "FLOPs ratio", *wanted] + (["speed-up b=32"] if latency else [])
    print(f"\n### Recovery at equal FLOPs (magnitude, uniform){' — BN folded' * fold_bn}\n")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for path, calib_path, eval_path in models:
        m, s, calib, evaluation = _setup(path, calib_path, eval_path, *limits, fold_bn=fold_bn)
        moments = consumer_moments(m, s, calib)
        same, _ = reconstruct_model(m, s, {}, moments)
        check(_acc(same, evaluation) == _acc(m, evaluation), "reconstructing nothing = identity")
        train = None
        if train_path:
            from onnxdiag import DataRequest
            from onnxdiag.model.io import get_input_specs

            train = DataRequest(str(train_path)).open(get_input_specs(m))
        cache = {}
        print(f"| {_short(path)} | 1.00 | 1.000 | " + " | ".join(
            [f"{_acc(m, evaluation):.2f}"] * len(wanted)) + (" | 1.00 |" if latency else " |"))
        for ratio in ratios:
            plan = _plan(m, s, "magnitude", ratio, None)
            out = _variants(m, s, plan, calib, moments, wanted, cache, train)
            rec = out["record"]
            check(rec["mean_error_after"] < rec["mean_error_before"],
                  "reconstruction lowers the mean consumer output error")
            cells = [f"{_acc(out[k], evaluation):.2f}" for k in wanted]
            flops = plan.flops_after / plan.flops_before
            row = [_short(path), f"{1 - ratio:.2f}", f"{flops:.3f}", *cells]
            if latency:
                row.append(f"{_speedup(m, out['none'], evaluation):.2f}")
            print("| " + " | ".join(row) + " |")


def _speedup(m, pruned, evaluation) -> float:
    from onnxdiag.commands.base import example_input
    from onnxdiag.model.io import get_input_specs
    from onnxdiag.runtime.latency import compare_latency

    x = example_input(get_input_specs(m), evaluation)
    return compare_latency(m, pruned, {32: x}, threads=1)["speedup"]["32"]


def latency(models, ratios, rounds=41) -> None:
    """CPU speed-up (1 thread, interleaved, median of ``rounds``) vs the FLOPs ratio of the
    magnitude plans (the reconstruction does not change the pruned graph's shape)."""
    from onnxdiag.commands.base import example_input
    from onnxdiag.model.finalize import finalize_model
    from onnxdiag.model.io import get_input_specs
    from onnxdiag.runtime.latency import compare_latency
    from onnxdiag.structured.plan import prune_planned

    print(f"\n### CPU speed-up vs FLOPs ratio (1 thread, median of {rounds} interleaved "
          "rounds, IQR of the per-round ratios)\n")
    print("| model | kept | FLOPs ratio | speed-up b=1 | speed-up b=32 |\n|---|---|---|---|---|")
    for path, calib_path, eval_path in models:
        m, s, _, evaluation = _setup(path, calib_path, eval_path, eval_limit=32)
        x = example_input(get_input_specs(m), evaluation)
        for ratio in ratios:
            plan = _plan(m, s, "magnitude", ratio, None)
            pruned = finalize_model(prune_planned(m, s, plan.removed)[0])
            lat = compare_latency(m, pruned, {1: x[:1], 32: x}, rounds=rounds, threads=1)
            cells = [f"{lat['speedup'][b]:.2f} ({lat['speedup_iqr'][b][0]:.2f}–"
                     f"{lat['speedup_iqr'][b][1]:.2f})" for b in ("1", "32")]
            print(f"| {_short(path)} | {1 - ratio:.2f} | "
                  f"{plan.flops_after / plan.flops_before:.3f} | " + " | ".join(cells) + " |")


# -- choice -----------------------------------------------------------------------------------
def choice(models, ratios, limits=(None, None)) -> None:
    from onnxdiag.structured.choice import consumer_moments

    scores = ("magnitude", "wanda", "recon")
    results: dict = {}
    for path, calib_path, eval_path in models:
        m, s, calib, evaluation = _setup(path, calib_path, eval_path, *limits)
        moments = consumer_moments(m, s, calib)
        results.setdefault(("dense", 1.0, "none"), []).append(_acc(m, evaluation))
        for ratio in ratios:
            flops = set()
            for name in scores:
                plan = _plan(m, s, name, ratio, moments)
                flops.add(plan.flops_after)
                out = _variants(m, s, plan, calib, moments, ("none", "recon"), {})
                for rec in ("none", "recon"):
                    results.setdefault((name, ratio, rec), []).append(
                        _acc(out[rec], evaluation))
            check(len(flops) == 1, "every score prunes to the same FLOPs")
    n = len(models)
    print(f"\n### Channel choice at equal FLOPs, top-1 % (mean ± sd over {n} model(s))\n")
    print("| kept | " + " | ".join(f"{sc} none | {sc} recon" for sc in scores)
          + " |\n|" + "---|" * (1 + 2 * len(scores)))
    print(f"| 1.00 (dense) | {_ms(results[('dense', 1.0, 'none')])} |")
    for ratio in ratios:
        cells = [_ms(results[(sc, ratio, rec)]) for sc in scores for rec in ("none", "recon")]
        print(f"| {1 - ratio:.2f} | " + " | ".join(cells) + " |")


def _ms(values) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}"


def _short(path) -> str:
    p = Path(path)
    return f"{p.parent.parent.name}/{p.name}" if p.parent.name == "checkpoints" else str(p)


def _models(items) -> list[tuple]:
    if len(items) % 3:
        raise SystemExit("give MODEL CALIB EVAL triples")
    return [tuple(items[i:i + 3]) for i in range(0, len(items), 3)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=("cost", "recovery", "choice", "latency"))
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--ratios", default="0.25,0.5,0.75")
    parser.add_argument("--fold-bn", action="store_true")
    parser.add_argument("--latency", action="store_true")
    parser.add_argument("--finetune", default=None, metavar="TRAIN")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--eval-limit", type=int, default=None)
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    if args.smoke:
        sample = [(SAMPLE / "model.onnx", SAMPLE / "calib.npz", SAMPLE / "eval.npz")]
        cost(sizes=(200,), rounds=1)
        recovery(sample, [0.5], latency=True, limits=(200, 300))
        recovery(sample, [0.5], fold_bn=True, limits=(200, 300))
        choice(sample, [0.5], limits=(200, 300))
        latency(sample, [0.5], rounds=3)
        return 0
    limits = (args.limit, args.eval_limit)
    if args.mode == "cost":
        cost()
    elif args.mode == "recovery":
        recovery(_models(args.paths), ratios, args.fold_bn, args.finetune, args.latency,
                 limits)
    elif args.mode == "choice":
        choice(_models(args.paths), ratios, limits)
    elif args.mode == "latency":
        latency(_models(args.paths), ratios)
    else:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
