"""One streaming pass that collects the channel statistics of ``docs/METHODS.md §B1``.

For every analysed layer (a conv or a linear layer, Gemm / MatMul, with ≥ 4 output
channels, head excluded) the pre-normalisation output is sampled at 16 seeded
positions per input (spatial positions of a conv; tokens of a linear layer, §D) and
folded into float64 moments together with the per-input target T (the logit margin,
§B3) and a permutation control (T shuffled across the inputs of each batch, seeded).
Memory is O(C²) per layer, independent of the number of inputs.

Each layer's samples come from its output, exposed channels-last so that a sampled
position is one contiguous row (a linear layer's output already is), or from its input
(:mod:`onnxdiag.channels.taps`); the accumulators and the per-batch fold are in
:mod:`onnxdiag.channels.moments`. :func:`collect_channel_moments_sharded` is the same
pass on an executor, shard by shard (:mod:`onnxdiag.channels.shards`).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..data.request import DataRequest
from ..errors import OnnxDiagError
from ..model.expose import (
    bn_as_depthwise_conv,
    channels_last_name,
    expose_channels_last,
    expose_tensors,
)
from ..runtime.executor import wants_gpu
from ..runtime.runner import OrtRunner, cpu_only, single_threaded_blas
from ..selection.probe import resolve_targets
from . import shards
from .moments import BatchFolder, ChannelStats, LayerMoments
from .taps import InputTap, choose_taps, tap_names
from .threads import fold_workers, session_threads

TASK_SAMPLES = ("match", "gap")
MIN_CHANNELS = 4
#: Layer kinds the pass analyses by default: op type → kind (docs/METHODS.md §B1, §D).
ANALYSED_KINDS = {"Conv": "conv", "Gemm": "linear", "MatMul": "linear"}


@dataclass(frozen=True)
class StatsSettings:
    """What a statistics pass measures (``docs/METHODS.md §B1``, §B3).

    ``layers``: node names of the analysed layers (None: every conv and linear layer
    with ≥ 4 output channels, head excluded). ``n_positions``: positions sampled per
    input (spatial positions, or tokens of a linear layer; all when there are fewer).
    ``task_samples``: "match" (T repeated per sampled position) or "gap" (per-input
    means over positions for the target axis). ``targets``: "labels" (the
    ground-truth logit margin), "pseudo" (the predicted class's; flagged in reports) or
    "auto" (labels when the data have them). ``seed``: the positions and the permutation
    control. ``tap``: where each layer's samples come from
    (:func:`~onnxdiag.channels.taps.choose_taps`: "auto", "output" or "input").
    """

    layers: tuple | None = None
    n_positions: int = 16
    task_samples: str = "match"
    targets: str = "auto"
    seed: int = 0
    tap: str = "auto"

    def __post_init__(self):
        if self.layers is not None and not isinstance(self.layers, tuple):
            object.__setattr__(self, "layers", tuple(self.layers))

    @classmethod
    def of(cls, settings: StatsSettings | None = None, **fields) -> StatsSettings:
        """``settings`` (default: the defaults) with the ``fields`` given replaced."""
        base = cls() if settings is None else settings
        return replace(base, **fields) if fields else base


def find_analysed_layers(structure, layers=None) -> list:
    """Convs and linear layers (Gemm / MatMul) with ≥ 4 output channels, head excluded
    (§B1, §D); or the named ones (raises OnnxDiagError for a name that is not a layer of
    ``structure``)."""
    if layers:
        names = [la.node_name for la in structure.layers]
        for name in layers:
            if name not in names:
                raise OnnxDiagError(f"Layer {name!r} is not in the model (first 5 of "
                                    f"{len(names)}: {', '.join(names[:5])}); `onnxdiag "
                                    "inspect MODEL` lists the layers.")
        return [structure.get_layer(name) for name in layers]
    return [la for la in structure.layers
            if la.op_type in ANALYSED_KINDS and la.n_out >= MIN_CHANNELS and not la.is_head]


def analysed_kinds(layers) -> dict[str, int]:
    """{"conv": n, "linear": m} of analysed layers (for reports)."""
    kinds = [ANALYSED_KINDS.get(la.op_type, la.op_type) for la in layers]
    return {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}


def check_task_samples(task_samples: str) -> None:
    """A one-line user error unless ``task_samples`` is "match" or "gap"."""
    if task_samples not in TASK_SAMPLES:
        raise OnnxDiagError(f"--task-samples must be one of {', '.join(TASK_SAMPLES)}; "
                            f"got {task_samples!r}.")


def check_settings(settings: StatsSettings, source, structure) -> tuple[str, list]:
    """(resolved targets, analysed layers) of a pass over ``source``, or a user error."""
    check_task_samples(settings.task_samples)
    targets = resolve_targets(settings.targets, source.has_labels)
    if targets == "expected":
        raise OnnxDiagError("Channel targets must be 'labels' or 'pseudo' (the logit margin); "
                            "'expected' applies to readouts only.")
    chosen = find_analysed_layers(structure, settings.layers)
    if not chosen:
        raise OnnxDiagError("No conv or linear layer with at least 4 output channels to "
                            "analyse (the head excluded); `onnxdiag inspect MODEL` lists "
                            "the layers.")
    return targets, chosen


def collect_channel_moments(model, structure, source, settings: StatsSettings | None = None, *,
                            providers=None, label: str | None = None,
                            runner: OrtRunner | None = None, overlap: bool = True,
                            fold_threads: int | None = None, **fields) -> ChannelStats:
    """Stream ``source`` once and accumulate every analysed layer's moments (§B1).

    ``settings``: a :class:`StatsSettings`, or its fields as keywords (``layers=…,
    targets=…, seed=…``; given fields replace those of ``settings``). ``runner``: a
    session from :func:`make_stats_runner` with the same layers and taps, to reuse
    across passes (otherwise one is made with ``providers``). ``overlap``: fold each
    batch's statistics on a worker thread while the next batch runs (same result, in
    the same order; the session then leaves that thread a core where the fold is large,
    :func:`~onnxdiag.channels.threads.session_threads`), or, where a CPU session keeps
    every core and each batch's fold is large, after its run with the layers split over
    the cores (:func:`~onnxdiag.channels.threads.fold_workers`); ``fold_threads`` (with
    ``overlap``) sets that choice: 1 the worker beside the next run, k ≥ 2 k threads after
    each run, None as above. ``overlap`` False: in this thread, after each run. The same
    moments bit for bit in every case. ``label``: a progress bar.
    Never modifies ``model``.

    Raises OnnxDiagError (bad settings, no analysable layer, a runner that does not
    expose this pass's tensors).
    """
    settings = StatsSettings.of(settings, **fields)
    targets, chosen = check_settings(settings, source, structure)
    taps = choose_taps(model, chosen, settings.tap, settings.task_samples, settings.n_positions)
    if runner is None:
        exposed, names, fetch = _stats_model(model, chosen, structure.head, taps,
                                             cpu=cpu_only(providers))
        threads = session_threads(structure, chosen, settings.n_positions) if overlap else None
        runner = StatsRunner(exposed, providers=providers, threads=threads)
    else:  # the names alone: building the exposed model cost 10 % of a pass on 52 layers
        names, fetch = _stats_names(*_tensors(chosen, taps), structure.head)
    if not set(fetch) <= set(runner.output_names):
        raise OnnxDiagError("The runner passed to collect_channel_moments does not expose "
                            "the analysed layers; make it with make_stats_runner(model, "
                            "structure, layers, tap=…) with this pass's settings.")
    folder = BatchFolder(chosen, taps, names, structure.head, settings, targets)
    workers = 1 if not overlap else fold_threads or fold_workers(
        chosen, settings.n_positions, getattr(source, "batch_size", None), runner.threads,
        cpu=runner.providers == ["CPUExecutionProvider"])
    fold = folder.fold if workers == 1 else functools.partial(folder.fold, workers=workers)
    n_images = _fold_stream(runner.stream(source, fetch, label=label), fold,
                            overlap and workers == 1)
    for acc in folder.acc.values():  # no deferred term leaves the pass
        acc.settle()
    return ChannelStats(layers=folder.acc, targets=targets, task_samples=settings.task_samples,
                        n_positions=settings.n_positions, seed=settings.seed,
                        n_images=n_images, data=source.describe(), taps=tap_names(taps),
                        kinds=analysed_kinds(chosen))


def _fold_stream(stream, fold, overlap: bool) -> int:
    """Fold every ``(batch, outputs)`` of ``stream`` in order; the number of images."""
    n_images = 0
    with single_threaded_blas():
        if not overlap:
            for batch, out in stream:
                n_images += fold(batch, out)
            return n_images
        # Fold batch b on a worker thread while ONNX Runtime runs batch b + 1 (both
        # release the GIL); batches are folded in order, at most two are held.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = None
            for batch, out in stream:
                if pending is not None:
                    n_images += pending.result()
                pending = pool.submit(fold, batch, out)
            if pending is not None:
                n_images += pending.result()
    return n_images


def _stats_model(model, chosen, head, taps: dict, cpu: bool = True) -> tuple:
    """(model exposing what the pass reads, layer tensor → its channels-last output name,
    the output names to fetch: the head's features and logits, then the layer tensors).

    Each analysed conv's output, or for an input tap its input, is exposed channels-last
    (sampled positions are then contiguous C-vectors; on CPU the Transpose rides on the
    layout reorder ONNX Runtime does for any exposed conv tensor); a linear layer's
    tensors (channels last already), the head's features and logits as they are. For a
    ``cpu`` session, an exposed conv's BatchNormalization before a ReLU6 becomes a depthwise Conv
    (:func:`~onnxdiag.model.expose.bn_as_depthwise_conv`: its activation then stays fused).
    """
    tensors, linear = _tensors(chosen, taps)
    exposed, _ = expose_channels_last(
        expose_tensors(model, [head.features, head.logits, *linear]), tensors,
        tag=STATS_TAG)  # its names are channels_last_name's, as _stats_names gives them
    if cpu:
        exposed, _ = bn_as_depthwise_conv(exposed, tensors)
    return (exposed, *_stats_names(tensors, linear, head))


STATS_TAG = "stats_channels_last"


def _tensors(chosen, taps: dict) -> tuple[dict, list]:
    """({conv tensor the pass reads: its rank}, [linear layers' tensors])."""
    tensors, linear = {}, []
    for la in chosen:
        tap = taps[la.node_name]
        tensor = tap.reads(la) if isinstance(tap, InputTap) else la.output
        if la.op_type.startswith("Conv"):
            tensors[tensor] = len(la.kernel) + 2
        else:
            linear.append(tensor)
    return tensors, linear


def _stats_names(tensors: dict, linear: list, head) -> tuple[dict, list]:
    """What :func:`_stats_model` exposes, by name, without building it: (layer tensor →
    its output name, the output names to fetch)."""
    last = {t: channels_last_name(t, STATS_TAG) for t in tensors}
    last.update({t: t for t in linear if t not in last})
    fetch = list(dict.fromkeys([head.features, head.logits, *last.values()]))
    return last, fetch


def make_stats_runner(model, structure, settings: StatsSettings | None = None, *,
                      providers=None, threads: int | None = None, **fields) -> StatsRunner:
    """The session of the statistics pass (analysed layers + head exposed), to reuse;
    ``settings`` (or its fields ``layers``, ``tap``, ``task_samples``, ``n_positions``
    as keywords) as for the pass that will use it. ``threads``: ONNX Runtime's intra-op
    threads; None: :func:`~onnxdiag.channels.threads.session_threads` (one core left to
    the overlapping fold where it is a sizeable part of the work), 0: every core."""
    settings = StatsSettings.of(settings, **fields)
    chosen = find_analysed_layers(structure, settings.layers)
    taps = choose_taps(model, chosen, settings.tap, settings.task_samples, settings.n_positions)
    exposed, _, _ = _stats_model(model, chosen, structure.head, taps, cpu=cpu_only(providers))
    if threads is None:
        threads = session_threads(structure, chosen, settings.n_positions)
    return StatsRunner(exposed, providers=providers, threads=threads or None)


class StatsRunner(OrtRunner):
    """An :class:`OrtRunner` whose intra-op threads sleep instead of spinning between runs.

    The statistics pass alternates ORT runs with NumPy/BLAS work on the same cores; ORT's
    default spin-wait after each run keeps those cores busy and made the NumPy work (and
    the next run) several times slower. Same providers and optimisation level otherwise.
    """

    def __init__(self, model, *, providers=None, threads: int | None = None):
        super().__init__(model, providers=providers, threads=threads, spinning=False)


def collect_channel_moments_sharded(model, structure, data, settings: StatsSettings | None = None,
                                    *, executor, providers=None, n_shards: int | None = None,
                                    ship: bool | None = None, label: str | None = None,
                                    **fields) -> ChannelStats:
    """:func:`collect_channel_moments` over ``data`` on ``executor``, shard by shard.

    ``data``: a :class:`~onnxdiag.commands.base.DataRequest` (or a path or arrays, read
    with its defaults): the same samples as the single pass. ``settings`` (or its fields
    as keywords) as for the single pass. ``n_shards``: default one per worker
    (``executor.capacity``), at most one per batch. ``ship``: where a shard's data come
    from. By default a unit reads its own batch range: from the opened data when units
    run in this process, else from the data path when the executor's workers can read
    this machine's paths (an .npy/.npz file or an image folder: only the request
    travels, the driver never holds the calibration set). Streams, in-memory data,
    loader scripts and readers, workers that cannot read the path (a Ray cluster), or
    ``ship=True`` make the driver read the data once and ship each shard's batches as
    its unit. The model is shipped once as bytes.

    Equals the single pass to float64 rounding (the merge order is the shard order).
    Failed shards stop the pass naming their samples (merged statistics without them
    would silently describe another data set): OnnxDiagError when every failure is a
    user error, else UnitFailure.
    """
    from ..model.io import get_input_specs

    request = DataRequest.of(data)
    settings = StatsSettings.of(settings, **fields)
    check_task_samples(settings.task_samples)  # before the data are opened
    source = request.open(get_input_specs(model))
    targets, chosen = check_settings(settings, source, structure)
    choose_taps(model, chosen, settings.tap, settings.task_samples,
                settings.n_positions)  # its errors, here, once
    shared = shards.shard_data(executor, request, source, ship)
    items = shards.plan_shards(source, shared is not None, n_shards or executor.capacity)
    job = shards.ShardJob(replace(settings, layers=tuple(la.node_name for la in chosen),
                                  targets=targets),
                          structure.head.node_name, structure.head.features, providers,
                          None if executor.in_process else 1,  # cores go to processes
                          source.batch_size, source.n_samples, source.has_labels)
    results = shards.run_shards(executor.map(_shard_unit, items,
                                             (model.SerializeToString(), shared, job),
                                             label=label, gpu=wants_gpu(providers)),
                                items, job)
    merged = {la.node_name: LayerMoments.empty(la, settings.task_samples) for la in chosen}
    for k in range(len(items)):  # fresh accumulators (Ray's results are read-only), in order
        for name, lm in results[k].layers.items():
            merged[name].merge(lm)
    return ChannelStats(layers=merged, targets=targets, task_samples=settings.task_samples,
                        n_positions=settings.n_positions, seed=settings.seed,
                        n_images=sum(r.n_images for r in results.values()),
                        data={**source.describe(), "shards": len(items),
                              "shard_data": shards.shard_data_note(shared)},
                        taps=results[0].taps, kinds=analysed_kinds(chosen))


def _shard_unit(item, model_bytes: bytes, shared, job) -> ChannelStats:
    """One shard's statistics (runs on a worker): the same pass on its batches."""
    import onnx

    from ..graph import analyze_structure

    model = onnx.load_from_string(model_bytes)
    structure = analyze_structure(model, head=job.head, features=job.features)
    runner = make_stats_runner(model, structure, job.settings, providers=job.providers,
                               threads=job.threads)
    source = shards.shard_source(item, model, shared, job)
    return collect_channel_moments(model, structure, source, job.settings, runner=runner)
