"""METHODS §C2: an RR plan's removed weights per grid level are exactly the magnitude masks'
differences (the sparse steps built by one radix sort, not from coordinates)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from corpus import (
    conv_geometry_head,
    depthwise_pointwise,
    gemm_head,
    matmul_add_head,
    random_feeds,
    residual_block,
)
from onnx import numpy_helper
from scipy import sparse

from onnxdiag.graph import GraphIndex, analyze_structure
from onnxdiag.model.io import load_model
from onnxdiag.sparsity import DEFAULT_GRID, find_prunable, magnitude_mask
from onnxdiag.sparsity.offline import layer_op
from onnxdiag.sparsity.rr_layer import plan_layer, removal_levels
from onnxdiag.sparsity.rr_strategy import choose_strategy, layer_positions


def _rows_of(op, w: np.ndarray) -> np.ndarray:
    """The weight as (output channel, column feature): a conv's group g occupies columns
    g·K … (g+1)·K − 1; a linear layer's rows are its output features."""
    if op.kind == "linear":
        return w if op.layout == "oi" else w.T
    c, per = w.shape[0], int(np.prod(w.shape[1:]))
    out = np.zeros((c, op.groups * per), w.dtype)
    g = np.arange(c) // (c // op.groups)
    for i in range(c):
        out[i, g[i] * per:(g[i] + 1) * per] = w[i].ravel()
    return out


def _removed(w: np.ndarray, grid) -> list[np.ndarray]:
    """Per level, the bool mask of the weights its magnitude mask removes first."""
    kept = [np.ones(w.shape, bool)] + [magnitude_mask(w, s) for s in grid]
    return [kept[j] & ~kept[j + 1] for j in range(len(grid))]


@pytest.mark.parametrize("build", [conv_geometry_head, depthwise_pointwise, gemm_head,
                                   lambda: gemm_head(trans_b=False), matmul_add_head])
@pytest.mark.parametrize("strategy", ["incremental", "gram"])
def test_plan_steps_are_the_mask_differences(build, strategy):
    model = load_model(build())
    layers = find_prunable(analyze_structure(model))
    for init in model.graph.initializer:  # an exact zero is a stored entry too
        if init.name in {la.weight for la in layers}:
            w = numpy_helper.to_array(init).copy()
            w.flat[0] = 0.0
            init.CopyFrom(numpy_helper.from_array(w, init.name))
    index = GraphIndex(model)
    grid = np.asarray(DEFAULT_GRID)
    for layer in layers:
        w = np.asarray(index.get_constant(layer.weight), np.float32)
        assert w.flat[0] == 0.0
        op = layer_op(index, layer)
        plan = plan_layer(index, layer, grid, strategy)
        removed = _removed(w, grid)
        if plan["mode"] == "gram" and plan["groups"] > 1:
            k = plan["dense_rows"].shape[1]
            gone = np.zeros(w.shape, bool)
            for j, mask in enumerate(removed):
                gone |= mask
                full = _rows_of(op, np.where(gone, w, 0).astype(np.float64))
                np.testing.assert_array_equal(plan["removed_rows"][j], _fold_groups(full, k))
            continue
        if plan["mode"] == "gram":
            np.testing.assert_array_equal(plan["dense_rows"], _rows_of(op, w.astype(np.float64)))
        for step, mask in zip(plan["steps"], removed):
            if not mask.any():
                assert step is None
                continue
            dense = _rows_of(op, np.where(mask, w, 0)).astype(  # gram: float64 steps
                np.float64 if plan["mode"] == "gram" else np.float32)
            coords = np.nonzero(_rows_of(op, mask))
            ref = sparse.csr_matrix((dense[coords], coords), shape=dense.shape)
            assert step.has_canonical_format and step.dtype == ref.dtype
            for field in ("data", "indices", "indptr"):
                np.testing.assert_array_equal(getattr(step, field), getattr(ref, field))


