"""Feed dicts against the model's inputs: validate, cast, select, rebatch.

A *piece* is ``(feeds, labels, indices)``: ``feeds`` {input name: (m, ...) array},
``labels`` (m,) int64 or None, ``indices`` (m,) int64 sample positions in the
source order.  Streams are validated piece by piece; messages name the sample.
Model input specs are duck-typed: ``.name``, ``.shape`` (None = dynamic), ``.dtype``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import DataError

Piece = tuple  # (dict[str, np.ndarray], np.ndarray | None, np.ndarray)

_CHUNK = 4096  # rows per value scan of in-memory arrays
_CHUNK_BYTES = 64 << 20  # and at most this many bytes per scan (one row at least)


def format_spec(spec) -> str:
    """``'input' (float32 [N,1,28,28])``."""
    dims = [_fixed(d) for d in spec.shape]
    shown = ",".join(("N" if i == 0 else "?") if d is None else str(d) for i, d in enumerate(dims))
    return f"'{spec.name}' ({np.dtype(spec.dtype)} [{shown}])"


def format_inputs(inputs: Sequence, k: int = 5) -> str:
    """The inputs as text, truncated to the first ``k``."""
    shown = ", ".join(format_spec(s) for s in inputs[:k])
    return shown if len(inputs) <= k else f"{shown} (first {k} of {len(inputs)})"


def _fixed(dim) -> int | None:
    return dim if isinstance(dim, (int, np.integer)) and dim > 0 else None


def _names(keys: Iterable[str], k: int = 5) -> str:
    keys = list(keys)
    shown = ", ".join(repr(key) for key in keys[:k]) or "nothing"
    return shown if len(keys) <= k else f"{shown} (first {k} of {len(keys)})"


def effective_batch_size(inputs: Sequence, batch_size: int) -> int:
    """``batch_size``, or the model's fixed batch dim when it has one."""
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}; pass --batch-size >= 1.")
    fixed = {fixed_batch(s) for s in inputs} - {None}
    if len(fixed) > 1:
        raise DataError(
            f"The model's inputs have different fixed batch sizes {sorted(fixed)}: "
            f"{format_inputs(inputs)}; re-export the model with one batch size."
        )
    return fixed.pop() if fixed else batch_size


def fixed_batch(spec) -> int | None:
    """The spec's fixed batch dim (axis 0), or None when it is dynamic."""
    dim = spec.shape[0] if spec.shape else None
    return int(dim) if isinstance(dim, (int, np.integer)) and dim > 0 else None


def check_names(arrays: Mapping, inputs: Sequence, what: str, where: str = "") -> None:
    """Every data key is a model input and every model input has data."""
    names = [s.name for s in inputs]
    for key in arrays:
        if key not in names:
            raise DataError(
                f"Data input '{key}'{where} is not an input of the model; the model's inputs "
                f"are: {format_inputs(inputs)}. Rename the {what} to the model's input name."
            )
    for spec in inputs:
        if spec.name not in arrays:
            raise DataError(
                f"Model input {format_spec(spec)} is missing from the data{where}, which has: "
                f"{_names(arrays)}. Add a {what} '{spec.name}'."
            )


def check_meta(arrays: Mapping[str, np.ndarray], inputs: Sequence, where: str = "",
               cast: bool = False) -> int:
    """Sample counts agree, ranks, fixed dims (axis 0 excepted) and dtypes fit; returns n.

    ``cast``: accept any numeric dtype (see :func:`check_dtype`)."""
    counts = {}
    for spec in inputs:
        array = arrays[spec.name]
        if array.ndim == 0:
            raise DataError(
                f"Data input '{spec.name}'{where} is a scalar, but the model expects "
                f"{format_spec(spec)}; give arrays with a batch axis first."
            )
        counts[spec.name] = array.shape[0]
    if len(set(counts.values())) > 1:
        raise DataError(
            f"Data inputs{where} have different numbers of samples: "
            + ", ".join(f"'{k}' {v}" for k, v in counts.items())
            + "; give every input one row per sample."
        )
    n = next(iter(counts.values()))
    if n == 0:
        raise DataError(f"The data{where} are empty (0 samples); pass at least one sample.")
    for spec in inputs:
        _check_shape(spec, arrays[spec.name].shape, where)
        check_dtype(spec, arrays[spec.name].dtype, where, cast)
    return n


def _check_shape(spec, shape: tuple, where: str) -> None:
    if len(shape) != len(spec.shape):
        raise DataError(
            f"Data input '{spec.name}'{where} has shape {shape} (rank {len(shape)}), but the "
            f"model expects rank {len(spec.shape)}: {format_spec(spec)}; add or remove axes "
            "to match (axis 0 is the batch)."
        )
    for axis in range(1, len(shape)):
        expected = _fixed(spec.shape[axis])
        if expected is not None and shape[axis] != expected:
            raise DataError(
                f"Data input '{spec.name}'{where} has shape {shape}: axis {axis} is "
                f"{shape[axis]}, but the model expects {expected} ({format_spec(spec)}); "
                "convert the data to the model's input shape."
            )


