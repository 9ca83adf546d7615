"""Tiny dense-prediction models built in code (docs/METHODS.md §A4).

- :func:`seg_conv_head`: x (N, 3, 8, 8) → Conv3×3 "c0" (8) → Relu "feat" → Conv1×1 "head"
  (5 classes, bias) → "logits" (N, 5, 8, 8), optionally Softmax over axis 1 → "prob".
- :func:`seg_transposed_softmax`: the same head → Transpose to (N, 8, 8, 5) → Softmax(−1)
  → "prob": found only by verification on data.
- :func:`query_head`: per-query features x (N, 6, 16) → Relu "feat" → MatMul "head"
  (16 → 5) → Add "head_bias" → "logits" (N, 6, 5): a detection branch's classifier,
  one row per query.
"""

from __future__ import annotations

import numpy as np
import onnx
from corpus import N_CLASSES
from corpus import GraphBuilder as _G
from corpus import value_info as _vi

N_QUERIES = 6


def _seg_trunk(g: _G, out: str | None = None) -> str:
    feat = g.node("Relu", [g.conv("x", "c0", 3, 8)], "feat")
    return g.conv(feat, "head", 8, N_CLASSES, k=1, pad=0, out=out)


def seg_conv_head(softmax: bool = False, seed: int = 0) -> onnx.ModelProto:
    g = _G(seed)
    head = _seg_trunk(g, None if softmax else "logits")
    out = "prob" if softmax else "logits"
    if softmax:
        g.node("Softmax", [head], "softmax", "prob", axis=1)
    return g.model([_vi("x", ("N", 3, 8, 8))], [_vi(out, ("N", N_CLASSES, 8, 8))])


def seg_transposed_softmax(seed: int = 0) -> onnx.ModelProto:
    g = _G(seed)
    t = g.node("Transpose", [_seg_trunk(g)], "nhwc", perm=[0, 2, 3, 1])
    g.node("Softmax", [t], "softmax", "prob", axis=-1)
    return g.model([_vi("x", ("N", 3, 8, 8))], [_vi("prob", ("N", 8, 8, N_CLASSES))])


def query_head(seed: int = 0) -> onnx.ModelProto:
    g = _G(seed)
    mm = g.node("MatMul", [g.node("Relu", ["x"], "feat"), g.rand("head.weight", 16, N_CLASSES)],
                "head")
    g.node("Add", [mm, g.rand("head.bias", N_CLASSES, scale=0.5)], "head_bias", "logits")
    return g.model([_vi("x", ("N", N_QUERIES, 16))], [_vi("logits", ("N", N_QUERIES,
                                                                     N_CLASSES))])


def seg_data(n: int = 12, seed: int = 0, ignore_fraction: float = 0.2):
    """(x (n, 3, 8, 8) float32, label maps (n, 8, 8) int64 with ~``ignore_fraction`` 255s)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, N_CLASSES, (n, 8, 8))
    y[rng.random((n, 8, 8)) < ignore_fraction] = 255
    return x, y
