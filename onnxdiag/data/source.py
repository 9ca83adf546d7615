"""Every data source as a :class:`DataSource` of validated batches of ``{input name: array}``.

``open_data`` accepts .npy / .npz files, image folders, loader scripts, in-memory arrays
and ONNX Runtime calibration readers; it checks names, shapes, dtypes, values and labels
against the model's inputs before any work.  Labels are checked against a model's class
count with :func:`~onnxdiag.data.labels.check_label_range`."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from ..runtime.progress import progress
from .feeds import (
    cast_feeds,
    cast_notes,
    check_feeds,
    check_meta,
    check_names,
    check_values,
    effective_batch_size,
    fixed_batch,
    format_inputs,
    rebatch,
    select_first,
    select_indices,
    select_smallest_keys,
)
from .images import ImageOptions, list_images, load_images, resolve_options
from .labels import (
    check_batch_labels,
    check_label_count,
    check_label_range,
    merge_labels,
    read_labels_arg,
    source_name,
)
from .readers import Stream, concat_feed_dicts, load_labels, open_loader_script, open_path

__all__ = [
    "Batch",
    "DataSource",
    "DataWarning",
    "ImageOptions",
    "InputSpec",
    "check_label_range",
    "load_labels",
    "open_data",
    "progress",
]


class DataWarning(UserWarning):
    """Data were used in a way that may not be what the user meant (e.g. integers cast
    into a float input with ``cast=True``); the same text is in ``describe()["notes"]``."""


@dataclass(frozen=True)
class InputSpec:
    """A model input: ``shape`` has None for a dynamic dim; axis 0 is the batch axis."""

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class Batch:
    """One batch: ``feeds`` {input name: (n, ...) array}, ``labels`` (n,) int64 or None,
    ``indices`` (n,) int64 positions of the samples in the source order."""

    feeds: dict[str, np.ndarray]
    labels: np.ndarray | None
    indices: np.ndarray

    def __len__(self) -> int:
        return int(self.indices.size)


class DataSource:
    """Validated data, read batch by batch.  Build with :func:`open_data`.

    Attributes: ``kind`` ("npy", "npz", "arrays", "image_folder", "loader_script",
    "reader", "iterable"), ``path`` (str or None), ``class_names`` (tuple or None),
    ``limit``, ``seed``, ``batch_size`` (the effective one), ``cast`` (integers may feed
    float inputs), ``notes`` (what the user should know, e.g. such casts), ``n_classes``
    (set by :meth:`require_classes`: every batch's labels are checked against it).
    """

    cast = False
    n_classes: int | None = None
    _labels: np.ndarray | None = None  # every source sample's label, when in memory
    _label_where = ""
    _notes: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        kind: str,
        path: str | None,
        inputs: Sequence[InputSpec],
        batch_size: int,
        limit: int | None,
        seed: int | None,
        show_progress: bool,
        n_source: int | None,
        has_labels: bool,
        class_names: tuple[str, ...] | None = None,
        fetch: Callable[[np.ndarray], tuple[dict, np.ndarray | None]] | None = None,
        stream: Any = None,
        extra: dict | None = None,
    ) -> None:
        self.kind, self.path, self.inputs = kind, path, tuple(inputs)
        self.batch_size, self.limit, self.seed = batch_size, limit, seed
        self.class_names, self._extra = class_names, dict(extra or {})
        self._show_progress = show_progress
        self._n_source, self._has_labels = n_source, has_labels
        self._fetch, self._stream = fetch, stream
        self._indices = None if n_source is None else select_indices(n_source, limit, seed)

    @property
    def n_samples(self) -> int | None:
        """Number of samples ``batches()`` yields; None for a stream not yet read."""
        return None if self._indices is None else int(self._indices.size)

    @property
    def has_labels(self) -> bool:
        return self._has_labels

    @property
    def indices(self) -> np.ndarray | None:
        """(n_samples,) int64 selected source positions, sorted; None until known."""
        return self._indices

    @property
    def selected_labels(self) -> np.ndarray | None:
        """(n_samples,) labels of the selected samples when held in memory, else None."""
        if self._labels is None or self._indices is None:
            return None
        return self._labels[self._indices]

    @property
    def notes(self) -> tuple[str, ...]:
        return self._notes

    def require_classes(self, n_classes: int, where: str | None = None) -> None:
        """Check every batch's labels against ``n_classes`` from now on (DataError on the
        first outside [0, n_classes)); see :func:`~onnxdiag.data.labels.check_label_range`,
        which also checks labels held in memory at once."""
        self.n_classes, self._label_where = int(n_classes), where or source_name(self)

    @property
    def random_access(self) -> bool:
        """Whether any batch can be read by position (arrays and image folders; not
        streams), as :meth:`batch_range` needs."""
        return self._fetch is not None and self._indices is not None

    def batch_range(self, start: int, stop: int) -> Iterator[Batch]:
        """Batches ``[start, stop)`` of :meth:`batches` (the same members), read directly;
        for a :attr:`random_access` source only."""
        if not self.random_access:
            raise DataError(f"{self.kind} data cannot be read by batch position; "
                                "read it once with batches().")
        for b in range(start, stop):
            idx = self._indices[b * self.batch_size:(b + 1) * self.batch_size]
            feeds, labels = self._fetch(idx)
            yield Batch(feeds, labels, idx)

    def batches(self) -> Iterator[Batch]:
        """Batches of at most ``batch_size`` samples, in source order."""
        batches = self._indexed_batches() if self._fetch else self._stream_batches()
        if self.n_classes is not None:
            batches = self._label_checked(batches)
        if not self._show_progress:
            return batches
        label = f"Reading {self.kind}" + (f" '{self.path}'" if self.path else "")
        return progress(batches, self.n_samples, label, step=len)

    def _label_checked(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        for batch in batches:
            check_batch_labels(batch.labels, batch.indices, self.n_classes, self._label_where)
            yield batch

    def _indexed_batches(self) -> Iterator[Batch]:
        return self.batch_range(0, -(-self._indices.size // self.batch_size))

    def _stream_batches(self) -> Iterator[Batch]:
        pieces = self._stream.pieces(self.inputs)  # raises now if already read
        if self.limit is not None and self.seed is not None:
            pieces = select_smallest_keys(pieces, self.limit, self.seed)
        elif self.limit is not None:
            pieces = select_first(pieces, self.limit)
        return self._stream_rebatch(pieces)

    def _stream_rebatch(self, pieces) -> Iterator[Batch]:
        fixed = any(fixed_batch(s) for s in self.inputs)
        seen = []
        for feeds, labels, indices in rebatch(pieces, self.batch_size, fixed):
            seen.append(indices)
            yield Batch(feeds, labels, indices)
        self._indices = np.concatenate(seen)
        self._n_source = self._stream.n_seen

    def to_arrays(self) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """Every selected sample in memory, in order: ({input: array}, labels or None)
        (to ship a probe or evaluation set once to remote workers)."""
        feeds, labels = {}, []
        for batch in self.batches():
            for k, v in batch.feeds.items():
                feeds.setdefault(k, []).append(v)
            if batch.labels is not None:
                labels.append(batch.labels)
        arrays = {k: np.concatenate(v) for k, v in feeds.items()}
        return arrays, (np.concatenate(labels) if labels else None)

    def describe(self) -> dict:
        """Builtins for report metadata: what was read and which samples."""
        subset = self.limit is not None and self._indices is not None
        return {
            "kind": self.kind,
            "path": self.path,
            "n_source": self._n_source,
            "n_samples": self.n_samples,
            "limit": self.limit,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "has_labels": self.has_labels,
            "indices": self._indices.tolist() if subset else None,
            "class_names": list(self.class_names) if self.class_names else None,
            "cast": self.cast,
            "notes": list(self._notes),
            **self._extra,
        }


def open_data(
    source: Any,
    inputs: Sequence[InputSpec],
    *,
    labels: str | Path | np.ndarray | Sequence[int] | None = None,
    limit: int | None = None,
    seed: int | None = None,
    batch_size: int = 64,
    image_options: ImageOptions | None = None,
    progress: bool = False,
    cast: bool = False,
) -> DataSource:
    """Open ``source`` for the model inputs ``inputs`` (see the module docstring).

    Args:
        labels: labels (n,) for the whole source: a .npy/.txt/.csv path or an array;
            not allowed when the source brings its own (npz key ``labels``, class
            sub-folders, a ``labels`` key in feed dicts).
        limit: read only this many samples (first ones, or a seeded random subset).
        seed: makes ``limit`` a random subset; recorded in ``describe()``.
        batch_size: maximum batch size; a fixed batch dim in the model overrides it.
        progress: show a progress bar on a terminal.
        cast: accept any numeric dtype and cast it to the model's (**our default** False:
            integers or booleans into a float input are a DataError, as they would reach
            the model unscaled).  Each integer input cast into a float one gives a
            :class:`DataWarning` naming its value range (also in ``describe()["notes"]``).

    Raises DataError for every problem listed in METHODS §B1's data contract, before
    returning when the data are in memory.  Never modifies ``source``.  Labels are
    checked against the model's classes by :func:`check_label_range`.
    """
    inputs = tuple(inputs)
    if not inputs:
        raise ValueError("the model has no inputs")
    if limit is not None and limit < 1:
        raise DataError(f"limit must be at least 1, got {limit}; pass a positive --limit.")
    common = dict(
        inputs=inputs, batch_size=effective_batch_size(inputs, batch_size),
        limit=limit, seed=seed, show_progress=progress,
    )
    extra_labels = None if labels is None else read_labels_arg(labels)
    if isinstance(source, (str, Path)):
        if _is_script(source):
            loaded, where = open_loader_script(str(source))
            return _open_object(loaded, "loader_script", str(source), extra_labels, common,
                                where, cast)
        path = Path(source)
        if path.is_dir():
            return _open_images(path, extra_labels, image_options, common)
        arrays, kind = open_path(path, inputs)
        return _open_arrays(arrays, kind, str(path), extra_labels, common, cast)
    kind = "reader" if callable(getattr(source, "get_next", None)) else None
    return _open_object(source, kind, None, extra_labels, common, None, cast)


def _is_script(source: str | Path) -> bool:
    text = str(source)
    return text.endswith(".py") or (":" in text and text.rsplit(":", 1)[0].endswith(".py"))


def _open_object(obj, kind, path, extra_labels, common, where, cast) -> DataSource:
    """A dict of arrays, a list of feed dicts, a reader or any iterable of feed dicts."""
    where = where or {"reader": "calibration data reader"}.get(kind, "data iterable")
    if isinstance(obj, np.ndarray):
        obj = _single_input_dict(obj, common["inputs"], "array")
    if isinstance(obj, Mapping):
        return _open_arrays(dict(obj), kind or "arrays", path, extra_labels, common, cast)
    if isinstance(obj, (list, tuple)):
        arrays = concat_feed_dicts(obj, where)
        return _open_arrays(arrays, kind or "iterable", path, extra_labels, common, cast)
    stream = Stream.from_object(obj, where)
    stream.set_labels(extra_labels)
    stream.cast = cast
    source = DataSource(
        kind=kind or "iterable", path=path, n_source=None,
        has_labels=stream.peek(common["inputs"]), stream=stream, **common,
    )
    return _noted(source, cast, stream.notes)


def _noted(source: DataSource, cast: bool, notes) -> DataSource:
    """Record ``cast`` and the cast ``notes`` on ``source``; each note is also a warning."""
    source.cast, source._notes = bool(cast), tuple(notes)
    for note in notes:
        warnings.warn(note, DataWarning, stacklevel=4)
    return source


def _single_input_dict(array: np.ndarray, inputs, what: str) -> dict:
    if len(inputs) != 1:
        raise DataError(
            f"A single {what} can feed only a one-input model, but the model's inputs are: "
            f"{format_inputs(inputs)}; pass an .npz or dict keyed by input name."
        )
    return {inputs[0].name: array}


def _open_arrays(arrays: dict, kind, path, extra_labels, common, cast) -> DataSource:
    """In-memory (or memory-mapped) arrays: validated eagerly over the selection."""
    inputs = common["inputs"]
    arrays = dict(arrays)
    own = arrays.pop("labels", None)
    labels = merge_labels(own, extra_labels, f"the {kind} key 'labels'")
    arrays = {k: np.asarray(v) if not isinstance(v, np.ndarray) else v for k, v in arrays.items()}
    what = {"npz": "npz key", "npy": "array"}.get(kind, "dict key")
    check_names(arrays, inputs, what)
    n = check_meta(arrays, inputs, cast=cast)
    check_label_count(labels, n, f"'{path}'" if path else f"the {kind} data")
    source = DataSource(
        kind=kind, path=path, n_source=n, has_labels=labels is not None,
        fetch=lambda idx: (cast_feeds(arrays, inputs, idx),
                           None if labels is None else labels[idx]),
        **common,
    )
    source._labels = labels
    _check_fixed_batch(source)
    check_values(arrays, inputs, source.indices)
    return _noted(source, cast, cast_notes(arrays, inputs, source.indices) if cast else ())


def _open_images(folder: Path, extra_labels, options, common) -> DataSource:
    inputs = common["inputs"]
    if len(inputs) != 1:
        raise DataError(
            f"An image folder can feed only a one-input model, but the model's inputs are: "
            f"{format_inputs(inputs)}; use an .npz file or a loader script."
        )
    spec = inputs[0]
    resolved = resolve_options(spec.shape, spec.dtype, options, spec.name)
    paths, own, class_names = list_images(folder, resolved)
    if not paths:
        raise DataError(f"Image folder '{folder}' holds no images (looked for .png, .jpg, ...); "
                        "point to a folder of images or class sub-folders.")
    labels = merge_labels(own, extra_labels, "class sub-folders")
    check_label_count(labels, len(paths), f"'{folder}'")

    def fetch(idx: np.ndarray):
        batch = load_images([paths[i] for i in idx], idx, resolved, np.dtype(spec.dtype))
        feeds = check_feeds({spec.name: batch}, inputs, idx, where=f" (image folder '{folder}')")
        return feeds, None if labels is None else labels[idx]

    source = DataSource(
        kind="image_folder", path=str(folder), n_source=len(paths), has_labels=labels is not None,
        class_names=class_names, fetch=fetch, extra={"image_options": resolved.to_dict()}, **common,
    )
    source._labels = labels
    _check_fixed_batch(source)
    return source


def _check_fixed_batch(source: DataSource) -> None:
    fixed = [s for s in source.inputs if fixed_batch(s)]
    n, size = source.n_samples, source.batch_size
    if fixed and n % size:
        raise DataError(
            f"Input '{fixed[0].name}' has a fixed batch size of {size}, but {n} samples were "
            f"selected; pass --limit {max(n - n % size, size)} (a multiple of {size}) or "
            "re-export the model with a dynamic batch dimension."
        )
