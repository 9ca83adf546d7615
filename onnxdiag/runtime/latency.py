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