def check_dtype(spec, dtype: np.dtype, where: str = "", cast: bool = False) -> None:
    """The data's dtype may feed ``spec``: the same kind (float64 → float32, int64 → int32
    within range, checked later), or any numeric dtype when ``cast``.  Integers or
    booleans into a float input are refused unless ``cast``: they would reach the model
    unscaled (uint8 pixels 0..255 where it expects its preprocessing)."""
    target, source = np.dtype(spec.dtype), np.dtype(dtype)
    allowed = {"f": "f", "i": "iub", "u": "iub", "b": "b"}.get(target.kind, target.kind)
    if source.kind in allowed or (cast and source.kind in "fiub" and target.kind in "fiub"):
        return
    hint = "pass numeric arrays"
    if source.kind in "iub" and target.kind == "f":
        hint = ("the integers would reach the model unscaled; apply the model's "
                f"preprocessing (e.g. x.astype('{target}') / 255), or pass --cast "
                "(cast=True) to cast the values as they are")
    elif source.kind == "f" and target.kind in "iu":
        hint = (f"round and convert it explicitly (x.astype('{target}')) if it holds whole "
                "numbers, or pass --cast (cast=True)")
    raise DataError(
        f"Data input '{spec.name}'{where} has dtype {source}, but the model expects "
        f"{format_spec(spec)}; {hint}."
    )


def cast_notes(arrays: Mapping[str, np.ndarray], inputs: Sequence, rows=None,
               where: str = "") -> list[str]:
    """One note per integer (or boolean) input cast into a float input, naming the value
    range over ``rows`` (all when None): the model sees those values unscaled."""
    notes = []
    for spec in inputs:
        array = arrays[spec.name]
        if np.dtype(spec.dtype).kind != "f" or array.dtype.kind not in "iub":
            continue
        lo, hi = _value_range(array, rows)
        notes.append(
            f"Data input '{spec.name}'{where} holds {array.dtype} values {lo}..{hi}, cast to "
            f"{np.dtype(spec.dtype)} as they are (--cast): check that the model expects this "
            "scale (image models usually expect 0..1 or normalised values)."
        )
    return notes


def _value_range(array: np.ndarray, rows) -> tuple:
    rows = np.arange(len(array)) if rows is None else np.asarray(rows)
    lo = hi = None
    for start in range(0, len(rows), _CHUNK):
        part = np.asarray(array[rows[start:start + _CHUNK]])
        if part.size:
            lo = part.min() if lo is None else min(lo, part.min())
            hi = part.max() if hi is None else max(hi, part.max())
    return (int(lo), int(hi)) if lo is not None else (None, None)


