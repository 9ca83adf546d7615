"""Shards of the statistics pass: how the calibration set is cut, sent and checked.

:func:`~onnxdiag.channels.collect.collect_channel_moments_sharded` runs the pass on an
executor (issue 9): the calibration set is cut into shards of whole consecutive batches
(:func:`plan_shards`), each unit streams its shard into fresh LayerMoments and the
driver merges them in shard order (Moments.merge is exact up to float64 rounding).
Shards give the same statistics as one pass because

- a shard boundary is always a multiple of the (effective) batch size in the list of
  selected samples, so every batch has the same members as in the single pass, and the
  permutation control (seeded by (seed, the batch's first index)) draws the same
  permutation of the same images;
- the spatial positions are a counter-based hash of (seed, source index, draw), and
  every sample keeps its source index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.request import DataRequest
from ..errors import OnnxDiagError
from ..runtime.executor import UnitError, raise_failures, receive


@dataclass(frozen=True)
class ShardUnit:
    """One unit of the sharded pass: batches ``[start, stop)`` of the selected samples.

    ``batches``: the shard's data when the driver ships it (read once by the driver);
    None when the unit reads its batch range itself (from the path, or from the opened
    data when it runs in this process).
    """

    shard: int
    start: int
    stop: int
    batches: tuple | None = None


@dataclass(frozen=True)
class ShardJob:
    """What every unit needs besides its batches, shipped once: the pass's
    StatsSettings (targets resolved, layers named), the head node and features, the
    session's providers and threads, and what the driver's data hold (to check a
    worker's own reading against)."""

    settings: object
    head: str
    features: str | None
    providers: object
    threads: int | None
    batch_size: int
    n_samples: int
    has_labels: bool


def shard_data(executor, request: DataRequest, source, ship: bool | None):
    """What the units read their batch ranges from, sent once: the opened ``source``
    (units in this process) or ``request`` (every worker reopens its path and reads only
    its own batch range, on any executor: a large calibration set never passes through
    the driver, so on a multi-node Ray cluster the path must exist on every node); None
    when the driver ships each shard's batches instead (``ship``, a stream, or data that
    cannot be reopened from a path)."""
    if ship or not source.random_access:
        return None
    if executor.in_process:
        return source
    return request if request.by_path else None


def shard_data_note(shared) -> str:
    """Where the units' data came from, for the report."""
    if shared is None:
        return "shipped by the driver"
    if isinstance(shared, DataRequest):
        return "read by workers from the path"
    return "read in this process"


def plan_shards(source, by_range: bool, n_wanted: int) -> list[ShardUnit]:
    """Runs of whole consecutive batches of ``source``, ``n_wanted`` of them (at most one
    per batch); with ``by_range`` the units read their batches themselves, else each
    carries its batches (``source`` is read once, here)."""
    bs = source.batch_size
    if by_range:
        n_batches, batches = -(-source.n_samples // bs), None
    else:
        batches = list(source.batches())  # streams are read once, here
        n_batches = len(batches)
    if n_batches == 0:
        raise OnnxDiagError("The calibration data has no samples; pass a non-empty --data.")
    n_shards = max(1, min(n_wanted, n_batches))
    bounds = np.linspace(0, n_batches, n_shards + 1).round().astype(int)
    return [ShardUnit(k, int(a), int(b), None if batches is None else tuple(batches[a:b]))
            for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]


def run_shards(finished, items: list[ShardUnit], job: ShardJob) -> dict:
    """{shard: its ChannelStats} from ``finished`` (what ``executor.map`` yields); when
    any shard failed, stops naming the first failure's batches and samples."""
    results, errors = {}, []
    for k, stats, error in finished:
        if error is None and stats is not None:
            results[k] = stats
            continue
        it, bs = items[k], job.batch_size
        batches = f"batch {it.start}" if it.stop - it.start == 1 else \
            f"batches {it.start}-{it.stop - 1}"
        last = min(it.stop * bs, job.n_samples or it.stop * bs) - 1
        errors.append(UnitError(f"shard {k} ({batches}, selected samples "
                                f"{it.start * bs}-{last}): {error}",
                                type_name=getattr(error, "type_name", ""),
                                traceback=getattr(error, "traceback", ""),
                                user_error=getattr(error, "user_error", True)))
    raise_failures(errors, f"{len(errors)} of {len(items)} statistics shards failed, so the "
                           "merged statistics would miss their samples; first: {first}"
                           " — fix the cause (or run with --executor local) and rerun.")
    return results


def shard_source(item: ShardUnit, model, shared, job: ShardJob) -> ShardSource:
    """A unit's batches as a source (on the worker): shipped with the unit, or its
    batch range of the data ``shared`` sent (checked against the driver's)."""
    if item.batches is not None:
        return ShardSource(job.batch_size, job.has_labels, batches=item.batches)
    from ..model.io import get_input_specs

    source = receive(shared, get_input_specs(model))
    if (source.batch_size, source.n_samples, source.has_labels) != \
            (job.batch_size, job.n_samples, job.has_labels):
        raise OnnxDiagError("The data read by this worker differ from the driver's "
                            "(samples, batch size or labels); give every node the same "
                            "data file at the same path.")
    return ShardSource(job.batch_size, source.has_labels, source=source, start=item.start,
                       stop=item.stop)


class ShardSource:
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
