"""Reading the raw sources: .npy/.npz files, label files, loader scripts, streams.

Everything here turns a user-supplied thing into arrays or a :class:`Stream` of
validated pieces (see :mod:`onnxdiag.feeds`); a user-fixable failure is a
one-line :class:`DataError`, chained to the original exception for ``--debug``.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError, OnnxDiagError
from .feeds import Piece, cast_notes, check_feeds, check_meta, check_names, format_inputs

__all__ = [
    "Stream",
    "as_labels",
    "concat_feed_dicts",
    "load_labels",
    "open_loader_script",
    "open_path",
]

_HINT = "pass an .npz/.npy file, an image folder or a loader script 'file.py[:function]'"


def open_path(path: Path, inputs: Sequence) -> tuple[dict[str, np.ndarray], str]:
    """Arrays of a ``.npz`` (by key) or ``.npy`` (one-input model) file, and the kind.

    ``.npy`` is memory-mapped; ``.npz`` members are read whole.  Pickles are refused.
    """
    if not path.exists():
        raise DataError(f"Data path '{path}' does not exist; {_HINT}.")
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".npy"):
        raise DataError(f"Data file '{path}' has an unsupported type '{suffix}'; {_HINT}.")
    try:
        if suffix == ".npy":
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            with np.load(path, allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
    except Exception as exc:
        raise DataError(
            f"Cannot read '{path}' as a NumPy {suffix} file ({type(exc).__name__}: {exc}); "
            f"re-save it with numpy.{'save' if suffix == '.npy' else 'savez'}."
        ) from exc
    if suffix == ".npz":
        return arrays, "npz"
    if len(inputs) != 1:
        raise DataError(
            f"'{path}' holds one array, but the model's inputs are: {format_inputs(inputs)}; "
            "save an .npz keyed by input name instead."
        )
    return {inputs[0].name: array}, "npy"


def load_labels(path: str | Path) -> np.ndarray:
    """Integer class labels ``(n,)`` int64 from ``.npy``, or ``.txt``/``.csv`` text.

    Text: whitespace- or comma-separated, one column; a non-numeric first line is a
    header.  Raises DataError if missing, unreadable, or not class indices >= 0.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"Labels file '{path}' does not exist; pass a .npy, .txt or .csv file.")
    if path.suffix.lower() == ".npy":
        try:
            values = np.load(path, allow_pickle=False)
        except Exception as exc:
            raise DataError(
                f"Cannot read labels '{path}' ({type(exc).__name__}: {exc}); "
                "re-save them with numpy.save."
            ) from exc
        return as_labels(values, f"labels file '{path}'")
    return as_labels(_read_label_text(path), f"labels file '{path}'")


def _read_label_text(path: Path) -> list[float]:
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"Cannot read labels '{path}' ({exc}); pass a text file.") from exc
    lines = [line for line in lines if line]
    values: list[float] = []
    for number, line in enumerate(lines, start=1):
        tokens = line.replace(",", " ").split()
        if len(tokens) != 1 and path.suffix.lower() == ".csv":
            raise DataError(
                f"Line {number} of labels '{path}' has {len(tokens)} columns; "
                "give one label per line."
            )
        try:
            values += [float(token) for token in tokens]
        except ValueError:
            if number == 1 and len(lines) > 1:
                continue  # a header line
            raise DataError(
                f"Label {line!r} on line {number} of '{path}' is not a number; labels must "
                "be class indices 0..K-1."
            ) from None
    return values


def as_labels(values: Any, where: str) -> np.ndarray:
    """``values`` as ``(n,)`` int64 class indices; DataError naming the first bad one."""
    array = np.asarray(values)
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise DataError(
            f"Labels from {where} have shape {array.shape}; give one class index per sample "
            "(shape (n,); for one-hot labels pass argmax over axis 1)."
        )
    if array.dtype.kind not in "iuf":
        raise DataError(
            f"Labels from {where} have dtype {array.dtype}; give integer class indices 0..K-1."
        )
    bad = ~np.isfinite(array) | (array != np.round(array)) if array.dtype.kind == "f" else None
    if bad is not None and bad.any():
        i = int(np.argmax(bad))
        raise DataError(
            f"Label {array[i]} at sample {i} from {where} is not an integer; give integer "
            "class indices 0..K-1."
        )
    if array.size and array.min() < 0:
        i = int(np.argmax(array < 0))
        raise DataError(f"Label {array[i]} at sample {i} from {where} is negative; "
                        "give class indices 0..K-1.")
    return array.astype(np.int64)