def check_values(
    arrays: Mapping[str, np.ndarray], inputs: Sequence, indices: np.ndarray, where: str = ""
) -> None:
    """The rows ``indices`` are finite and fit the model's dtype (no overflow on cast).

    ``indices`` index ``arrays``' axis 0 and name the samples in messages.
    """
    indices = np.asarray(indices)
    for spec in inputs:
        array = arrays[spec.name]
        row_bytes = max(1, array[:1].nbytes)
        step = int(np.clip(_CHUNK_BYTES // row_bytes, 1, _CHUNK))
        for start in range(0, len(indices), step):
            rows = indices[start:start + step]
            _check_rows(spec, _take_rows(array, rows), rows, where)


def _take_rows(array, rows: np.ndarray):
    """``array[rows]``: a view when ``rows`` is an ascending run of consecutive indices."""
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and (np.diff(rows) == 1).all():
        return array[int(rows[0]):int(rows[-1]) + 1]
    return array[rows]


def _finite_after_cast(rows: np.ndarray, target: np.dtype) -> bool:
    """Every value of ``rows`` is finite as ``target`` (a float dtype), from its extremes
    alone: min / max propagate NaN, and the cast is monotone, so no value overflows unless
    an extreme does. No temporary the size of ``rows``."""
    if not rows.size:
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        ends = np.array([rows.min(), rows.max()]).astype(target)
    return bool(np.isfinite(ends).all())


def _check_rows(spec, rows: np.ndarray, indices: np.ndarray, where: str) -> None:
    target = np.dtype(spec.dtype)
    if target.kind == "f" and rows.dtype.kind in "fiub" and _finite_after_cast(rows, target):
        return
    if target.kind == "f":
        with np.errstate(over="ignore", invalid="ignore"):
            bad = ~np.isfinite(rows.astype(target, copy=False))
        if bad.any():
            pos = int(np.argmax(bad.reshape(len(rows), -1).any(axis=1)))
            value = rows[pos][bad[pos]].flat[0]
            kind = "NaN" if np.isnan(value) else f"{value} (not finite as {target})"
            raise DataError(
                f"Data input '{spec.name}'{where} has {kind} at sample {int(indices[pos])} "
                "(the first bad sample); clean the data or leave that sample out."
            )
    elif target.kind in "iu" and rows.dtype != target and rows.size:
        wrong = rows.astype(target) != rows
        if wrong.any():
            pos = int(np.argmax(wrong.reshape(len(rows), -1).any(axis=1)))
            value = rows[pos][wrong[pos]].flat[0]
            raise DataError(
                f"Data input '{spec.name}'{where} has value {value} at sample "
                f"{int(indices[pos])}, which does not fit {target}; fix the data."
            )


def cast_feeds(arrays: Mapping[str, np.ndarray], inputs: Sequence, rows) -> dict:
    """{input name: contiguous array of ``rows`` in the model's dtype} (copies as needed)."""
    return {
        s.name: np.ascontiguousarray(arrays[s.name][rows], dtype=np.dtype(s.dtype))
        for s in inputs
    }


def check_feeds(
    arrays: Mapping, inputs: Sequence, indices: np.ndarray,
    what: str = "feed dict key", where: str = "", cast: bool = False,
) -> dict:
    """Full check of one piece (names, shapes, dtypes, values); returns cast feeds.

    ``indices`` (m,) are the rows' sample positions, named in messages; ``cast`` as for
    :func:`check_dtype`.
    """
    check_names(arrays, inputs, what, where)
    check_meta(arrays, inputs, where, cast)
    for spec in inputs:
        _check_rows(spec, arrays[spec.name], indices, where)
    return cast_feeds(arrays, inputs, slice(None))


def select_indices(n: int, limit: int | None, seed: int | None) -> np.ndarray:
    """Sorted (k,) int64 positions out of ``n``: all, the first ``limit``, or with ``seed``
    those with the ``limit`` smallest keys ``default_rng(seed).random(n)``."""
    if limit is None or limit >= n:
        return np.arange(n, dtype=np.int64)
    if seed is None:
        return np.arange(limit, dtype=np.int64)
    keys = np.random.default_rng(seed).random(n)
    return np.sort(np.argsort(keys, kind="stable")[:limit]).astype(np.int64)


def select_first(pieces: Iterable[Piece], limit: int) -> Iterator[Piece]:
    """The first ``limit`` samples; stops pulling from ``pieces`` once it has them."""
    left = limit
    for feeds, labels, indices in pieces:
        m = min(left, len(indices))
        yield _slice(feeds, labels, indices, slice(0, m))
        left -= m
        if left == 0:
            return


def select_smallest_keys(pieces: Iterable[Piece], limit: int, seed: int) -> Iterator[Piece]:
    """The ``limit`` samples with the smallest keys ``default_rng(seed).random(n)``, in order.

    Same subset as :func:`select_indices` on a source of known size; reads the whole
    stream first and holds at most ``limit`` samples (copies) in memory.
    """
    rng = np.random.default_rng(seed)
    heap: list = []  # max-heap on key via negation: (-key, index, feeds, label)
    for feeds, labels, indices in pieces:
        for j, key in enumerate(rng.random(len(indices))):
            if len(heap) == limit and -heap[0][0] <= key:
                continue
            row = _slice(feeds, labels, indices, slice(j, j + 1))
            row = ({k: v.copy() for k, v in row[0].items()}, row[1], row[2])
            entry = (-key, int(indices[j]), row)
            (heapq.heapreplace if len(heap) == limit else heapq.heappush)(heap, entry)
    for _, _, row in sorted(heap, key=lambda entry: entry[1]):
        yield row


def _slice(feeds: dict, labels, indices: np.ndarray, part: slice) -> Piece:
    return (
        {k: v[part] for k, v in feeds.items()},
        None if labels is None else labels[part],
        indices[part],
    )


def rebatch(pieces: Iterable[Piece], batch_size: int, fixed: bool) -> Iterator[Piece]:
    """Pieces joined/split into batches of ``batch_size`` (the last may be smaller).

    A change of per-sample shape closes the batch early (dynamic dims).  With a
    ``fixed`` batch dim a short batch raises DataError.
    """
    buffer: list[Piece] = []
    count, signature = 0, None
    for feeds, labels, indices in pieces:
        shape = tuple((k, v.shape[1:]) for k, v in feeds.items())
        start = 0
        while start < len(indices):
            if buffer and shape != signature:
                yield _join(buffer, batch_size, fixed)
                buffer, count = [], 0
            signature = shape
            take = min(batch_size - count, len(indices) - start)
            buffer.append(_slice(feeds, labels, indices, slice(start, start + take)))
            count, start = count + take, start + take
            if count == batch_size:
                yield _join(buffer, batch_size, fixed)
                buffer, count = [], 0
    if buffer:
        yield _join(buffer, batch_size, fixed)


def _join(buffer: list[Piece], batch_size: int, fixed: bool) -> Piece:
    indices = np.concatenate([p[2] for p in buffer]) if len(buffer) > 1 else buffer[0][2]
    if fixed and len(indices) != batch_size:
        raise DataError(
            f"The model has a fixed batch size of {batch_size}, but a batch of "
            f"{len(indices)} samples ends at sample {int(indices[-1])}; pass a --limit that "
            "is a multiple of it or re-export the model with a dynamic batch dimension."
        )
    if len(buffer) == 1:
        return buffer[0]
    feeds = {k: np.concatenate([p[0][k] for p in buffer]) for k in buffer[0][0]}
    has_labels = buffer[0][1] is not None
    labels = np.concatenate([p[1] for p in buffer]) if has_labels else None
    return feeds, labels, indices
