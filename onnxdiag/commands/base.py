"""What every command shares: the records its options come in, its result, the report folder.

A verb function (``analyze``, ``prune_channels_report``, …) takes the model, then records:

- :class:`DataRequest` — one data role (calibration ``data``, ``eval_data``,
  ``train_data``): where the samples are and how to read them (labels, limit, seed,
  batch size). A plain path or array is accepted wherever a request is
  (:meth:`DataRequest.of`). ``request.open(specs)`` opens it for a model's inputs.
- :class:`HeadChoice` — ``--head`` / ``--features`` when the head cannot be found alone.
- :class:`Runtime` — execution providers, where units of work run, progress bars.
- :class:`ReportTarget` — the report folder (``--out``, ``--overwrite``) or none;
  ``with report.claim(command) as claim:`` holds it for the run (pass ``claim`` to
  :func:`finish`).

and returns a :class:`CommandResult`. Verb-specific options come as one record of the
verb's own module (e.g. :class:`~onnxdiag.commands.prune_channels.ChannelPruneOptions`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Only the standard library at import time: the CLI builds these records before any
# numerical work (``onnxdiag --help`` imports neither numpy, onnx nor onnxruntime).
from ..data.request import DataRequest  # noqa: F401  (re-exported: one of the records)

DEFAULT_REPORT_ROOT = Path("onnxdiag-report")


# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class HeadChoice:
    """The classifier head when it cannot be found alone: its node or its features."""

    head: str | None = None
    features: str | None = None


@dataclass(frozen=True)
class Runtime:
    """Where and how the work runs.

    ``providers``: ONNX Runtime execution providers ("cpu", "cuda,cpu"; None = CUDA when
    available). ``executor``: ``local``, ``ray``, ``ray=HOST:PORT`` or an
    :class:`~onnxdiag.runtime.executor.Executor`; None = the verb's default. ``jobs``:
    worker processes (local) or CPUs (local Ray). ``progress``: progress bars on stderr.
    """

    providers: Any = None
    executor: Any = None
    jobs: int | None = None
    progress: bool = True

    def executor_name(self) -> str:
        ex = self.executor
        return getattr(ex, "name", None) or str(ex or "local")


@dataclass(frozen=True)
class ReportTarget:
    """The report folder: ``out`` (default ``onnxdiag-report/<command>``), ``overwrite``
    an existing one, or ``write=False`` for none.

    Without ``out`` a rerun replaces the command's previous default report; an explicit
    ``out`` that is not empty is refused unless ``overwrite``.
    """

    out: Any = None
    overwrite: bool = False
    write: bool = True

    def path(self, command: str) -> Path | None:
        """Where the report goes; None without write."""
        if not self.write:
            return None
        return Path(self.out) if self.out else DEFAULT_REPORT_ROOT / command

    def claim(self, command: str):
        """Claim the folder for this run, before any work, with an exclusive create
        (:func:`onnxdiag.report.write.claim_report_folder`): a context manager giving
        the :class:`~onnxdiag.report.write.ReportClaim` to pass to :func:`finish` (None
        without write). On any exception, Ctrl-C included, the claim is released and a
        folder it created removed. Raises OutputError when the folder is taken."""
        path = self.path(command)
        if path is None:
            return contextlib.nullcontext()
        from ..report.write import claim_report_folder

        return claim_report_folder(path, overwrite=self.overwrite,
                                   replace_report=self.out is None)

    def folder(self, command: str) -> Path | None:
        """The folder, checked (not claimed) before any work (raises OutputError); None
        without write. Prefer :meth:`claim`, which also holds it against other runs."""
        path = self.path(command)
        if path is None:
            return None
        from ..report.write import check_report_folder

        return check_report_folder(path, overwrite=self.overwrite)


def replace(record, **changes):
    """A copy of a frozen record with ``changes``."""
    return dataclasses.replace(record, **changes)


# --------------------------------------------------------------------------- result

@dataclass(frozen=True)
class CommandResult:
    """What a command produced: the report dict, its text form and where it was written."""

    report: dict
    summary: str
    text: str
    folder: Path | None = None
    #: The command's main table as CSV (``--format csv``); None when it has none.
    csv: str | None = None

    def report_json_obj(self) -> dict:
        from ..report.json import to_jsonable

        return to_jsonable(self.report)


def resolve_model(model):
    """(path, sample or None): the bundled sample when ``model`` is None."""
    if model is not None:
        return model, None
    from ..data.sample import get_sample

    sample = get_sample()
    return sample.model, sample


def finish(command: str, report: dict, text: str, folder, overwrite: bool, *,
           summary: str | None = None, csv: str | None = None,
           csv_name: str | None = None, files: dict | None = None) -> CommandResult:
    """Write the report folder (report.json, report.txt, the CSV table, extra ``files``)
    and return the result (``summary`` defaults to ``text``).

    ``folder``: the :class:`~onnxdiag.report.write.ReportClaim` of
    :meth:`ReportTarget.claim` (``overwrite`` is then ignored: the claim decided), a
    path (claimed now), or None for no report folder."""
    written = None
    if folder is not None:
        from ..report.json import to_json
        from ..report.write import write_report

        out = {"report.json": to_json(report), "report.txt": text}
        if csv is not None:
            out[csv_name or f"{command}.csv"] = csv
        out.update(files or {})
        written = write_report(folder, out, overwrite=overwrite)
    return CommandResult(report=report, summary=text if summary is None else summary,
                         text=text, folder=written, csv=csv)


def render_header(meta: dict) -> str:
    """The first lines of every text report: tool, command, model, runtime."""
    ort = meta.get("onnxruntime") or {}
    lines = [f"onnxdiag {meta['tool_version']} {meta['command']}: {meta.get('model_path')}",
             f"model sha256 {(meta.get('model_sha256') or '')[:16]}…"]
    if ort:
        dists = ", ".join(f"{k} {v}" for k, v in ort.get("distributions", {}).items())
        lines.append(f"ONNX Runtime {ort.get('version')} ({dists}); providers in use: "
                     f"{', '.join(meta.get('providers') or [])}")
        if len(ort.get("distributions", {})) > 1:
            lines.append("WARNING: several ONNX Runtime distributions are installed in this "
                         "environment; keep exactly one (see README, Install).")
    return "\n".join(lines) + "\n\n"


def find_structure(model, head: HeadChoice | None = None, data=None, *, providers=None):
    """The model's :class:`~onnxdiag.graph.Structure`; when its head cannot be found from the
    graph alone and ``data`` (a request, path or arrays) is given, the head is found by
    verification on the data's first batch (every linear map with constant weights that
    reaches an output is tried: docs/METHODS.md §A1)."""
    from ..errors import HeadNotFoundError
    from ..graph import analyze_structure

    head = head or HeadChoice()
    try:
        return analyze_structure(model, head=head.head, features=head.features)
    except HeadNotFoundError:
        if data is None or getattr(data, "source", data) is None:
            raise
    from ..model.io import get_input_specs

    batch = next(iter(DataRequest.of(data).open(get_input_specs(model)).batches()))
    return analyze_structure(model, head=head.head, features=head.features,
                             feeds=batch.feeds, providers=providers)


def describe_sources(**sources) -> dict:
    """{role: DataSource.describe()} of the sources given (None ones left out)."""
    return {role: src.describe() for role, src in sources.items() if src is not None}


def safe_ratio(a, b):
    """a / b, or None when either is missing or zero."""
    return None if not a or not b else a / b


def example_input(specs, source) -> dict:
    """A batch of 32 for latency: real data when available, else zeros of the input shape."""
    import numpy as np

    if source is not None:
        feeds = next(iter(source.batches())).feeds
        if all(v.shape[0] >= 32 for v in feeds.values()):
            return _Feeds({k: v[:32] for k, v in feeds.items()})
    return _Feeds({s.name: np.zeros([32] + [d or 1 for d in s.shape[1:]], dtype=s.dtype)
                   for s in specs})


#: Samples the emitted file's reload check runs (its outputs against the in-memory
#: model's): 8, as prune-channels' example batch.
VERIFY_SAMPLES = 8


def first_samples(feeds: dict, n: int = VERIFY_SAMPLES) -> dict:
    """The first ``n`` samples of every input of a feed dict."""
    return dict(_Feeds(feeds)[:n])


class _Feeds(dict):
    def __getitem__(self, key):  # slice every input: feeds[:1]
        if isinstance(key, slice):
            return _Feeds({k: v[key] for k, v in self.items()})
        return super().__getitem__(key)
