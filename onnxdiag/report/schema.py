"""The published JSON Schema of report.json (``onnxdiag/schema/report.schema.json``)."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from ..errors import MissingExtraError, OnnxDiagError


def schema_path():
    """Path-like of the JSON Schema file shipped inside the package."""
    return resources.files("onnxdiag") / "schema" / "report.schema.json"


@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The report JSON Schema (draft 2020-12) as a dict."""
    return json.loads(schema_path().read_text(encoding="utf-8"))


def validate_report(report: dict) -> None:
    """Raise OnnxDiagError naming the first violation when ``report`` does not match the
    schema; needs the ``jsonschema`` package (in the ``[test]`` extra)."""
    try:
        import jsonschema
    except ImportError as exc:
        raise MissingExtraError("Validating reports needs jsonschema; install it with "
                                "pip install jsonschema.") from exc
    from .json import to_jsonable

    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(to_jsonable(report)), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = "/".join(map(str, e.path)) or "(top level)"
        raise OnnxDiagError(f"report does not match {load_schema()['title']} at {where}: "
                            f"{e.message[:200]}")
