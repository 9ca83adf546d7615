"""How many intra-op threads the statistics pass gives ONNX Runtime (``docs/METHODS.md §B1``,
"Cost").

The pass folds batch b on a worker thread while ONNX Runtime runs batch b + 1. When the
fold is a sizeable part of the work, ONNX Runtime's threads and the fold's share the
cores: a parallel operator waits for its slowest thread, and a thread the fold
preempted stalls the whole operator. Giving ONNX Runtime one core fewer leaves the fold a
core of its own. Where the fold is small next to inference (wide convs over many
positions), ONNX Runtime keeps every core. The fold's work is estimated from the shapes:
per image and analysed layer, the float32 Gram of k sampled rows of C + 3 columns
(2·k·(C + 3)² FLOPs) plus a fixed per-layer cost, against the model's FLOPs per image.
"""

from __future__ import annotations

import math
import os

#: The fold's fixed cost per analysed layer and image, in FLOP equivalents: ~0.15 ms of
#: NumPy calls per layer and 256-image batch at ~50 GFLOP/s (measured on the project's
#: machine, benchmarks/RESULTS.md).
LAYER_OVERHEAD_FLOPS = 3e4
#: Fold FLOPs / model FLOPs from which the fold gets a core of its own (**our default**:
#: between a 224×224 MobileNetV2's 0.59, where ONNX Runtime's second thread paid (the pass
#: 2.55× plain instead of 3.2–3.7×), and the ViT sample's 1.45, where it cost (1.9× instead
#: of 2.1×); ResNet-18 on 28×28 images 0.27, MobileNetV2 on 28×28 images 5.5,
#: benchmarks/RESULTS.md).
FOLD_SHARE = 1.0


def fold_flops(chosen, n_positions: int) -> float | None:
    """The fold's estimated FLOPs per image over the analysed layers ``chosen`` (None when
    a layer's positions per image are not known from the shapes)."""
    total = 0.0
    for la in chosen:
        shape = la.output_shape
        if not shape or len(shape) < 2:
            return None
        spatial = shape[2:] if la.op_type.startswith("Conv") else shape[1:-1]
        if not all(isinstance(d, int) and d > 0 for d in spatial):
            return None
        k = min(n_positions, math.prod(spatial))
        total += 2.0 * k * (la.n_out + 3) ** 2 + LAYER_OVERHEAD_FLOPS
    return total


def session_threads(structure, chosen, n_positions: int, *, cores: int | None = None,
                    share: float = FOLD_SHARE) -> int | None:
    """Intra-op threads for the statistics session: ``cores`` − 1 when the fold's estimated
    FLOPs are at least ``share`` of the model's per image (and there are two cores or
    more), else None (ONNX Runtime's default, every core). ``cores``: default the CPUs this
    process may run on."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
    fold = fold_flops(chosen, n_positions)
    if cores < 2 or fold is None or not structure.flops:
        return None
    return cores - 1 if fold >= share * structure.flops else None


#: Fold FLOPs per batch from which a pass whose session keeps every core folds each batch
#: after its run, its layers split over every core, rather than on one worker thread
#: beside the next run, whose operators then wait for the core it takes (**our default**:
#: ~20 ms of float32 Gram products on one core; ResNet-50 folds ~13 GFLOP per 32-image
#: batch and read 1.54× → 1.40× plain; the 28×28 nets fold ≪ 1 GFLOP a batch, where the
#: threads' dispatch costs more than the overlap; benchmarks/RESULTS.md).
PARALLEL_FOLD_FLOPS = 2e9


def fold_workers(chosen, n_positions: int, batch_size: int | None, session: int | None, *,
                 cpu: bool = True, cores: int | None = None,
                 min_flops: float | None = None) -> int:
    """Threads that fold each batch after its run: every core (``cores``, default this
    process's) when a ``cpu`` session keeps every core (``session``: its intra-op threads,
    None or 0 for all) and the fold's estimated FLOPs per batch of ``batch_size`` are at
    least ``min_flops`` (default :data:`PARALLEL_FOLD_FLOPS`); else 1 (the fold overlaps
    the next run on one worker thread, as it always does beside a GPU session)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
    fold = fold_flops(chosen, n_positions)
    if not cpu or cores < 2 or session or not batch_size or fold is None:
        return 1
    limit = PARALLEL_FOLD_FLOPS if min_flops is None else min_flops
    return cores if fold * batch_size >= limit else 1
