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


#: Seconds of timed rounds per batch size that :func:`compare_latency` aims for (**our
#: default**; a round is one run of each model): a 224×224 ResNet-50's 21 rounds at batch
#: 32 on one thread would take over a minute, a 28×28 net's well under a second.
LATENCY_BUDGET_S = 10.0
#: Rounds timed per batch size whatever the budget (a median and quartiles of 5 or more).
MIN_ROUNDS = 5


def check_latency_budget(budget_s) -> None:
    """OnnxDiagError unless ``budget_s`` is a finite number of seconds ≥ 0."""
    from ..errors import OnnxDiagError

    try:
        ok = float(budget_s) >= 0 and np.isfinite(float(budget_s))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise OnnxDiagError(f"The latency budget must be a number of seconds >= 0; got "
                            f"{budget_s!r} (e.g. --latency-budget 10).")


def planned_rounds(round_s: float, rounds: int, budget_s: float | None,
                   min_rounds: int = MIN_ROUNDS) -> int:
    """Rounds to time: as many as ``budget_s`` holds at ``round_s`` seconds a round, at
    least ``min_rounds`` and at most ``rounds`` (None: no budget, ``rounds``)."""
    if budget_s is None:
        return rounds
    fit = int(budget_s // round_s) if round_s > 0 else rounds
    return max(min(rounds, min_rounds), min(rounds, fit))


def compare_latency(source, emitted, feeds_by_batch: dict[int, dict], *, rounds: int = 21,
                    threads: int | None = None, budget_s: float | None = LATENCY_BUDGET_S,
                    min_rounds: int = MIN_ROUNDS) -> dict:
    """Interleaved ONNX Runtime CPU latency of two models (ms per run, per batch size).

    Each round runs each model once, in alternating order, after two warm-up runs: single
    runs are shorter than a scheduler time slice, so on a loaded machine most of them run
    unpreempted and the median is the model's own time, and load hits both models alike.
    The sessions' threads do not spin-wait between runs (a spinning pool of one model
    would slow the other's runs).
    The second warm-up runs are timed: they give a round's cost, and so the number of
    rounds (:func:`planned_rounds`: what ``budget_s`` seconds hold, between ``min_rounds``
    and ``rounds``; ``budget_s=None``: always ``rounds``).
    Returns {"source": {batch: median ms}, "emitted": {...}, "speedup": {batch: ratio of
    the medians}, "speedup_iqr": {batch: [q25, q75] of the per-round ratios}, "rounds"
    (the most asked for), "rounds_run" {batch: rounds timed}, "budget_s", "threads"
    (None: ONNX Runtime's default)}; batches as strings."""
    from .runner import OrtRunner

    # threads that sleep after a run: one session's spinning pool would take the cores from
    # the other's next run (ResNet-50 at batch 1 on 2 cores: 39-44 ms interleaved vs 22-24
    # ms one after the other; 23-26 ms either way without spinning, benchmarks/RESULTS.md)
    runners = [OrtRunner(m, providers="cpu", threads=threads, spinning=False)
               for m in (source, emitted)]
    out = {"source": {}, "emitted": {}, "speedup": {}, "speedup_iqr": {}, "rounds": rounds,
           "rounds_run": {}, "budget_s": budget_s, "threads": threads}
    for batch, feeds in feeds_by_batch.items():
        warm = 0.0
        for runner in runners:
            runner.run(feeds)
            t0 = time.perf_counter()
            runner.run(feeds)
            warm += time.perf_counter() - t0
        n = planned_rounds(warm, rounds, budget_s, min_rounds)
        times = np.zeros((n, 2))
        for r in range(n):
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
        out["rounds_run"][key] = n
    return out