def concat_feed_dicts(items: Sequence, description: str) -> dict[str, np.ndarray]:
    """A list of feed dicts joined along axis 0 into one dict (keys must agree)."""
    if not items:
        raise DataError(f"The {description} is empty; give at least one feed dict.")
    for number, item in enumerate(items):
        _require_dict(item, number, description)
        if set(item) != set(items[0]):
            raise DataError(
                f"Item {number} of the {description} has keys {sorted(item)}, but item 0 has "
                f"{sorted(items[0])}; give every feed dict the same keys."
            )
    try:
        return {key: np.concatenate([np.atleast_1d(np.asarray(d[key])) for d in items])
                for key in items[0]}
    except ValueError as exc:
        raise DataError(
            f"Cannot join the items of the {description} ({exc}); give every item the same "
            "shape apart from the batch axis."
        ) from exc


def _require_dict(item: Any, number: int, description: str) -> None:
    if not isinstance(item, Mapping):
        raise DataError(
            f"Item {number} of the {description} is a {type(item).__name__}, not a dict "
            "{input name: array}; yield or return feed dicts."
        )


def open_loader_script(text: str) -> tuple[Any, str]:
    """Run ``file.py[:function]`` (function defaults to ``load_data``).

    Returns the function's result (dict, list or a :class:`Stream` that calls the
    function again to re-read) and a description for messages.
    """
    path_text, _, name = text.rpartition(":") if not text.endswith(".py") else (text, "", "")
    name = name or "load_data"
    path = Path(path_text)
    description = f"loader script '{path}:{name}'"
    if not path.is_file():
        raise DataError(f"Loader script '{path}' does not exist; {_HINT}.")
    module = _import_script(path)
    function = getattr(module, name, None)
    if not callable(function):
        found = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise DataError(
            f"Loader script '{path}' has no function '{name}'; it defines: "
            f"{', '.join(map(repr, found)) or 'no functions'}. Name one as '{path}:function'."
        )
    result = _call(function, description)
    if isinstance(result, (Mapping, list, tuple, np.ndarray)):
        return result, description
    if isinstance(result, (str, bytes)) or not hasattr(result, "__iter__"):
        raise DataError(
            f"The {description} returned a {type(result).__name__}, not a dict of arrays or an "
            "iterable of feed dicts; return or yield {input name: array} dicts."
        )
    first = [result]

    def open_iter() -> Iterator:
        return iter(first.pop() if first else _call(function, description))

    return Stream(open_iter, description, reiterable=True), description


def _import_script(path: Path):
    """Import ``path`` as a module; its folder is on sys.path meanwhile (sibling imports)."""
    spec = importlib.util.spec_from_file_location(f"onnxdiag_loader_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise DataError(
            f"Loader script '{path}' failed to import ({type(exc).__name__}: {exc}); "
            "fix the script (--debug shows the traceback)."
        ) from exc
    finally:
        sys.path.remove(folder)
    return module


def _call(function: Callable, description: str) -> Any:
    try:
        return function()
    except OnnxDiagError:
        raise
    except Exception as exc:
        raise DataError(
            f"The {description} raised {type(exc).__name__}: {exc}; fix it "
            "(--debug shows the traceback)."
        ) from exc


