#!/usr/bin/env python3
"""Every pass's cost relative to plain ONNX Runtime inference, one model per run (issue 20).

    nice -n 10 python benchmarks/bench_passes.py --model M [--data D] [--n 2048] [--calib 64]
        [--repeat 3] [--passes plain,channels,readouts,rr,prune,sweep] [--memory 1000,10000]
    python benchmarks/bench_passes.py --smoke      # the bundled CNN, tiny N, seconds

Data: ``--data`` an .npz with ``input`` (and ``labels``), cycled to N images, or (default)
the real Fashion-MNIST test images (for the 1×28×28 models). Passes, interleaved
round-robin in one process (so load from other processes hits each alike), the median of
``--repeat`` rounds after a warm-up:

  plain     plain ORT inference over the N images (the baseline of channels / readouts:
            the faster of it and plain_nospin)
  plain_nospin  the same with ORT's threads not spin-waiting (the statistics pass's
            session setting); on a loaded machine spinning threads can make plain slower
  channels  the channel-statistics pass (every analysed layer, default taps, a reused
            session, as in ``onnxdiag channels`` after session creation)
  channels_overlap  the same with the fold always on one worker thread beside the next
            run (``fold_threads=1``; ``channels`` picks by channels.threads.fold_workers)
  stats_session  the channel-statistics pass's ONNX Runtime part alone: its session
            (every analysed layer's tensor exposed, channels-last; its thread count) run
            over the images, no fold
  readouts  the readout pass (head features + logits, every readout)
  dense     plain ORT inference over the first --calib images (the baseline of rr, prune,
            sweep: "one dense pass over the calibration set"; dense_nospin likewise)
  segments  the sequential repair pass's ONNX Runtime part alone: the --calib images run
            in segments cut after every prunable layer's output, as the cr+bn repair
            runs them, with no repair (one session per segment, created in the pass)
  rr        compute_rr_curves on the --calib images (default grid of 28 sparsities, 16
            positions; capture session included)
  prune     one allocation (rule ``rr`` at S = 0.9, the curves given) + masks + the cr+bn
            repair (its sequential segments, sessions included): what ``onnxdiag prune``
            does after its RR curves, less emitting the file (every call's masks from a
            selection per layer, as a fresh ``onnxdiag prune``). RR on every calibration image
            (as here) folds the repair's dense moments in its capture pass, so rr includes
            them and prune runs no dense pass; ``--separate-dense-pass``: RR without them
            and prune with a dense-moments pass of its own (before 2026-12-02, 15:00)
  sweep     one sweep cell: prune as above + the agreement on the calibration set, as
            ``onnxdiag sweep`` measures it (RR once, then this per cell; its cells share
            one dense-moments pass, made before the timings, so a cell is the sequential
            pass, which runs on to the head's logits, + the agreement read off them; two
            cells run first: a steady cell, whose masks come from each layer's magnitude
            order, sorted on the layer's second mask (its first is a selection);
            ``--fresh-agreement``: an agreement pass of its own, as before 2026-12-02)
``--own-arenas``: each sequential-pass segment's session gets its own CPU arena, as before
the shared arena of ``onnxdiag/runtime/arena.py`` (the A/B of that change).

CPU seconds (``time.process_time``, all threads) are reported next to wall seconds: on a
shared, loaded machine they show the work each pass adds; their baseline is the
non-spinning plain / dense pass (spin-waiting threads inflate the CPU time of a spinning
session, so the CPU ratios of rr / prune / sweep, whose sessions spin, are upper bounds).

Peak memory (``--memory``, fresh processes, data streamed in batches cycling over a small
base set so that the data held do not grow with N): the channel-statistics pass at each N.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT, check, load_fashion_mnist_test  # noqa: E402

PASSES = ("plain", "plain_nospin", "channels", "channels_overlap", "stats_session", "readouts",
          "dense", "segments", "rr", "prune", "sweep")
BASELINE = {"channels": "plain", "channels_overlap": "plain", "stats_session": "plain",
            "readouts": "plain",
            "plain_nospin": "plain", "rr": "dense", "prune": "dense", "sweep": "dense",
            "dense_nospin": "dense", "segments": "dense"}


def load_images(data: str | None, n: int) -> tuple[np.ndarray, np.ndarray | None]:
    """n images (cycled) and labels from ``data`` (.npz) or Fashion-MNIST."""
    if data is None:
        return load_fashion_mnist_test(n)
    with np.load(data) as z:
        x = z["input"].astype(np.float32)
        y = z["labels"].astype(np.int64) if "labels" in z else None
    idx = np.arange(n) % len(x)
    return x[idx], None if y is None else y[idx]


def make_passes(model_path: str, x, y, calib: int, batch_size: int, wanted,
                fresh_agreement: bool = False, separate_dense: bool = False,
                positions: int = 16, fold_threads: int | None = None) -> dict:
    """{pass: a callable running it once} for the ``wanted`` passes (``positions``: the
    statistics pass's positions per image, ``--positions`` of ``onnxdiag channels``;
    ``fold_threads``: the ``channels`` pass's, None: its own choice)."""
    from onnxdiag.channels.collect import (
        StatsRunner,
        collect_channel_moments,
        make_stats_runner,
    )
    from onnxdiag.data.source import open_data
    from onnxdiag.evaluate import make_head_runner
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model
    from onnxdiag.runtime.runner import OrtRunner
    from onnxdiag.selection.probe import probe_model
    from onnxdiag.sparsity import compute_rr_curves, find_prunable
    from onnxdiag.sparsity.sweep import Pruner, materialize

    model = load_model(model_path)
    structure = analyze_structure(model)
    specs = get_input_specs(model)
    name = specs[0].name if hasattr(specs[0], "name") else next(iter(specs))
    data = {name: x} if y is None else {name: x, "labels": y}
    source = open_data(data, specs, batch_size=batch_size)
    cdata = {k: v[:calib] for k, v in data.items()}
    csource = open_data(cdata, specs, batch_size=min(batch_size, 64))
    feeds = materialize(csource)
    plain = OrtRunner(model)
    fns = {}

    def run_all(runner, src):
        for batch in src.batches():
            runner.run(batch.feeds)

    fns["plain"] = lambda: run_all(plain, source)
    quiet = StatsRunner(model)
    fns["plain_nospin"] = lambda: run_all(quiet, source)
    if {"channels", "channels_overlap", "stats_session"} & set(wanted):
        stats_runner = make_stats_runner(model, structure, n_positions=positions)
        fns["channels"] = lambda: collect_channel_moments(model, structure, source,
                                                          runner=stats_runner,
                                                          n_positions=positions,
                                                          fold_threads=fold_threads)
        # the fold always on one worker thread beside the next run (fold_threads=1)
        fns["channels_overlap"] = lambda: collect_channel_moments(
            model, structure, source, runner=stats_runner, n_positions=positions,
            fold_threads=1)
        fns["stats_session"] = lambda: run_all(stats_runner, source)
    if "readouts" in wanted:
        head_runner = make_head_runner(model, structure.head)
        fns["readouts"] = lambda: probe_model(model, structure, source, runner=head_runner)
    fns["dense"] = lambda: run_all(plain, csource)
    fns["dense_nospin"] = lambda: run_all(quiet, csource)
    layers = find_prunable(structure)
    if "segments" in wanted:
        from onnxdiag.sparsity.segments import SegmentedPass, split_batches

        def segments():  # as repair._sequential's pass, without its folds
            seg = SegmentedPass(model, split_batches(feeds), spinning=False)
            for la in sorted(layers, key=lambda la: seg.position(la.output)):
                seg.run_to(seg.position(la.output), keep=[la.output])
            return seg.n_segments

        fns["segments"] = segments
    sparse = {"rr", "prune", "sweep"} & set(wanted)
    if sparse:
        # as the verbs: RR on every calibration image folds the repairs' dense moments too
        def rr():
            return compute_rr_curves(model, layers, feeds, n_images=calib,
                                     output_moments=not separate_dense)

        curves = rr()
        pruner = Pruner(model, structure, feeds, rr_curves=curves)
        alloc = pruner.allocate("rr", 0.9)
        fns["rr"] = rr

        def prune():  # as `onnxdiag prune` after its RR curves
            pruner.dense_moments.clear()
            pruner.dense_moments.update(curves.output_moments or {})
            # a fresh Pruner's first masks: a selection per layer (the second call would
            # sort every layer, the later ones reuse the sorts; prune makes one cell)
            pruner.orders.clear()
            return pruner.prune(pruner.allocate("rr", 0.9), "cr+bn")

        fns["prune"] = prune
        if "sweep" in wanted:  # a sweep's cells share the first cell's dense moments
            sweeper = Pruner(model, structure, feeds, rr_curves=curves,
                             pass_logits=not fresh_agreement)
            for _ in range(2):  # a steady cell: a layer's second mask sorts its weights once
                sweeper.prune(alloc, "cr+bn")

            def sweep_cell():  # as sweep's _measured, without evaluation data
                pruned, record = sweeper.prune(alloc, "cr+bn")
                return sweeper.measure(pruned, None, record)

            fns["sweep"] = sweep_cell
    return {k: v for k, v in fns.items()
            if k in wanted or k in ("plain", "plain_nospin", "dense", "dense_nospin")}


def interleaved_medians(fns: dict, repeat: int, pause: float, warmup: int = 1) -> tuple:
    """Median wall seconds of each callable over ``repeat`` round-robin rounds, after
    ``warmup`` rounds (a pause before each run lets ORT's spinning threads settle)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict = {k: [] for k in fns}
    cpu: dict = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            time.sleep(pause)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return ({k: float(np.median(v)) for k, v in times.items()},
            {k: float(np.median(v)) for k, v in cpu.items()}, times)


def base(med: dict, k: str, nospin: bool = False) -> float:
    """The baseline seconds of pass ``k``: the faster plain variant for the passes over the
    N images (``nospin``, for CPU seconds: plain_nospin, as spinning threads inflate the
    CPU time of plain), the dense calibration pass for rr / prune / sweep."""
    b = BASELINE.get(k, k)
    if b == "plain":
        return med["plain_nospin"] if nospin else min(med["plain"], med["plain_nospin"])
    return med["dense_nospin"] if nospin else med[b]


def peak_memory(model_path: str, data: str | None, n: int, batch_size: int) -> float:
    """Peak RSS (MiB) of a fresh process running the statistics pass on n streamed images."""
    cmd = [sys.executable, __file__, "--memory-child", str(n), "--model", model_path,
           "--batch-size", str(batch_size)] + ([] if data is None else ["--data", data])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]) / 1024


def memory_child(model_path: str, data: str | None, n: int, batch_size: int) -> None:
    from benchmarks.bench_core import BatchStream
    from onnxdiag.channels.collect import collect_channel_moments
    from onnxdiag.data.source import open_data
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model

    model = load_model(model_path)
    structure = analyze_structure(model)
    base, labels = load_images(data, min(n, 2 * batch_size))
    if labels is None:
        labels = np.zeros(len(base), np.int64)
    source = open_data(BatchStream(base, labels, n, batch_size), get_input_specs(model),
                       batch_size=batch_size)
    collect_channel_moments(model, structure, source)
    print(peak_rss_kib())


def peak_rss_kib() -> int:
    """This process's peak RSS in KiB since it started its program: /proc's VmHWM (the
    high-water mark of its own memory map, new at exec). ``ru_maxrss`` is not: it keeps the
    peak from before exec, i.e. the spawning parent's RSS, which the children of a run
    with passes (GBs) would report as their own. ``ru_maxrss`` off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--model", default=str(ROOT / "models" / "sample" / "model.onnx"))
    ap.add_argument("--data", default=None, help=".npz with input (and labels); default "
                    "Fashion-MNIST test images")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="warm-up rounds (0 for passes "
                    "of minutes, where sessions are made inside the pass anyway)")
    ap.add_argument("--passes", default=",".join(PASSES))
    ap.add_argument("--memory", default="", help="comma list of N for the peak-memory runs")
    ap.add_argument("--smoke", action="store_true", help="the bundled CNN, 256 images, "
                    "one repeat: every pass and check in seconds")
    ap.add_argument("--fresh-agreement", action="store_true", help="sweep: a separate "
                    "agreement pass instead of the logits of the repair's pass")
    ap.add_argument("--separate-dense-pass", action="store_true", help="rr / prune: the "
                    "repair's dense moments from a pass of its own, not the RR capture")
    ap.add_argument("--own-arenas", action="store_true", help="segments / prune / sweep: "
                    "every segment session its own CPU arena instead of the shared one")
    ap.add_argument("--positions", type=int, default=16, help="channels / stats_session: "
                    "positions sampled per image (the statistics pass's default: 16)")
    ap.add_argument("--fold-threads", type=int, default=None, help="channels: fold each "
                    "batch after its run on K threads (1: on one worker beside the next run; "
                    "default: the pass's own choice, channels.threads.fold_workers)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        memory_child(args.model, args.data, args.memory_child, args.batch_size)
        return 0
    if args.smoke:
        args.n, args.calib, args.repeat, args.warmup, args.memory = 256, 32, 1, 0, "256"
    wanted = [p.strip() for p in args.passes.split(",") if p.strip()]
    if args.own_arenas:
        from onnxdiag.sparsity import segments

        segments.SHARED_ARENA = False
    x, y = load_images(args.data, args.n)
    fns = make_passes(args.model, x, y, args.calib, args.batch_size, wanted,
                      args.fresh_agreement, args.separate_dense_pass, args.positions,
                      args.fold_threads)
    med, cpu, times = interleaved_medians(fns, args.repeat, 0.0 if args.smoke else 0.2,
                                          args.warmup)
    res = {"model": args.model, "n": args.n, "calib": args.calib, "positions": args.positions,
           "fold_threads": args.fold_threads,
           "seconds": med, "all_seconds": times,
           "ratio": {k: med[k] / base(med, k) for k in med},
           "cpu_seconds": cpu, "cpu_ratio": {k: cpu[k] / base(cpu, k, nospin=True)
                                             for k in cpu},
           "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                  time.gmtime()),
           "machine": f"{platform.machine()} {os.cpu_count()} cores, Python "
                      f"{platform.python_version()}"}
    res["memory_mib"] = {n: peak_memory(args.model, args.data, int(n), args.batch_size)
                         for n in args.memory.split(",") if n}
    print(f"{'pass':16s} {'median s':>9s} {'x baseline':>10s} {'cpu s':>8s} {'cpu x':>7s}"
          "  baseline")
    for k, v in med.items():
        print(f"{k:16s} {v:9.3f} {res['ratio'][k]:10.2f} {cpu[k]:8.3f} "
              f"{res['cpu_ratio'][k]:7.2f}  {BASELINE.get(k, k)}")
    print("load average after the timings: " + ", ".join(f"{v:.2f}" for v in
                                                          res["load_average"]))
    for n, mib in res["memory_mib"].items():
        print(f"channel-statistics pass, {n} images: peak RSS {mib:.1f} MiB")
    check(all(np.isfinite(v) and v > 0 for v in med.values()), "every pass ran")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
