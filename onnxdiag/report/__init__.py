"""Reports: versioned JSON, plain-text tables, written atomically into a folder."""

from .json import SCHEMA_VERSION, build_metadata, to_json, to_jsonable
from .text import render_table, rows_to_csv
from .write import write_report

__all__ = ["SCHEMA_VERSION", "build_metadata", "render_table", "rows_to_csv", "to_json",
           "to_jsonable", "write_report"]
