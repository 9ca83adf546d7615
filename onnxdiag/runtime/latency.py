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


def compare_latency(source, emitted, feeds_by_batch: dict[int, dict], *, rounds: int = 15,
                    threads: int | None = None, round_ms: float = 4.0) -> dict:
    """Interleaved ONNX Runtime CPU latency of two models (ms per run, per batch size).

    Each round times a block of runs of ``source``, then of ``emitted`` (blocks sized to
    about ``round_ms``), so load on a shared machine hits both alike. Returns
    {"source": {batch: median ms}, "emitted": {...}, "speedup": {batch: ratio of the
    medians}, "speedup_iqr": {batch: [q25, q75] of the per-round ratios}, "rounds",
    "threads" (None: ONNX Runtime's default)}; batches as strings."""
    from .runner import OrtRunner

    runners = [OrtRunner(m, providers="cpu", threads=threads) for m in (source, emitted)]
    out = {"source": {}, "emitted": {}, "speedup": {}, "speedup_iqr": {}, "rounds": rounds,
           "threads": threads}
    for batch, feeds in feeds_by_batch.items():
        blocks = [_block_size(r, feeds, round_ms) for r in runners]
        times = np.array([[_timed(r, feeds, n) for r, n in zip(runners, blocks)]
                          for _ in range(rounds)])
        ratio = times[:, 0] / times[:, 1]
        src, emt = (1000 * float(np.median(times[:, k])) for k in (0, 1))
        key = str(batch)
        out["source"][key], out["emitted"][key] = src, emt
        out["speedup"][key] = src / emt if emt > 0 else None
        out["speedup_iqr"][key] = [float(q) for q in np.percentile(ratio, [25, 75])]
    return out


def _block_size(runner, feeds: dict, round_ms: float) -> int:
    """Runs per timed block: about ``round_ms`` of work, after two warm-up runs."""
    runner.run(feeds)
    once = _timed(runner, feeds, 1)
    return max(1, min(1000, int(round_ms / 1000 / max(once, 1e-7))))


def _timed(runner, feeds: dict, n: int) -> float:
    """Mean seconds per run over ``n`` runs."""
    t0 = time.perf_counter()
    for _ in range(n):
        runner.run(feeds)
    return (time.perf_counter() - t0) / n
