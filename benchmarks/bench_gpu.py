#!/usr/bin/env python3
"""Every measurement pass's cost relative to plain inference, on CPU and on CUDA (issue 20).

    python benchmarks/bench_gpu.py [--providers cpu,cuda] [--n 10000] [--repeat 3]
    python benchmarks/bench_gpu.py --smoke        # 512 images, one repeat, seconds

On the bundled sample (models/sample/model.onnx) and N real Fashion-MNIST test images
(batch 256), for each execution provider asked for (``--providers``: a comma list of
``cpu`` and ``cuda``; ``cuda`` is left out, with a note, when this ONNX Runtime has no
CUDAExecutionProvider), in one process:
  plain       plain ONNX Runtime inference (the baseline of its column, 1.00x)
  readouts    the readout pass: head features + logits exposed, every readout accumulated
  statistics  the channel-statistics pass over all analysed layers (default taps)
  rr          the RR curves the commands compute by default (64 images x 16 positions,
              docs/METHODS.md §C2), against a plain pass over the first --rr-n images (the
              calibration set)
  prune b=1 / b=32  the median latency of the bundled model with 50 % of every prunable
              channel group removed (uniform budget, magnitude), against the source model's
Every session runs on the provider of its column (checked: a CUDA session that fell back to
CPU stops the script). Timings are the best of --repeat runs after a warm-up.

Consistency checks (when both columns run): the readouts and the channel statistics on
CUDA equal CPU's within 1e-2 relative (readouts) and 2e-2 standard deviations (moments):
CUDA convolutions and GEMMs may use TF32 (10-bit mantissa) on Ampere and newer GPUs.
benchmarks/gpu_check.sh runs this script after the `gpu` tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    SAMPLE,
    best_of,
    check,
    load_fashion_mnist_test,
    moments_difference,
)

PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
ROWS = ("plain", "readouts", "statistics", "rr", "prune b=1", "prune b=32")
LABELS = {
    "plain": "plain ONNX Runtime inference",
    "readouts": "readout pass (head Z, U exposed + all readouts)",
    "statistics": "channel-statistics pass (all analysed layers)",
    "rr": "RR curves (64 images x 16 positions) / plain pass over the calibration set",
    "prune b=1": "50 % channel-pruned model, batch 1 latency / source model",
    "prune b=32": "50 % channel-pruned model, batch 32 latency / source model",
}
READOUT_RTOL, MOMENTS_TOL = 1e-2, 2e-2


def providers_to_run(asked: str) -> tuple[list[str], list[str]]:
    """(providers to measure, notes on those left out)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    chosen, notes = [], []
    for p in (x.strip().lower() for x in asked.split(",") if x.strip()):
        if p not in PROVIDER_NAMES:
            raise SystemExit(f"error: unknown provider {p!r}; use cpu and/or cuda")
        if PROVIDER_NAMES[p] in available:
            chosen.append(p)
        else:
            notes.append(f"{p}: not measured ({PROVIDER_NAMES[p]} is not available in this "
                         f"ONNX Runtime {ort.__version__}; available: {', '.join(available)})")
    return chosen, notes


def on_provider(runner, provider: str):
    """``runner``, checked to run on ``provider`` (ORT falls back to CPU silently)."""
    if runner.providers[0] != PROVIDER_NAMES[provider]:
        raise SystemExit(f"error: a session asked for {provider} runs on {runner.providers}; "
                         "the CUDA provider failed to load (see ONNX Runtime's warnings above)")
    return runner


def measure(provider: str, inputs: dict, repeat: int, latency_repeats: int) -> dict:
    """Seconds of every row on ``provider``, and the readouts and moments for the checks."""
    from onnxdiag.channels.collect import collect_channel_moments, make_stats_runner
    from onnxdiag.evaluate import make_head_runner
    from onnxdiag.runtime.runner import OrtRunner
    from onnxdiag.selection.probe import probe_model
    from onnxdiag.sparsity import compute_rr_curves

    model, structure, source = inputs["model"], inputs["structure"], inputs["source"]
    plain = on_provider(OrtRunner(model, providers=provider), provider)
    head_runner = on_provider(make_head_runner(model, structure.head, providers=provider),
                              provider)
    stats_runner = on_provider(make_stats_runner(model, structure, providers=provider),
                               provider)

    def run_all(feeds_list):
        for feeds in feeds_list:
            plain.run(feeds)

    seconds = {
        "plain": best_of(lambda: run_all(b.feeds for b in source.batches()), repeat),
        "readouts": best_of(lambda: probe_model(model, structure, source, runner=head_runner),
                            repeat),
        "statistics": best_of(lambda: collect_channel_moments(model, structure, source,
                                                              runner=stats_runner), repeat),
        "rr_dense": best_of(lambda: run_all(inputs["calib"]), repeat),
        "rr": best_of(lambda: compute_rr_curves(model, inputs["layers"], inputs["calib"],
                                                providers=provider), repeat),
    }
    seconds.update(prune_latency(inputs, provider, latency_repeats))
    return {"seconds": seconds,
            "readouts": probe_model(model, structure, source,
                                    runner=head_runner).readouts.values,
            "moments": collect_channel_moments(model, structure, source, runner=stats_runner)}


