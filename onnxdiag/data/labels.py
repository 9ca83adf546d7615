"""Class labels against the data and the model: counts, merging, the model's class range.

A label outside the model's classes ``[0, n_classes)`` is a one-line :class:`DataError`
naming the value, the sample and the range, raised before any work when the labels are
in memory and as the batch is read for streams (:func:`check_label_range`).

Labels are one class per sample, ``(n,)``, or **label maps**, one class per position,
``(n, *grid)`` (a segmentation mask ``(n, H, W)``, per-anchor targets ``(n, A)``;
docs/METHODS.md §A4): an npz ``labels`` key of that shape, a ``.npy`` labels file, or the
mask files of an image folder (:mod:`onnxdiag.data.images`).  In a label map the value
:data:`IGNORE_INDEX` (255, a parameter of the verbs that read maps) marks positions to
ignore; maps hold integers ≥ 0 and are kept in their own integer dtype (uint8 masks stay
uint8).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from .readers import as_labels, load_labels

__all__ = ["IGNORE_INDEX", "as_label_maps", "check_batch_labels", "check_label_count",
           "check_label_range", "is_label_map", "merge_labels", "read_labels_arg"]

#: Label-map value of positions that are ignored (docs/METHODS.md §A4; our default).
IGNORE_INDEX = 255


def is_label_map(labels) -> bool:
    """Whether ``labels`` hold one class per position: shape (n, *grid), not (n,) or (n, 1)."""
    shape = np.shape(labels)
    return len(shape) >= 2 and not (len(shape) == 2 and shape[1] == 1)


def as_label_maps(values: Any, where: str) -> np.ndarray:
    """``values`` as label maps (n, *grid) of integers ≥ 0 (integer dtypes are kept; float
    maps of whole numbers become int64); DataError naming the first bad value."""
    array = np.asarray(values)
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array) | (array != np.round(array))
        if bad.any():
            raise DataError(f"Label map value {array[np.unravel_index(np.argmax(bad), bad.shape)]}"
                            f" from {where} is not an integer; give integer class indices.")
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise DataError(f"Label maps from {where} have dtype {array.dtype}; give integer class "
                        f"indices 0..K-1 (and {IGNORE_INDEX} for ignored positions).")
    if array.size and array.min() < 0:
        at = tuple(int(i) for i in np.unravel_index(int(np.argmin(array)), array.shape))
        raise DataError(f"Label map value {int(array[at])} at sample {at[0]}, position "
                        f"{at[1:]} from {where} is negative; give class indices 0..K-1 and "
                        f"{IGNORE_INDEX} for ignored positions.")
    return array


def _as_any_labels(values: Any, where: str) -> np.ndarray:
    return as_label_maps(values, where) if is_label_map(values) else as_labels(values, where)


def check_label_range(labels: Any, n_classes: int, where: str | None = None, *,
                      ignore_index: int = IGNORE_INDEX):
    """Check labels against a model with ``n_classes`` outputs (classes 0..n_classes-1).

    Args:
        labels: a :class:`~onnxdiag.data.source.DataSource` (its labels of the selected
            samples are checked now when held in memory; every batch it yields from then
            on is checked as it is read, e.g. a stream's), or labels (n,) (any form
            :func:`as_labels` takes).
        n_classes: the model's class count (the head's output size).
        where: what the labels are, for the message (default: the source's path/kind).
        ignore_index: the label-map value of ignored positions (label maps only).

    Returns the source (for chaining) or the labels as an (n,) int64 array.

    Raises:
        DataError: a label outside [0, n_classes), naming the first one and its sample.
    """
    n_classes = int(n_classes)
    if n_classes < 1:
        raise ValueError(f"n_classes must be positive, got {n_classes}")
    if hasattr(labels, "batches"):  # a DataSource
        source = labels
        where = where or source_name(source)
        known = source.selected_labels
        if known is not None:
            check_batch_labels(known, source.indices, n_classes, where,
                               ignore_index=ignore_index)
        if known is None or not is_label_map(known):  # maps are always held in memory
            source.require_classes(n_classes, where)
        return source
    where = where or "the labels"
    array = _as_any_labels(labels, where)
    check_batch_labels(array, np.arange(len(array)), n_classes, where,
                       ignore_index=ignore_index)
    return array


def check_batch_labels(labels: np.ndarray | None, indices: np.ndarray, n_classes: int,
                       where: str, *, ignore_index: int = IGNORE_INDEX) -> None:
    """DataError for the first label of ``labels`` (n,) outside [0, n_classes); ``indices``
    (n,) are the samples' positions, named in the message.  Label maps (n, *grid) may
    also hold ``ignore_index``."""
    if labels is None or not np.size(labels):
        return
    labels = np.asarray(labels)
    bad = (labels < 0) | (labels >= n_classes)
    if is_label_map(labels):
        bad &= labels != ignore_index
        if bad.any():
            at = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
            raise DataError(
                f"Label {int(labels[at])} at sample {int(indices[at[0]])}, position {at[1:]} "
                f"of the label maps of {where} is outside the model's classes "
                f"0..{n_classes - 1} and is not the ignore index {ignore_index}; give maps "
                "of this model's classes (or pass the ignore index the maps use).")
        return
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(
            f"Label {int(labels[i])} at sample {int(indices[i])} of {where} is outside the "
            f"model's classes 0..{n_classes - 1} ({n_classes} outputs); give labels that "
            "index this model's outputs (are they, or the class sub-folders, for another "
            "model?)."
        )


def source_name(source) -> str:
    """How messages name a data source: its path, else its kind."""
    return f"'{source.path}'" if getattr(source, "path", None) else f"the {source.kind} data"


def read_labels_arg(labels: Any) -> np.ndarray:
    """The ``labels`` argument of ``open_data``: a file path or an array (a ``.npy`` file or
    an array of shape (n, *grid) holds label maps)."""
    if isinstance(labels, (str, Path)):
        if str(labels).lower().endswith(".npy") and Path(labels).is_file():
            try:
                values = np.load(labels, mmap_mode="r", allow_pickle=False)
            except Exception:  # noqa: BLE001 - load_labels says what is wrong with the file
                return load_labels(labels)
            if is_label_map(values):
                return as_label_maps(np.asarray(values), f"labels file '{labels}'")
        return load_labels(labels)
    return _as_any_labels(labels, "the labels argument")


def merge_labels(own, extra: np.ndarray | None, own_name: str) -> np.ndarray | None:
    """The source's own labels or the extra ones; DataError when both are given."""
    if own is not None and extra is not None:
        raise DataError(
            f"Labels are given twice: by {own_name} and by the labels argument; drop one."
        )
    if own is not None:
        return _as_any_labels(own, own_name)
    return extra


def check_label_count(labels: np.ndarray | None, n: int, where: str) -> None:
    """One label (or one label map) per sample."""
    if labels is not None and is_label_map(labels) and labels.shape[0] != n:
        raise DataError(f"There are {labels.shape[0]} label maps {labels.shape[1:]} for {n} "
                        f"samples in {where}; give exactly one label map per sample.")
    if labels is not None and not is_label_map(labels) and labels.size != n:
        raise DataError(
            f"There are {labels.size} labels for {n} samples in {where}; "
            "give exactly one label per sample."
        )
