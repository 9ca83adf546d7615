"""A map over threads for independent per-layer (or per-batch) NumPy / SciPy work.

NumPy's large reductions and element-wise loops and SciPy's sparse products release the
GIL, so independent items — one layer's moments, one batch's patch — run on the cores
side by side. Each item's arithmetic is its own, so the results equal those of one
thread bit for bit; the caller keeps any order-dependent merging sequential.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from .progress import progress

#: Threads of a :func:`thread_map` (every core, at most 4).
THREADS = min(4, os.cpu_count() or 1)


@contextmanager
def thread_map(n_items: int, workers: int | None = None):
    """A map ``pool(fn, items, label=None) -> list`` over ``workers`` threads (default
    :data:`THREADS`; at most ``n_items``; one: in this thread), results in the order of
    ``items``; ``label``: a progress bar with an ETA as the results come in."""
    workers = max(1, min(workers or THREADS, n_items))
    executor = ThreadPoolExecutor(workers) if workers > 1 else None

    def pool(fn, items, label=None):
        items = list(items)
        results = executor.map(fn, items) if executor else map(fn, items)
        return list(progress(results, len(items), label) if label else results)

    try:
        yield pool
    finally:
        if executor:
            executor.shutdown()
