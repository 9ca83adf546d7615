"""Graphs that run at one batch size only, although their inputs say the batch is dynamic.

An export can bake the batch size it was traced with into the graph (a ``Reshape`` to
``(2, -1)``, a ``Concat`` with a tensor expanded to batch 2): the inputs say ``N`` but
every other batch size fails inside ONNX Runtime. :func:`find_fixed_batch` recognises such
a graph after a failed run — the first sample repeated runs at size ``k`` but not at
``k + 1`` — and :func:`run_in_pieces` then runs any batch ``k`` samples at a time, padding
the last piece with copies of its last sample and dropping their outputs, so that the
outputs are those of the whole batch (an inference graph treats samples independently).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import onnx

from ..errors import DataError

#: Most candidate sizes tried after a failed run (two short runs each).
MAX_TRIES = 8
MAX_BATCH = 4096
_NODE = re.compile(r"running (\S+) node\. Name:'([^']*)'")

Run = Callable[[dict, list], dict]  # (feeds, output names) -> {name: value}; DataError if refused


def batch_len(feeds: dict) -> int:
    """Samples in a feed dict (axis 0 of its first array)."""
    return len(next(iter(feeds.values())))


def batch_candidates(model, input_dims: Sequence, message: str, n: int) -> list[int]:
    """Batch sizes worth trying after a batch of ``n`` failed with ``message``, most
    likely first: the inputs' fixed axis-0 dims (``input_dims``), sizes both in the message
    and in the graph's small integer constants, 1, the other constants, the other numbers
    in the message."""
    in_message = [int(v) for v in re.findall(r"\b\d+\b", message)]
    constants = sorted(_leading_constants(model))
    fixed = [int(d) for d in input_dims if isinstance(d, int) and d > 0]
    ordered = fixed + [v for v in constants if v in in_message] + [1] + constants \
        + sorted(in_message)
    seen = []
    for v in ordered:
        if 1 <= v <= MAX_BATCH and v != n and v not in seen:
            seen.append(v)
    return seen[:MAX_TRIES]


def _leading_constants(model) -> set[int]:
    """First elements of the graph's short 1-D integer constants (shapes such as a
    Reshape's ``[2, -1]``): initializers and Constant nodes of the main graph."""
    proto = _as_proto(model)
    if proto is None:
        return set()
    tensors = list(proto.graph.initializer)
    tensors += [a.t for node in proto.graph.node if node.op_type == "Constant"
                for a in node.attribute if a.name == "value"]
    found = set()
    for t in tensors:
        if t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) \
                and len(t.dims) == 1 and 0 < t.dims[0] <= 8:
            value = onnx.numpy_helper.to_array(t)
            if value[0] > 0:
                found.add(int(value[0]))
    return found


def _as_proto(model) -> onnx.ModelProto | None:
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        if isinstance(model, (bytes, bytearray)):
            return onnx.load_from_string(bytes(model))
        return onnx.load(model, load_external_data=False)
    except Exception:  # noqa: BLE001 - only a source of candidates
        return None


def find_fixed_batch(run: Run, feeds: dict, names: list, candidates: Sequence[int]
                     ) -> int | None:
    """The one batch size ``k`` the graph runs at, or None: the first sample repeated
    ``k`` times runs (every output with ``k`` rows) and repeated ``k + 1`` times does not
    (so the failure depends on the batch size, not on the data)."""
    row = {name: value[:1] for name, value in feeds.items()}
    for k in candidates:
        if _runs_at(run, row, names, k) and not _runs_at(run, row, names, k + 1):
            return k
    return None


def _runs_at(run: Run, row: dict, names: list, k: int) -> bool:
    try:
        outputs = run({name: np.repeat(v, k, axis=0) for name, v in row.items()}, names)
    except DataError:
        return False
    return all(_rows(value) == k for value in outputs.values())


def _rows(value) -> int | None:
    if isinstance(value, np.ndarray):
        return value.shape[0] if value.ndim else None
    return len(value) if isinstance(value, list) else None


def run_in_pieces(run: Run, feeds: dict, names: list, k: int) -> dict:
    """``run`` over ``feeds`` ``k`` samples at a time (the last piece padded with copies of
    its last sample); returns the outputs of every sample, in order.

    Raises DataError when an output has no batch axis of ``k`` rows (it cannot be split).
    """
    n = batch_len(feeds)
    pieces = []
    for start in range(0, n, k):
        m = min(k, n - start)
        piece = {name: _pad(v[start:start + m], k) for name, v in feeds.items()}
        outputs = run(piece, names)
        for name, value in outputs.items():
            if _rows(value) != k:
                raise DataError(
                    f"The model only runs at batch size {k}, and its output '{name}' has no "
                    f"batch axis of {k} rows, so batches cannot run {k} samples at a time; "
                    "re-export the model with a dynamic batch dimension.")
        pieces.append({name: value[:m] for name, value in outputs.items()})
    return {name: _join([p[name] for p in pieces]) for name in names}


def _pad(rows: np.ndarray, k: int) -> np.ndarray:
    if len(rows) == k:
        return rows
    return np.concatenate([rows, np.repeat(rows[-1:], k - len(rows), axis=0)])


def _join(parts: list):
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts) if len(parts) > 1 else parts[0]
    return [item for part in parts for item in part]


_WARNED: set[str] = set()  # texts already shown by this process


def warn_fixed_batch(k: int, message: str, declared: str | None) -> None:
    """One DataWarning (a ``warning: …`` line in the CLI) that the graph runs ``k`` samples
    at a time; once per process and text, however many sessions of the model find it."""
    from ..data.source import DataWarning

    if declared:
        where = f"its input '{declared}' has a fixed batch dimension of {k}"
    elif found := _NODE.search(message):
        where = f"other batch sizes fail at its {found.group(1)} node '{found.group(2)}'"
    else:
        where = "other batch sizes fail inside ONNX Runtime"
    text = (f"The model only runs at batch size {k} ({where}); onnxdiag runs it {k} "
            "sample(s) at a time, which is slower. Re-export it with a dynamic batch "
            "dimension to run larger batches.")
    if text not in _WARNED:
        _WARNED.add(text)
        warnings.warn(text, DataWarning, stacklevel=4)
