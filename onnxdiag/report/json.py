"""JSON reports with a versioned schema and full run metadata."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json as _json
import math
import platform
import sys
from pathlib import Path

import numpy as np

#: Bumped when a report's layout changes incompatibly.
SCHEMA_VERSION = "onnxdiag.report/2"


def to_jsonable(value):
    """Convert records, NumPy values and paths to JSON builtins (NaN/Inf → None)."""
    if hasattr(value, "to_dict"):
        return to_jsonable(value.to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return to_jsonable(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.dtype):
        return str(value)
    return value


def to_json(report: dict) -> str:
    """Serialise a report dict (already holding metadata) to indented JSON."""
    return _json.dumps(to_jsonable(report), indent=2, allow_nan=False) + "\n"


def build_metadata(*, command: str, parameters: dict, model_path=None, model_hash=None,
                   runner=None, data=None, providers=None) -> dict:
    """Everything needed to reproduce and compare a run (every default echoed, docs/METHODS.md)."""
    import onnx

    from .. import __version__

    meta = {
        "tool": "onnxdiag",
        "tool_version": __version__,
        "command": command,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy_version": np.__version__,
        "onnx_version": onnx.__version__,
        "parameters": parameters,
    }
    if model_path is not None:
        meta["model_path"] = str(model_path)
    if model_hash is not None:
        meta["model_sha256"] = model_hash
    from ..runtime.runner import ort_info, resolve_providers

    meta["onnxruntime"] = ort_info()
    # the providers of the run's sessions: the runner's, else those ``providers`` resolve to
    meta["providers"] = runner.providers if runner is not None else \
        resolve_providers(providers)
    if data is not None:
        meta["data"] = data
    return meta
