"""One data role of a command as a record: where the samples are and how to read them.

Only the standard library at import time (the CLI builds requests before any numerical
work); :meth:`DataRequest.open` imports the readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DataRequest:
    """One data role: a source and how to read it (the arguments of ``open_data``).

    ``source``: an .npy/.npz path, an image folder, a loader script ``file.py[:fn]``,
    in-memory arrays ({input name: array}, with ``labels`` optional) or a reader.
    ``labels``: a labels file or array when the source has none. ``limit``: at most this
    many samples, a seeded random subset (``seed``). ``batch_size``: samples per run.
    ``cast``: data of another numeric dtype than the model input are cast as they are (no
    scaling; integers into a float input warn with their value range); without it such a
    mismatch is a one-line DataError.
    """

    source: Any
    labels: Any = None
    limit: int | None = None
    seed: int = 0
    batch_size: int = 64
    cast: bool = False

    @classmethod
    def of(cls, value, **fields) -> DataRequest | None:
        """``value`` as a request: None stays None, a request is kept as given (``fields``
        ignored), anything else becomes ``DataRequest(value, **fields)``."""
        if value is None or isinstance(value, DataRequest):
            return value
        return cls(value, **fields)

    def open(self, specs, *, classes: int | None = None, progress: bool = False):
        """The validated :class:`~onnxdiag.data.source.DataSource` for a model's inputs
        ``specs``; with ``classes`` (the model's class count) its labels are checked to lie
        in ``[0, classes)`` before any work (streams: as each batch is read)."""
        from ..data.source import open_data

        source = open_data(self.source, specs, labels=self.labels, limit=self.limit,
                           seed=self.seed, batch_size=self.batch_size, progress=progress,
                           cast=self.cast)
        if classes and source.has_labels:
            from .labels import check_label_range

            check_label_range(source, classes)
        return source

    @property
    def by_path(self) -> bool:
        """Whether another process can reopen it from its path alone (a data file or an
        image folder; not arrays, readers or loader scripts)."""
        return (isinstance(self.source, (str, Path))
                and not str(self.source).split(":")[0].endswith(".py")
                and (self.labels is None or isinstance(self.labels, (str, Path))))

    def in_memory(self, source) -> DataRequest:
        """The same request with its samples read from the opened ``source`` into arrays
        (in order, labels included, already cast), to ship to workers that cannot read the
        path."""
        arrays, labels = source.to_arrays()
        return DataRequest(arrays, labels=labels, seed=self.seed,
                           batch_size=source.batch_size)

    def params(self) -> dict:
        """JSON builtins for a report's parameters (arrays described, not copied)."""
        def show(v):
            return v if v is None or isinstance(v, (str, int, float, Path)) else \
                f"<{type(v).__name__}>"
        return {"source": show(self.source), "labels": show(self.labels),
                "limit": self.limit, "seed": self.seed, "batch_size": self.batch_size,
                "cast": self.cast}
