"""One streaming pass that collects the channel statistics of SPEC B1.

For every analysed conv (≥ 4 output channels, head excluded) the pre-BN output
is sampled at 16 seeded spatial positions per image and folded into float64 moments
together with the per-image target T (the logit margin, SPEC B3) and a permutation
control (T shuffled across the images of each batch, seeded). Memory is O(C²) per
layer, independent of the number of images.

Where the samples come from (:func:`choose_taps`): the conv's output, exposed
channels-last so that a sampled position is one contiguous row; or, where the conv's
input is far smaller than its output (a first conv on a grey or RGB image), the input,
with the conv evaluated in float64 at the sampled positions only. Exposing a tensor
costs a copy out of ONNX Runtime's blocked layout, and exposing a conv's output keeps
its BatchNormalization from being fused; both costs scale with the values exposed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..errors import OnnxDiagError
from ..evaluate import head_arrays
from ..model.expose import expose_channels_last, expose_tensors
from ..runtime.runner import OrtRunner, single_threaded_blas
from ..selection.probe import resolve_targets
from ..stats import Moments, draw_positions

TASK_SAMPLES = ("match", "gap")
MIN_CHANNELS = 4


def find_analysed_layers(structure, layers=None) -> list:
    """Convs with ≥ 4 output channels, head excluded (SPEC B1); or the named ones."""
    if layers:
        return [structure.get_layer(name) for name in layers]
    return [la for la in structure.layers
            if la.op_type == "Conv" and la.n_out >= MIN_CHANNELS and not la.is_head]


def target_margin(U: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    """Per-image logit margin T = U_y − max_{k≠y} U_k; y = labels, or the argmax (pseudo)."""
    y = U.argmax(axis=1) if labels is None else np.asarray(labels, dtype=np.int64)
    rows = np.arange(U.shape[0])
    others = U.copy()
    others[rows, y] = -np.inf
    return U[rows, y] - others.max(axis=1)


@dataclass
class LayerMoments:
    """Accumulated statistics of one layer (mergeable across shards).

    ``task``: Moments of the columns [y (C), T, T_null] where y are the spatial
    samples with T repeated per position ("match") or the per-image spatial means
    ("gap"), and T_null is T permuted across images (the permutation control).
    ``local``: Moments of the spatial samples (C) — only kept for "gap"; for "match"
    the local statistics are the first C columns of ``task`` (one Gram update).
    """

    layer: str
    n_channels: int
    task: Moments
    local: Moments | None = None
    n_images: int = 0

    def merge(self, other: LayerMoments) -> LayerMoments:
        self.task.merge(other.task)
        if self.local is not None:
            self.local.merge(other.local)
        self.n_images += other.n_images
        return self

    def local_moments(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean (C,), cov (C, C)) of the spatial samples: the local axis (B2)."""
        if self.local is not None:
            return self.local.mean, self.local.cov()
        c = self.n_channels
        return self.task.mean[:c], self.task.cov()[:c, :c]

    def target_moments(self, *, null: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
        """(cov_yy, cov_yt, var_t) for the target axis (B3); ``null``: permuted T."""
        c = self.n_channels
        cov = self.task.cov()
        j = c + (1 if null else 0)
        return cov[:c, :c], cov[:c, j], float(cov[j, j])


@dataclass(frozen=True)
class ChannelStats:
    """The result of :func:`collect_channel_moments`: per-layer moments and settings."""

    layers: dict[str, LayerMoments]
    targets: str
    task_samples: str
    n_positions: int
    seed: int
    n_images: int
    data: dict = field(default_factory=dict)
    taps: dict = field(default_factory=dict)


def _check_request(task_samples, targets, source, structure, layers) -> tuple[str, list]:
    """(resolved targets, analysed layers) of a statistics pass, or a one-line user error."""
    if task_samples not in TASK_SAMPLES:
        raise OnnxDiagError(f"--task-samples must be one of {', '.join(TASK_SAMPLES)}; "
                            f"got {task_samples!r}.")
    targets = resolve_targets(targets, source.has_labels)
    if targets == "expected":
        raise OnnxDiagError("Channel targets must be 'labels' or 'pseudo' (the logit margin); "
                            "'expected' applies to readouts only.")
    chosen = find_analysed_layers(structure, layers)
    if not chosen:
        raise OnnxDiagError("No conv layer with at least 4 output channels to analyse; "
                            "`onnxdiag inspect MODEL` lists the layers.")
    return targets, chosen


def collect_channel_moments(model, structure, source, *, layers=None, n_positions: int = 16,
                            task_samples: str = "match", targets: str = "auto", seed: int = 0,
                            providers=None, label: str | None = None,
                            runner: OrtRunner | None = None,
                            overlap: bool = True, tap: str = "auto") -> ChannelStats:
    """Stream ``source`` once and accumulate every analysed layer's moments (SPEC B1).

    ``targets``: "labels" (ground-truth logit margin), "pseudo" (the predicted class's
    margin; flagged in reports) or "auto" (labels when present). Never modifies ``model``.
    ``runner``: a session from :func:`make_stats_runner` with the same ``layers``, to reuse
    across passes (otherwise one is made). ``overlap``: fold each batch's statistics on
    a worker thread while the next batch runs (same result, in the same order).
    ``tap``: where each layer's samples come from (:func:`choose_taps`): "output" (the
    conv's output, sampled), "input" (the conv evaluated in float64 at the sampled
    positions from its exposed input) or "auto" (input where that exposes far fewer
    values, e.g. a first conv on a 1-channel image; output elsewhere).
    """
    targets, chosen = _check_request(task_samples, targets, source, structure, layers)
    head = structure.head
    taps = choose_taps(model, chosen, tap, task_samples, n_positions)
    exposed, names, fetch = _stats_model(model, chosen, head, taps)
    if runner is None:
        runner = StatsRunner(exposed, providers=providers)
    elif not set(fetch) <= set(runner.output_names):
        raise OnnxDiagError("The runner passed to collect_channel_moments does not expose "
                            "the analysed layers; make it with make_stats_runner(model, "
                            "structure, layers, tap=…) with this pass's settings.")
    acc = {la.node_name: LayerMoments(la.node_name, la.n_out, Moments(la.n_out + 2),
                                      Moments(la.n_out) if task_samples == "gap" else None)
           for la in chosen}
    buffers: dict = {}  # reused float64 work buffers, one per (rows, columns) shape

    def fold_batch(batch, out) -> int:
        _, U = head_arrays(out, head)
        t = target_margin(U, batch.labels if targets == "labels" else None)
        t_null = _shuffle(t, seed, batch.indices)
        both = np.column_stack([t, t_null])
        positions: dict[int, tuple] = {}
        for la in chosen:
            conv = taps[la.node_name]
            if isinstance(conv, InputTap):
                samples = conv.samples(out[names[la.input]], batch.indices, n_positions, seed)
                _fold_rows(acc[la.node_name].task, samples, both, samples.shape[0] // len(t),
                           buffers)
                acc[la.node_name].n_images += len(t)
            else:
                _fold(acc[la.node_name], out[names[la.output]], t, t_null, batch.indices,
                      positions, n_positions, seed, task_samples, buffers)
        return len(t)

    n_images = 0
    with single_threaded_blas():
        if not overlap:
            for batch, out in runner.stream(source, fetch, label=label):
                n_images += fold_batch(batch, out)
        else:
            # Fold batch b on a worker thread while ONNX Runtime runs batch b + 1 (both
            # release the GIL); batches are folded in order, at most two are held.
            with ThreadPoolExecutor(max_workers=1) as pool:
                pending = None
                for batch, out in runner.stream(source, fetch, label=label):
                    if pending is not None:
                        n_images += pending.result()
                    pending = pool.submit(fold_batch, batch, out)
                if pending is not None:
                    n_images += pending.result()
    return ChannelStats(layers=acc, targets=targets, task_samples=task_samples,
                        n_positions=n_positions, seed=seed, n_images=n_images,
                        data=source.describe(), taps=tap_names(taps))


def _stats_model(model, chosen, head, taps: dict) -> tuple:
    """(model exposing what the pass reads, layer tensor → its channels-last output name,
    the output names to fetch: the head's features and logits, then the layer tensors).

    Each analysed conv's output, or for an input tap its input, is exposed channels-last
    (sampled positions are then contiguous C-vectors; on CPU the Transpose rides on the
    layout reorder ONNX Runtime does for any exposed conv tensor); the head's features
    and logits as they are.
    """
    tensors = {}
    for la in chosen:
        tensor = la.input if isinstance(taps[la.node_name], InputTap) else la.output
        tensors[tensor] = len(la.kernel) + 2
    exposed, last = expose_channels_last(
        expose_tensors(model, [head.features, head.logits]), tensors,
        tag="stats_channels_last")
    fetch = list(dict.fromkeys([head.features, head.logits, *last.values()]))
    return exposed, last, fetch


def make_stats_runner(model, structure, *, layers=None, providers=None,
                      threads: int | None = None, tap: str = "auto",
                      task_samples: str = "match", n_positions: int = 16) -> StatsRunner:
    """The session of the statistics pass (analysed layers + head exposed), to reuse;
    ``tap``, ``task_samples`` and ``n_positions`` as for the pass that will use it."""
    chosen = find_analysed_layers(structure, layers)
    taps = choose_taps(model, chosen, tap, task_samples, n_positions)
    exposed, _, _ = _stats_model(model, chosen, structure.head, taps)
    return StatsRunner(exposed, providers=providers, threads=threads)


TAPS = ("auto", "output", "input")


@dataclass(frozen=True)
class InputTap:
    """A conv evaluated at the sampled positions from its input (SPEC B1's y, float64).

    ``matrix`` (groups, K, C_out/groups) and ``bias`` (the node's own bias input, or
    None; a separate bias Add comes after ``Layer.output`` and is left out, as there).
    """

    op: object
    kernel: tuple
    matrix: np.ndarray
    bias: np.ndarray | None

    def samples(self, x_last: np.ndarray, indices, n_positions: int, seed: int) -> np.ndarray:
        """Rows (n·k, C_out) at the positions :func:`draw_positions` gives the output."""
        from ..sparsity.offline import apply_columns, sampled_columns

        cols = sampled_columns(self.op, np.moveaxis(x_last, -1, 1), self.kernel, n_positions,
                               seed=seed, sample_indices=indices, x_last=x_last)
        y = apply_columns(cols.astype(np.float64), self.matrix)
        if self.bias is not None:
            y += self.bias
        return y


def choose_taps(model, chosen, tap: str = "auto", task_samples: str = "match",
                n_positions: int = 16) -> dict:
    """Per analysed layer: "output" or an :class:`InputTap`.

    Every exposed tensor costs the pass a copy out of ONNX Runtime's fused, blocked
    layout, and exposing a conv's output also keeps its BatchNormalization from being
    fused into it. "auto" taps a conv's input instead when that exposes at most a
    quarter as many values per image as its output and the float64 work at the sampled
    positions (k·C_in/groups·Πkernel·C_out multiply-adds) is at most one pass over the
    output: typically a first conv on a 1- or 3-channel image (never when the shapes are
    not static). Input taps need a 1-D or 2-D conv with constant weights and
    ``task_samples="match"`` ("gap" needs every output position).
    """
    if tap not in TAPS:
        raise OnnxDiagError(f"tap must be one of {', '.join(TAPS)}; got {tap!r}.")
    if tap == "input" and task_samples != "match":
        raise OnnxDiagError("Input taps sample the conv at positions; --task-samples gap "
                            "needs the whole output: use tap 'output' or 'auto'.")
    index = None
    taps: dict = {}
    for la in chosen:
        why = _input_tap_obstacle(la, task_samples)
        if tap == "input" and why:
            raise OnnxDiagError(f"Layer {la.node_name!r} cannot be tapped at its input "
                                f"({why}); use tap 'auto' or 'output'.")
        if tap == "output" or why or (tap == "auto" and not _input_is_cheaper(la, n_positions)):
            taps[la.node_name] = "output"
            continue
        if index is None:
            from ..graph import GraphIndex

            index = GraphIndex(model)
        taps[la.node_name] = _input_tap(index, la)
    return taps


def tap_names(taps: dict) -> dict[str, str]:
    """Layer → "input" / "output", for reports."""
    return {name: "input" if isinstance(t, InputTap) else "output" for name, t in taps.items()}


def _input_tap_obstacle(la, task_samples: str) -> str | None:
    if task_samples != "match":
        return "--task-samples gap"
    if la.op_type != "Conv" or len(la.kernel) not in (1, 2):
        return "only 1-D and 2-D convs"
    if la.weight_initializer is None:
        return "its weights are computed, not constant"
    return None


def _input_is_cheaper(la, n_positions: int) -> bool:
    if not la.input_shape or not la.output_shape or not all(
            isinstance(d, int) for d in (*la.input_shape[1:], *la.output_shape[1:])):
        return False  # unknown sizes: keep the output
    in_values = int(np.prod(la.input_shape[1:]))
    out_spatial = int(np.prod(la.output_shape[2:]))
    out_values = la.n_out * out_spatial
    macs = min(n_positions, out_spatial) * (la.n_in // la.groups) * int(np.prod(la.kernel)) \
        * la.n_out
    return 4 * in_values <= out_values and macs <= out_values


def _input_tap(index, la) -> InputTap:
    from ..sparsity.offline import layer_op, weight_matrix

    op = layer_op(index, la)
    w = np.asarray(index.get_constant(la.weight), dtype=np.float64)
    node = index.get_node(la.node_name)
    bias = index.get_constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    return InputTap(op, tuple(la.kernel), weight_matrix(op, w),
                    None if bias is None else np.asarray(bias, np.float64).reshape(-1))


class StatsRunner(OrtRunner):
    """An :class:`OrtRunner` whose intra-op threads sleep instead of spinning between runs.

    The statistics pass alternates ORT runs with NumPy/BLAS work on the same cores; ORT's
    default spin-wait after each run keeps those cores busy and made the NumPy work (and
    the next run) several times slower. Same providers and optimisation level otherwise.
    """

    def __init__(self, model, *, providers=None, threads: int | None = None):
        super().__init__(model, providers=providers, threads=threads, spinning=False)


def _shuffle(t: np.ndarray, seed: int, indices: np.ndarray) -> np.ndarray:
    """T permuted across the images of one batch (seeded by the batch's first index).

    A within-batch permutation is a valid null as long as batches are not sorted by
    class; it keeps memory O(batch) instead of storing every image's statistics.
    """
    first = int(indices[0]) if len(indices) else 0
    return t[np.random.default_rng([seed, 7919, first]).permutation(len(t))]


def _fold(acc: LayerMoments, x: np.ndarray, t, t_null, indices, positions, n_positions, seed,
          task_samples, buffers: dict) -> None:
    """Fold one layer's batch output into its moments (the hot loop of the pass).

    ``x`` is channels-last, ``(n, *spatial, C)``, so the sampled positions are whole rows
    of ``x`` viewed as (n·HW, C): one ``take`` gathers them. ``positions`` caches the
    batch's rows per spatial size (layers of one size share their draw).
    """
    n, c = x.shape[0], x.shape[-1]
    hw = int(np.prod(x.shape[1:-1]))
    if hw not in positions:
        pos = draw_positions(hw, n_positions, seed=seed, sample_indices=indices)
        positions[hw] = ((pos + np.arange(n)[:, None] * hw).reshape(-1), pos.shape[1])
    rows, k = positions[hw]
    samples = np.take(x.reshape(n * hw, c), rows, axis=0)  # (n·k, C), image-major
    if task_samples == "match":
        _fold_rows(acc.task, samples, np.column_stack([t, t_null]), k, buffers)
    else:
        _fold_rows(acc.local, samples, None, k, buffers)
        means = x.reshape(n, hw, c).mean(axis=1, dtype=np.float64)
        acc.task.update(np.column_stack([means, t, t_null]))
    acc.n_images += n


def _fold_rows(moments: Moments, samples: np.ndarray, targets: np.ndarray | None, k: int,
               buffers: dict) -> None:
    """``moments`` of the columns [samples, targets repeated k times per image].

    Everything is float64 around the running mean (the first row on the first batch):
    the samples are copied into a contiguous float64 buffer ``y`` and shifted in place,
    the per-image columns ``e = [targets − centre | 1]`` are repeated per position, and
    the Gram of ``[y | e]`` is assembled from ``yᵀy`` (one syrk, the bulk of the work),
    ``yᵀe`` and ``eᵀe``; its ones column gives the sums around the centre, so
    :meth:`Moments.update_sums` needs no second pass over the samples.
    """
    rows, c = samples.shape
    if rows == 0:
        return
    n_t = 0 if targets is None else targets.shape[1]
    d = c + n_t
    if moments.n:
        centre = moments.mean
    else:
        first = [samples[0]] if targets is None else [samples[0], targets[0]]
        centre = np.concatenate(first).astype(np.float64)
    y = buffers.get((rows, c))
    if y is None:
        y = buffers[(rows, c)] = np.empty((rows, c))
    np.copyto(y, samples)  # float32 → float64 (exact), contiguous
    y -= centre[:c]
    per_image = np.ones((rows // k, n_t + 1))
    if targets is not None:
        np.subtract(targets, centre[c:], out=per_image[:, :n_t])
    e = np.repeat(per_image, k, axis=0)
    gram = np.empty((d + 1, d + 1))
    gram[:c, :c] = y.T @ y
    gram[:c, c:] = y.T @ e
    gram[c:, :c] = gram[:c, c:].T
    gram[c:, c:] = e.T @ e
    moments.update_sums(rows, centre, gram[d, :d], gram[:d, :d])


# --------------------------------------------------------------------------- sharded pass
#
# The same pass on an executor (issue 9): the calibration set is cut into shards of
# whole consecutive batches, each unit streams its shard into fresh LayerMoments and the
# driver merges them in shard order (Moments.merge is exact up to float64 rounding).
# Shards give the same statistics as one pass because
#   - a shard boundary is always a multiple of the (effective) batch size in the list of
#     selected samples, so every batch has the same members as in the single pass, and
#     the permutation control (_shuffle, seeded by (seed, the batch's first index)) draws
#     the same permutation of the same images;
#   - the spatial positions are a counter-based hash of (seed, source index, draw), and
#     every sample keeps its source index.


@dataclass(frozen=True)
class ShardUnit:
    """One unit of the sharded pass: batches ``[start, stop)`` of the selected samples.

    ``batches``: the shard's data when the driver ships it (read once by the driver);
    None when the worker reads its batches itself from the data path.
    """

    shard: int
    start: int
    stop: int
    batches: tuple | None = None


class _ShardSource:
    """The batches ``[start, stop)`` of a DataSource, or shipped batches, as a source."""

    def __init__(self, batch_size: int, has_labels: bool, batches=None, source=None,
                 start: int = 0, stop: int = 0):
        self.batch_size, self._has_labels = batch_size, has_labels
        self._batches, self._source, self._range = batches, source, (start, stop)

    @property
    def has_labels(self) -> bool:
        return self._has_labels

    @property
    def n_samples(self) -> int:
        if self._batches is not None:
            return sum(len(b) for b in self._batches)
        start, stop = self._range
        return int(self._source.indices[start * self.batch_size:stop * self.batch_size].size)

    def batches(self):
        if self._batches is not None:
            yield from self._batches
            return
        yield from self._source.batch_range(*self._range)

    def describe(self) -> dict:
        return {"n_samples": self.n_samples}


def _readable_by_path(data, source) -> bool:
    """Whether a worker can reopen ``data`` and fetch any batch range of it by index."""
    from pathlib import Path

    return (isinstance(data, (str, Path)) and not str(data).split(":")[0].endswith(".py")
            and getattr(source, "random_access", False))


def collect_channel_moments_sharded(model, structure, data, *, executor, labels=None,
                                    limit=None, seed: int = 0, batch_size: int = 64,
                                    layers=None, n_positions: int = 16,
                                    task_samples: str = "match", targets: str = "auto",
                                    providers=None, n_shards: int | None = None,
                                    ship: bool | None = None,
                                    label: str | None = None,
                                    tap: str = "auto") -> ChannelStats:
    """:func:`collect_channel_moments` over ``data`` on ``executor``, shard by shard.

    ``data``/``labels``/``limit``/``seed``/``batch_size``: as for ``open_data`` (the same
    samples as the single pass). ``n_shards``: default one per worker (local processes,
    or the Ray cluster's CPUs), at most one per batch. ``ship``: where a shard's data
    comes from. By default a worker reads its own batch range from the data path (an
    .npy/.npz file or an image folder: only the path travels, the driver never holds
    the calibration set; on a multi-node cluster the path must exist on every node);
    in-memory data, loader scripts and readers (or ``ship=True``) are read by the driver
    and each shard's batches are shipped as its unit (through Ray's object store, or
    pickled to the local worker process). The model is shipped once as bytes.

    Equals the single pass to float64 rounding (the merge order is the shard order). A
    failed shard raises OnnxDiagError naming its samples: merged statistics without it
    would silently describe another data set.
    """
    from ..data.source import open_data
    from ..model.io import get_input_specs
    from ..runtime.executor import UnitError, raise_failures

    if task_samples not in TASK_SAMPLES:  # checked before the data are opened
        _check_request(task_samples, targets, None, structure, layers)
    source = open_data(data, get_input_specs(model), labels=labels, limit=limit, seed=seed,
                       batch_size=batch_size)
    resolved, chosen = _check_request(task_samples, targets, source, structure, layers)
    choose_taps(model, chosen, tap, task_samples, n_positions)  # its errors, here, once
    bs = source.batch_size
    by_path = not ship and _readable_by_path(data, source)
    if by_path:
        n_batches, shipped = -(-source.n_samples // bs), None
    else:
        shipped = list(source.batches())  # streams are read once, here
        n_batches = len(shipped)
    if n_batches == 0:
        raise OnnxDiagError("The calibration data has no samples; pass a non-empty --data.")
    n_shards = max(1, min(n_shards or executor.capacity, n_batches))
    bounds = np.linspace(0, n_batches, n_shards + 1).round().astype(int)
    items = [ShardUnit(k, int(a), int(b), None if by_path else tuple(shipped[a:b]))
             for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    del shipped
    data_args = dict(source=str(data), labels=labels, limit=limit, seed=seed,
                     batch_size=batch_size) if by_path else None
    parallel = not executor.in_process
    settings = dict(layers=[la.node_name for la in chosen], n_positions=n_positions,
                    task_samples=task_samples, targets=resolved, seed=seed,
                    providers=providers, head=structure.head.node_name,
                    features=structure.head.features, has_labels=source.has_labels,
                    batch_size=bs, n_samples=source.n_samples,
                    threads=1 if parallel else None,  # cores go to processes, not threads
                    tap=tap)
    results: dict[int, ChannelStats] = {}
    errors = []
    for k, stats, error in executor.map(_shard_unit, items,
                                        (model.SerializeToString(), data_args, settings),
                                        label=label, gpu=_wants_gpu(providers)):
        if error is not None or stats is None:
            it = items[k]
            batches = f"batch {it.start}" if it.stop - it.start == 1 else \
                f"batches {it.start}-{it.stop - 1}"
            last = min(it.stop * bs, source.n_samples or it.stop * bs) - 1
            errors.append(UnitError(f"shard {k} ({batches}, selected samples "
                                    f"{it.start * bs}-{last}): {error}",
                                    type_name=getattr(error, "type_name", ""),
                                    traceback=getattr(error, "traceback", ""),
                                    user_error=getattr(error, "user_error", True)))
        else:
            results[k] = stats
    raise_failures(errors, f"{len(errors)} of {len(items)} statistics shards failed, so the "
                           "merged statistics would miss their samples; first: {first}"
                           " — fix the cause (or run with --executor local) and rerun.")
    # Fresh accumulators (results from Ray's object store are read-only), shard order.
    merged = {la.node_name: LayerMoments(la.node_name, la.n_out, Moments(la.n_out + 2),
                                         Moments(la.n_out) if task_samples == "gap" else None)
              for la in chosen}
    for k in range(len(items)):
        for name, lm in results[k].layers.items():
            merged[name].merge(lm)
    return ChannelStats(layers=merged, targets=resolved, task_samples=task_samples,
                        n_positions=n_positions, seed=seed,
                        n_images=sum(r.n_images for r in results.values()),
                        data={**source.describe(), "shards": len(items),
                              "shard_data": "read by workers from the path" if by_path
                              else "shipped by the driver"},
                        taps=results[0].taps)


def _wants_gpu(providers) -> bool:
    from ..runtime.executor import wants_gpu

    return wants_gpu(providers)


def _shard_unit(item: ShardUnit, model_bytes: bytes, data_args: dict | None,
                settings: dict) -> ChannelStats:
    """One shard's statistics (runs on a worker): the same pass on its batches."""
    import onnx

    from ..graph import analyze_structure

    model = onnx.load_from_string(model_bytes)
    structure = analyze_structure(model, head=settings["head"], features=settings["features"])
    bs = settings["batch_size"]
    if item.batches is not None:
        shard = _ShardSource(bs, settings["has_labels"], batches=item.batches)
    else:
        from ..data.source import open_data
        from ..model.io import get_input_specs

        args = dict(data_args)
        source = open_data(args.pop("source"), get_input_specs(model), **args)
        if (source.batch_size, source.n_samples, source.has_labels) != \
                (bs, settings["n_samples"], settings["has_labels"]):
            raise OnnxDiagError("The data read by this worker differ from the driver's "
                                "(samples, batch size or labels); give every node the same "
                                "data file at the same path.")
        shard = _ShardSource(bs, source.has_labels, source=source, start=item.start,
                             stop=item.stop)
    runner = make_stats_runner(model, structure, layers=settings["layers"],
                               providers=settings["providers"], threads=settings["threads"],
                               tap=settings["tap"], task_samples=settings["task_samples"],
                               n_positions=settings["n_positions"])
    return collect_channel_moments(model, structure, shard, layers=settings["layers"],
                                   n_positions=settings["n_positions"],
                                   task_samples=settings["task_samples"],
                                   targets=settings["targets"], seed=settings["seed"],
                                   runner=runner, tap=settings["tap"])
