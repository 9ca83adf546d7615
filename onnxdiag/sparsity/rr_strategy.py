"""Which way an RR plan evaluates a layer (docs/METHODS.md §C2, "Cost"), and the work
each way costs: ``incremental`` grows the removed weights' output level by level over the
folded rows; ``gram`` folds the columns' K × K second moments and finishes every level as
quadratic forms of the weights (:mod:`onnxdiag.sparsity.rr_layer`).
"""

from __future__ import annotations

import numpy as np

STRATEGIES = ("auto", "incremental", "gram")
#: ``gram`` keeps groups·K² float64 per layer; above this many entries ``auto`` never picks it.
GRAM_MAX_ENTRIES = 4_000_000
#: Measured on 2 CPU cores (benchmarks/bench_rr.py): BLAS Gram work runs ~8x faster per
#: operation than the sparse increments and per-level moments.
GRAM_SPEED = 8
#: Cost of one value of a per-level pass over a (C × K) or (C × samples) float64 array
#: (the moments, the Gram finish's sums) in sparse multiply-adds: measured ~12 on 2 CPU
#: cores (2.2 ns a value against 0.16 ns a multiply-add of SciPy's sparse × dense product;
#: benchmarks/RESULTS.md, "Eighth session of 2026-12-07").
LEVEL_PASS_COST = 12


def choose_strategy(n_out: int, k: int, groups: int, n_levels: int,
                    n_samples: int | None = None) -> str:
    """``incremental`` or ``gram`` for a layer of ``n_out`` channels, K = ``k`` columns per
    group and ``n_samples`` rows (images × positions; None: unknown).

    A one-group layer with a known ``n_samples`` takes the cheaper of the two whole costs,
    in sparse multiply-adds: ``gram`` = n·K²/GRAM_SPEED (the BLAS fold) + C·K² (the finish's
    sparse R_l Σ products) + LEVEL_PASS_COST·levels·C·K (its per-level passes);
    ``incremental`` = n·C·K (the sparse increments) + LEVEL_PASS_COST·levels·C·n (the
    per-level moments). Otherwise (grouped convs, unknown n): ``gram`` when its per-sample
    work groups·K² is at most ``GRAM_SPEED`` times the incremental one, n_out·(K +
    3·n_levels). Never ``gram`` when its groups·K² accumulator exceeds GRAM_MAX_ENTRIES."""
    gram = groups * k * k
    if gram > GRAM_MAX_ENTRIES:
        return "incremental"
    if groups == 1 and n_samples is not None:
        n, lev = int(n_samples), LEVEL_PASS_COST * n_levels
        whole = n * k * k / GRAM_SPEED + n_out * k * k + lev * n_out * k
        return "gram" if whole <= n * n_out * k + lev * n_out * n else "incremental"
    return "gram" if gram <= GRAM_SPEED * n_out * (k + 3 * n_levels) else "incremental"


def finish_cost(plan: dict) -> float:
    """Operations of :func:`~onnxdiag.sparsity.rr_layer.finish_layer` (to schedule the
    largest first): a ``gram`` plan's sparse R_l Σ products (its weights × K) and
    per-level C × K passes; about none for an ``incremental`` one."""
    if plan["mode"] != "gram":
        return 0.0
    c, k = plan["dense_rows"].shape
    return float(plan["n"]) * k + len(plan["acc"]) * c * k


def layer_positions(layer) -> int | None:
    """Positions per input of a layer from its inferred shapes: a conv's output positions,
    a linear layer's tokens (its input's axes between the batch and the features; 1 for an
    (n, n_in) input); None where a shape is unknown or symbolic."""
    conv = layer.op_type in ("Conv", "ConvTranspose")
    shape = layer.output_shape if conv else layer.input_shape
    if not shape:
        return None
    axes = shape[2:] if conv else shape[1:-1]
    if not all(isinstance(d, int) and d > 0 for d in axes):
        return None
    return int(np.prod(axes)) if axes else 1


def fold_cost(plan: dict) -> float:
    """Operations per folded row of a plan (to hand the largest folds to the threads
    first): a ``gram`` plan's groups·K² BLAS work (in sparse units), an ``incremental``
    one's removed weights plus its per-level moments."""
    channels = len(plan["acc"][0].mean_a)
    if plan["mode"] == "gram":
        k = plan["dense_rows"].shape[1]
        return plan["groups"] * k * k / GRAM_SPEED
    return float(plan["n"]) + LEVEL_PASS_COST * len(plan["acc"]) * channels
