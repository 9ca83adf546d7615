"""What the benchmark scripts share: paths, the image data, timing, the smoke checks.

Every script runs from a checkout (``python benchmarks/NAME.py``; the repository root is
put on ``sys.path``) and has ``--smoke``: tiny N, one repeat, a small grid, seconds, the
same code paths and tables as the full run, and its consistency checks
(tests/test_benchmarks.py runs every one).
"""

from __future__ import annotations

import gzip
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "models" / "sample"
#: Debian package dataset-fashion-mnist (the full 10,000-image test set).
FMNIST = Path("/usr/share/datasets/fashion-mnist")


def load_fashion_mnist_test(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` Fashion-MNIST test images as float32 (n, 1, 28, 28) in [0, 1], and
    labels, tiled when ``n`` exceeds the set. From the Debian package when installed, else
    from the bundled sample's ``eval.npz`` (2,000 of the same test images; a note says so
    on stderr)."""
    if (FMNIST / "t10k-images-idx3-ubyte.gz").exists():
        with gzip.open(FMNIST / "t10k-images-idx3-ubyte.gz") as f:
            x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
        with gzip.open(FMNIST / "t10k-labels-idx1-ubyte.gz") as f:
            y = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)
        x = x.astype(np.float32) / 255.0
    else:
        print(f"note: {FMNIST} not installed; using the 2,000 test images of "
              f"{SAMPLE / 'eval.npz'}", file=sys.stderr)
        with np.load(SAMPLE / "eval.npz") as z:
            x, y = z["input"].astype(np.float32), z["labels"].astype(np.int64)
    reps = -(-n // len(x))
    return np.concatenate([x] * reps)[:n], np.concatenate([y] * reps)[:n]


def best_of(fn, repeat: int) -> float:
    """Best wall time (s) of ``repeat`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def moments_difference(a, b) -> float:
    """Largest difference of two statistics passes' moments (every layer's mean and
    covariance), in units of each column's standard deviation (``a``'s): float32 rounding
    gives ~1e-7, a different sample gives ~1."""
    if a.layers.keys() != b.layers.keys():
        raise AssertionError(f"different layers: {sorted(a.layers)} vs {sorted(b.layers)}")
    worst = 0.0
    for name, la in a.layers.items():
        lb = b.layers[name]
        if la.task.n != lb.task.n:
            raise AssertionError(f"{name}: {la.task.n} vs {lb.task.n} samples")
        scale = np.sqrt(np.maximum(np.diag(la.task.cov()), 1e-30))
        worst = max(worst, float((np.abs(la.task.mean - lb.task.mean) / scale).max()),
                    float((np.abs(la.task.cov() - lb.task.cov())
                           / np.outer(scale, scale)).max()))
    return worst


def check(condition: bool, message: str) -> None:
    """A consistency check of a benchmark (also in full runs): fail loudly, exit 1."""
    if not condition:
        raise SystemExit(f"CONSISTENCY CHECK FAILED: {message}")
    print(f"check ok: {message}")