def _fold_groups(full: np.ndarray, k: int) -> np.ndarray:
    """(C, groups·K) block-diagonal rows → (C, K): each row's own group's columns."""
    c = full.shape[0]
    groups = full.shape[1] // k
    g = np.arange(c) // (c // groups)
    return np.stack([full[i, g[i] * k:(g[i] + 1) * k] for i in range(c)])


def test_removal_levels_follow_the_running_minimum_of_kept():
    weight = np.array([4.0, -2.0, 1.0, 5.0, -3.0], np.float32)  # keep-first: 3, 0, 4, 1, 2
    levels = removal_levels(weight, [0.0, 0.4, 0.2, 0.8])
    # kept per level 5, 3, 4 (-> 3), 1: ranks 3-4 go at level 1, ranks 1-2 at level 3
    assert levels.tolist() == [3, 1, 1, 4, 3]


@pytest.mark.parametrize("build", [residual_block, depthwise_pointwise])
def test_rr_curves_on_layer_threads_equal_one_thread_bit_for_bit(build, monkeypatch):
    """Planning, folding and finishing on threads: each layer's work is its own, so the
    curves are those of one thread exactly."""
    from onnxdiag.sparsity import compute_rr_curves, repairability

    model = load_model(build())
    layers = find_prunable(analyze_structure(model))
    calib = [random_feeds(model, batch=4, seed=i) for i in range(3)]
    curves = {}
    for workers in (1, 3):
        monkeypatch.setattr(repairability, "LAYER_THREADS", workers)
        curves[workers] = compute_rr_curves(model, layers, calib, positions=4)
    for name in ("d_raw", "d_repair", "rr"):
        np.testing.assert_array_equal(getattr(curves[1], name), getattr(curves[3], name))


VIT = Path(__file__).resolve().parents[1] / "models" / "vit" / "model.onnx"


@pytest.mark.parametrize("build", [conv_geometry_head, depthwise_pointwise, gemm_head,
                                   lambda: load_model(VIT)])
@pytest.mark.parametrize("positions", [4, None])
def test_auto_strategy_weighs_the_rows_each_layer_folds(build, positions, monkeypatch):
    """``auto`` weighs a layer's strategy by the rows it will fold: images × its positions
    per input read off the inferred shapes (a conv's output positions, a linear layer's
    tokens), at most ``positions``; those are the rows the pass folds (``n_samples``)."""
    from onnxdiag.sparsity import compute_rr_curves, repairability

    model = load_model(build())
    layers = find_prunable(analyze_structure(model))
    weighed = {}

    def plan(index, layer, grid, strategy="auto", gram_steps=np.float64, n_samples=None):
        weighed[layer.node_name] = n_samples
        return plan_layer(index, layer, grid, strategy, gram_steps, n_samples)

    monkeypatch.setattr(repairability, "plan_layer", plan)
    calib = [random_feeds(model, batch=3, seed=i) for i in range(2)]
    curves = compute_rr_curves(model, layers, calib, n_images=6, positions=positions)
    assert [weighed[name] for name in curves.layers] == list(curves.n_samples)
    assert all(layer_positions(la) is not None for la in layers)


def test_auto_strategy_counts_the_gram_finish():
    """The Gram finish costs C·K² sparse products whatever the rows: a 1000-class head over
    1280 features folding 64 rows is cheaper grown level by level (0.44 s vs 0.04 s,
    benchmarks/bench_rr_layers.py on a 224×224 MobileNetV2), which the per-sample rule
    (rows unknown) misses; a 1×1 conv expanding 160 → 960 channels over 1024 rows stays
    ``gram`` (0.025 vs 0.108 s), a projection 960 → 160 does not."""
    assert choose_strategy(1000, 1280, 1, 28, n_samples=64) == "incremental"
    assert choose_strategy(1000, 1280, 1, 28) == "gram"
    assert choose_strategy(960, 160, 1, 28, n_samples=1024) == "gram"
    assert choose_strategy(160, 960, 1, 28, n_samples=1024) == "incremental"
    assert choose_strategy(160, 960, 1, 28) == "gram"
    assert choose_strategy(512, 4608, 1, 28, n_samples=10) == "incremental"  # > GRAM_MAX_ENTRIES
