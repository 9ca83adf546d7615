"""Class labels against the data and the model: counts, merging, the model's class range.

A label outside the model's classes ``[0, n_classes)`` is a one-line :class:`DataError`
naming the value, the sample and the range, raised before any work when the labels are
in memory and as the batch is read for streams (:func:`check_label_range`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from .readers import as_labels, load_labels

__all__ = ["check_batch_labels", "check_label_count", "check_label_range", "merge_labels",
           "read_labels_arg"]


def check_label_range(labels: Any, n_classes: int, where: str | None = None):
    """Check labels against a model with ``n_classes`` outputs (classes 0..n_classes-1).

    Args:
        labels: a :class:`~onnxdiag.data.source.DataSource` (its labels of the selected
            samples are checked now when held in memory; every batch it yields from then
            on is checked as it is read, e.g. a stream's), or labels (n,) (any form
            :func:`as_labels` takes).
        n_classes: the model's class count (the head's output size).
        where: what the labels are, for the message (default: the source's path/kind).

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
            check_batch_labels(known, source.indices, n_classes, where)
        source.require_classes(n_classes, where)
        return source
    where = where or "the labels"
    array = as_labels(labels, where)
    check_batch_labels(array, np.arange(array.size), n_classes, where)
    return array


def check_batch_labels(labels: np.ndarray | None, indices: np.ndarray, n_classes: int,
                       where: str) -> None:
    """DataError for the first label of ``labels`` (n,) outside [0, n_classes); ``indices``
    (n,) are the samples' positions, named in the message."""
    if labels is None or not np.size(labels):
        return
    labels = np.asarray(labels)
    bad = (labels < 0) | (labels >= n_classes)
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
    """The ``labels`` argument of ``open_data``: a file path or an array."""
    if isinstance(labels, (str, Path)):
        return load_labels(labels)
    return as_labels(labels, "the labels argument")


def merge_labels(own, extra: np.ndarray | None, own_name: str) -> np.ndarray | None:
    """The source's own labels or the extra ones; DataError when both are given."""
    if own is not None and extra is not None:
        raise DataError(
            f"Labels are given twice: by {own_name} and by the labels argument; drop one."
        )
    if own is not None:
        return as_labels(own, own_name)
    return extra


def check_label_count(labels: np.ndarray | None, n: int, where: str) -> None:
    """One label per sample."""
    if labels is not None and labels.size != n:
        raise DataError(
            f"There are {labels.size} labels for {n} samples in {where}; "
            "give exactly one label per sample."
        )