def prune_latency(inputs: dict, provider: str, repeats: int) -> dict:
    """Median latency (s) of the source and the pruned model at batch 1 and 32."""
    from onnxdiag.runtime.runner import OrtRunner

    out = {}
    x = inputs["x32"]
    for name, net in (("source", inputs["model"]), ("pruned", inputs["pruned"])):
        runner = on_provider(OrtRunner(net, providers=provider), provider)
        for batch in (1, 32):
            feeds = {runner.input_names[0]: x[:batch]}
            for _ in range(3):
                runner.run(feeds)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.run(feeds)
                times.append(time.perf_counter() - t0)
            out[f"{name} b={batch}"] = float(np.median(times))
    return out


def prepare(n: int, rr_n: int, batch_size: int) -> dict:
    """The model, its structure, the data and the 50 % channel-pruned model."""
    from onnxdiag.data.source import open_data
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.finalize import finalize_model
    from onnxdiag.model.io import get_input_specs, load_model
    from onnxdiag.sparsity import find_prunable
    from onnxdiag.structured import magnitude_scores, plan_pruning, prune_channels

    model = load_model(SAMPLE / "model.onnx")
    structure = analyze_structure(model)
    x, y = load_fashion_mnist_test(max(n, rr_n, 32))
    name = get_input_specs(model)[0].name
    plan = plan_pruning(model, structure, magnitude_scores(model, structure), 0.5)
    pruned, _ = prune_channels(model, structure, plan.removed)
    return {"model": model, "structure": structure,
            "source": open_data({name: x[:n], "labels": y[:n]}, get_input_specs(model),
                                batch_size=batch_size),
            "calib": [{name: x[i:min(rr_n, i + batch_size)]}
                      for i in range(0, rr_n, batch_size)],
            "layers": find_prunable(structure), "pruned": finalize_model(pruned),
            "x32": x[:32]}


def ratios(seconds: dict) -> dict:
    plain = seconds["plain"]
    return {"plain": 1.0, "readouts": seconds["readouts"] / plain,
            "statistics": seconds["statistics"] / plain, "rr": seconds["rr"] / seconds["rr_dense"],
            "prune b=1": seconds["pruned b=1"] / seconds["source b=1"],
            "prune b=32": seconds["pruned b=32"] / seconds["source b=32"]}


def print_table(results: dict, n: int, rr_n: int) -> None:
    print(f"\n| pass (bundled sample; {n:,} images, batch 256; RR on {rr_n:,}) | CPU time | "
          "CPU x plain | CUDA time | CUDA x plain |\n|---|---:|---:|---:|---:|")
    for row in ROWS:
        cells = []
        for p in ("cpu", "cuda"):
            if p not in results:
                cells += ["–", "not measured"]
                continue
            s, r = results[p]["seconds"], results[p]["ratios"]
            if row.startswith("prune"):  # a latency: milliseconds
                cells.append(f"{1000 * s['pruned ' + row.split()[1]]:.3f} ms")
            else:
                cells.append(f"{s[row]:.3f} s")
            cells.append(f"{r[row]:.2f}")
        print(f"| {LABELS[row]} | " + " | ".join(cells) + " |")


def consistency(results: dict) -> None:
    if "cpu" not in results or "cuda" not in results:
        print("consistency: CPU vs CUDA not compared (one provider measured)")
        return
    a, b = results["cpu"]["readouts"], results["cuda"]["readouts"]
    worst = max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in a
                if isinstance(a[k], float) and np.isfinite(a[k]))
    check(worst <= READOUT_RTOL, f"readouts on CUDA = CPU (max relative difference "
                                 f"{worst:.1e} <= {READOUT_RTOL})")
    d = moments_difference(results["cpu"]["moments"], results["cuda"]["moments"])
    check(d <= MOMENTS_TOL, f"channel statistics on CUDA = CPU ({d:.1e} <= {MOMENTS_TOL} "
                            "standard deviations)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--providers", default="cpu,cuda")
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--rr-n", type=int, default=1000, help="calibration images (RR row)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--latency-repeats", type=int, default=50)
    ap.add_argument("--smoke", action="store_true",
                    help="512 images, RR on 256, one repeat, 5 latency runs")
    ap.add_argument("--json", default=None, help="Also write the results here.")
    args = ap.parse_args(argv)
    if args.smoke:
        args.n, args.rr_n, args.repeat, args.latency_repeats = 512, 256, 1, 5
    import onnxruntime as ort

    chosen, notes = providers_to_run(args.providers)
    print(f"onnxruntime {ort.__version__}, providers available: "
          f"{', '.join(ort.get_available_providers())}; {platform.machine()}, "
          f"{os.cpu_count()} CPU cores, Python {platform.python_version()}")
    for note in notes:
        print(note)
    if not chosen:
        raise SystemExit("error: no provider to measure")
    inputs = prepare(args.n, args.rr_n, args.batch_size)
    results = {}
    for p in chosen:
        results[p] = measure(p, inputs, args.repeat, args.latency_repeats)
        results[p]["ratios"] = ratios(results[p]["seconds"])
    print_table(results, args.n, args.rr_n)
    consistency(results)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {p: {"seconds": r["seconds"], "ratios": r["ratios"]} for p, r in results.items()}
            | {"notes": notes, "n_images": args.n, "rr_images": args.rr_n}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
