"""Helpers shared by the graph records: read-only arrays and JSON-able summaries."""

from __future__ import annotations

import numpy as np


def frozen_array(value, dtype=np.float64) -> np.ndarray:
    """A read-only copy of ``value`` as ``dtype`` (records are frozen, arrays too)."""
    arr = np.array(value, dtype=dtype)
    arr.setflags(write=False)
    return arr


def array_summary(arr: np.ndarray) -> dict:
    """Shape, dtype and Frobenius norm of ``arr`` (for reports that omit the values)."""
    return {"shape": list(arr.shape), "dtype": str(arr.dtype),
            "norm": float(np.linalg.norm(arr))}


def jsonable(value):
    """Convert tuples / NumPy scalars / arrays / nested records to JSON-able builtins."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