class Stream:
    """Feed dicts read one at a time and validated as they come.

    ``open_iter()`` returns a fresh iterator of feed dicts; a stream that is not
    ``reiterable`` can be read once.  The first item is read and checked when the
    source is opened (:meth:`peek`), so obvious mistakes surface before any work.
    """

    def __init__(self, open_iter: Callable[[], Iterator], description: str, reiterable: bool):
        self._open_iter, self.description, self.reiterable = open_iter, description, reiterable
        self._labels: np.ndarray | None = None
        self._peeked: tuple[Iterator, Piece] | None = None
        self._reads = 0
        self._has_labels = False
        self.n_seen: int | None = None  # samples in the stream, once read to the end
        self.cast = False  # accept any numeric dtype (open_data's ``cast``)
        self.notes: list[str] = []  # integer casts into float inputs, from the first item

    @classmethod
    def from_object(cls, obj: Any, description: str) -> Stream:
        """A stream over a reader (``get_next()``; ``rewind()`` makes it re-readable),
        an iterator (one-shot) or an iterable (re-readable)."""
        if isinstance(obj, Stream):
            return obj
        if callable(getattr(obj, "get_next", None)):
            rewind = getattr(obj, "rewind", None)
            reads = itertools.count()

            def open_reader() -> Iterator:
                if next(reads) and callable(rewind):
                    rewind()
                return iter(obj.get_next, None)

            name = f"{description} ({type(obj).__name__})"
            return cls(open_reader, name, reiterable=callable(rewind))
        if isinstance(obj, (str, bytes)) or not hasattr(obj, "__iter__"):
            raise DataError(
                f"Data of type {type(obj).__name__} is not supported; {_HINT}, a dict of "
                "arrays, an iterable of feed dicts or a CalibrationDataReader."
            )
        one_shot = iter(obj) is obj
        return cls(lambda: iter(obj), f"{description} ({type(obj).__name__})", not one_shot)

    def set_labels(self, labels: np.ndarray | None) -> None:
        """External labels ``(n,)`` for the whole stream, matched by sample index."""
        self._labels = labels

    def peek(self, inputs: Sequence) -> bool:
        """Read and check the first item; returns whether the stream has labels."""
        iterator = self._start()
        for number, item in _pull(iterator, self.description, 0):
            self._has_labels = self._labels is not None or "labels" in item
            self._peeked = iterator, self._check(item, number, 0, inputs)
            return self._has_labels
        raise DataError(f"The {self.description} yielded no samples; check it.")

    def pieces(self, inputs: Sequence) -> Iterator[Piece]:
        """Validated pieces in order; DataError now if a one-shot stream was read."""
        if self._peeked is not None:
            (iterator, first), self._peeked = self._peeked, None
        else:
            iterator, first = self._start(), None
        return self._generate(iterator, first, inputs)

    def _start(self) -> Iterator:
        if self._reads and not self.reiterable:
            raise DataError(
                f"The {self.description} is a one-shot stream and was already read; pass a "
                "file or a list of feed dicts, or give the reader a rewind() method."
            )
        self._reads += 1
        return self._open_iter()

    def _generate(self, iterator: Iterator, first: Piece | None, inputs) -> Iterator[Piece]:
        position, start = 0, 0
        if first is not None:
            yield first
            position, start = len(first[2]), 1
        for number, item in _pull(iterator, self.description, start):
            piece = self._check(item, number, position, inputs)
            position += len(piece[2])
            yield piece
        if position == 0:
            raise DataError(f"The {self.description} yielded no samples; check it.")
        if self._labels is not None and self._labels.size != position:
            raise DataError(
                f"There are {self._labels.size} labels for the {position} samples of the "
                f"{self.description}; give exactly one label per sample."
            )
        self.n_seen = position

    def _check(self, item: Any, number: int, position: int, inputs) -> Piece:
        _require_dict(item, number, self.description)
        where = f" (item {number} of the {self.description})"
        arrays = {k: np.asarray(v) for k, v in item.items()}
        own = arrays.pop("labels", None)
        check_names(arrays, inputs, "feed dict key", where)
        m = check_meta(arrays, inputs, where, self.cast)
        if number == 0 and self.cast:
            self.notes = cast_notes(arrays, inputs, where=f" ({self.description}, first item)")
        indices = np.arange(position, position + m, dtype=np.int64)
        feeds = check_feeds(arrays, inputs, indices, where=where, cast=self.cast)
        return feeds, self._item_labels(own, number, indices, where), indices

    def _item_labels(self, own, number: int, indices: np.ndarray, where: str):
        if own is not None and self._labels is not None:
            raise DataError(f"Labels are given twice{where}: by its 'labels' key and by the "
                            "labels argument; drop one.")
        if (own is not None or self._labels is not None) != self._has_labels and number:
            raise DataError(f"Item {number} of the {self.description} "
                            f"{'lacks' if self._has_labels else 'has'} a 'labels' key, unlike "
                            "item 0; give labels with every item or with none.")
        if own is not None:
            labels = as_labels(own, f"the 'labels' key{where}")
            if labels.size != indices.size:
                raise DataError(f"There are {labels.size} labels for {indices.size} samples"
                                f"{where}; give one label per sample.")
            return labels
        if self._labels is None:
            return None
        if self._labels.size < indices[-1] + 1:
            raise DataError(
                f"There are only {self._labels.size} labels, but the {self.description} has "
                f"sample {int(indices[-1])}; give exactly one label per sample."
            )
        return self._labels[indices]


def _pull(iterator: Iterator, description: str, start: int) -> Iterator[tuple[int, Any]]:
    """(item number, item) pairs; an exception from user code becomes a DataError."""
    for number in itertools.count(start):
        try:
            item = next(iterator)
        except StopIteration:
            return
        except OnnxDiagError:
            raise
        except Exception as exc:
            raise DataError(
                f"The {description} raised {type(exc).__name__}: {exc} while producing item "
                f"{number}; fix it (--debug shows the traceback)."
            ) from exc
        yield number, item
