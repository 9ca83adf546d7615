"""What every command shares: its result record, the report folder, data opening, the header."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..report import (
    to_json,
    to_jsonable,
    write_report,
)

DEFAULT_REPORT_ROOT = Path("onnxdiag-report")


@dataclass
class CommandResult:
    """What a command produced: the report dict, its text form and where it was written."""

    report: dict
    summary: str
    text: str
    folder: Path | None = None
    #: The command's main table as CSV (``--format csv``); None when it has none.
    csv: str | None = None

    def report_json_obj(self) -> dict:
        return to_jsonable(self.report)


def resolve_model(model):
    """(path, sample or None): the bundled sample when ``model`` is None."""
    if model is not None:
        return model, None
    from ..data.sample import get_sample

    sample = get_sample()
    return sample.model, sample


def check_out(out, command: str, overwrite: bool, write: bool) -> Path | None:
    """Fail before any work when the report folder cannot be written."""
    if not write:
        return None
    from ..report.write import check_report_folder

    return check_report_folder(Path(out) if out else DEFAULT_REPORT_ROOT / command,
                               overwrite=overwrite)


def open_source(source, specs, *, labels=None, limit=None, seed=0, batch_size=64):
    from ..data.source import open_data

    return open_data(source, specs, labels=labels, limit=limit, seed=seed, batch_size=batch_size)


def finish(command: str, report: dict, text: str, summary: str, folder,
            overwrite, *, csv: str | None = None, csv_name: str | None = None) -> CommandResult:
    """Write the report folder (report.json, report.txt, the CSV table when given)."""
    if folder is not None:
        files = {"report.json": to_json(report), "report.txt": text}
        if csv is not None:
            files[csv_name or f"{command}.csv"] = csv
        write_report(folder, files, overwrite=overwrite)
    return CommandResult(report=report, summary=summary, text=text, folder=folder, csv=csv)


def render_header(meta: dict) -> str:
    ort = meta.get("onnxruntime") or {}
    lines = [f"onnxdiag {meta['tool_version']} {meta['command']}: {meta.get('model_path')}",
             f"model sha256 {meta.get('model_sha256', '')[:16]}…"]
    if ort:
        dists = ", ".join(f"{k} {v}" for k, v in ort.get("distributions", {}).items())
        lines.append(f"ONNX Runtime {ort.get('version')} ({dists}); providers in use: "
                     f"{', '.join(meta.get('providers') or [])}")
        if len(ort.get("distributions", {})) > 1:
            lines.append("WARNING: several ONNX Runtime distributions are installed in this "
                         "environment; keep exactly one (see README, Install).")
    return "\n".join(lines) + "\n\n"


def safe_ratio(a, b):
    return None if not a or not b else a / b


def example_input(specs, source) -> dict:
    """A batch of 32 for latency: real data when available, else zeros of the input shape."""
    if source is not None:
        feeds = next(iter(source.batches())).feeds
        if all(v.shape[0] >= 32 for v in feeds.values()):
            return _Feeds({k: v[:32] for k, v in feeds.items()})
    return _Feeds({s.name: np.zeros([32] + [d or 1 for d in s.shape[1:]], dtype=s.dtype)
                   for s in specs})


class _Feeds(dict):
    def __getitem__(self, key):  # slice every input: feeds[:1]
        if isinstance(key, slice):
            return _Feeds({k: v[key] for k, v in self.items()})
        return super().__getitem__(key)


def describe_sources(**sources) -> dict:
    """{role: DataSource.describe()} of the sources given (None ones left out)."""
    return {role: src.describe() for role, src in sources.items() if src is not None}
