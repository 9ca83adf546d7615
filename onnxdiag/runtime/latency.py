"""ONNX Runtime CPU latency measurement and the CPU's blocked-convolution channel width."""

from __future__ import annotations

import time

import numpy as np


def cpu_conv_block(cpuinfo: str | None = None) -> int | None:
    """Channel block of ONNX Runtime's blocked (NCHWc) CPU convolutions on this machine:
    16 with AVX-512F, 8 with AVX2 (MLAS ``NchwcBlockSize``), None when unknown (not
    Linux x86-64, or neither). ``cpuinfo``: the text of /proc/cpuinfo (read when None)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return 16 if "avx512f" in flags else 8 if "avx2" in flags else None


def measure_latency(model, feeds_by_batch: dict[int, dict], *, repeats: int = 20,
                    threads: int | None = None) -> dict:
    """Median ONNX Runtime CPU latency (ms) per batch size: {batch: ms}."""
    from .runner import OrtRunner

    runner = OrtRunner(model, providers="cpu", threads=threads)
    out = {}
    for batch, feeds in feeds_by_batch.items():
        runner.run(feeds)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.run(feeds)
            times.append(time.perf_counter() - t0)
        out[str(batch)] = 1000 * float(np.median(times))
    return out


def compare_latency(source, emitted, feeds_by_batch: dict[int, dict], *, rounds: int = 21,
                    threads: int | None = None) -> dict:
    """Interleaved ONNX Runtime CPU latency of two models (ms per run, per batch size).

    Each round runs each model once, in alternating order, after two warm-up runs: single
    runs are shorter than a scheduler time slice, so on a loaded machine most of them run
    unpreempted and the median is the model's own time, and load hits both models alike.
    Returns {"source": {batch: median ms}, "emitted": {...}, "speedup": {batch: ratio of
    the medians}, "speedup_iqr": {batch: [q25, q75] of the per-round ratios}, "rounds",
    "threads" (None: ONNX Runtime's default)}; batches as strings."""
    from .runner import OrtRunner

    runners = [OrtRunner(m, providers="cpu", threads=threads) for m in (source, emitted)]
    out = {"source": {}, "emitted": {}, "speedup": {}, "speedup_iqr": {}, "rounds": rounds,
           "threads": threads}
    for batch, feeds in feeds_by_batch.items():
        for runner in runners:
            runner.run(feeds)
            runner.run(feeds)
        times = np.zeros((rounds, 2))
        for r in range(rounds):
            for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                runners[k].run(feeds)
                times[r, k] = time.perf_counter() - t0
        src, emt = (1000 * float(np.median(times[:, k])) for k in (0, 1))
        key = str(batch)
        out["source"][key], out["emitted"][key] = src, emt
        out["speedup"][key] = src / emt if emt > 0 else None
        out["speedup_iqr"][key] = [float(q) for q in
                                   np.percentile(times[:, 0] / times[:, 1], [25, 75])]
    return out
