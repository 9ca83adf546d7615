"""Checkpoint series: listing, scoring every checkpoint on one probe batch (SPEC A3).

Each checkpoint is scored in its own worker process (``jobs``), reading the model
file itself; the probe and evaluation data are re-opened from the same
description in every worker, so every checkpoint sees the identical probe batch.
A checkpoint that fails to load or score is reported and skipped.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import OnnxDiagError

MODEL_SUFFIXES = (".onnx",)


@dataclass(frozen=True)
class Checkpoint:
    """One entry of a series: path, position in training order, optional step."""

    path: str
    index: int
    step: float | None = None


def list_checkpoints(sources: Sequence[str | os.PathLike]) -> list[Checkpoint]:
    """Checkpoints from files, a folder (natural sort) or a JSON/CSV listing paths and steps.

    A JSON listing is a list of paths or of objects with ``path`` (relative to the
    listing) and optional ``step``; a CSV has ``path`` and optional ``step`` columns.

    Raises:
        OnnxDiagError: nothing found, or a listed file is missing.
    """
    from .series import natural_sort_key

    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]  # one folder or listing, not a sequence of characters
    entries: list[tuple[str, float | None]] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            files = sorted((f for f in p.iterdir() if f.suffix in MODEL_SUFFIXES),
                           key=lambda f: natural_sort_key(f.name))
            entries += [(str(f), None) for f in files]
        elif p.suffix.lower() in (".json", ".csv"):
            entries += _read_listing(p)
        else:
            entries.append((str(p), None))
    if not entries:
        raise OnnxDiagError(
            f"No .onnx checkpoints found in {', '.join(map(str, sources))}; pass files, a folder "
            "of .onnx files, or a JSON/CSV listing."
        )
    missing = [path for path, _ in entries if not Path(path).is_file()]
    if len(missing) == len(entries):
        raise OnnxDiagError(f"Checkpoint file '{missing[0]}' does not exist; check the paths.")
    return [Checkpoint(path=path, index=i, step=step) for i, (path, step) in enumerate(entries)]


def _read_listing(path: Path) -> list[tuple[str, float | None]]:
    if not path.is_file():
        raise OnnxDiagError(f"Checkpoint listing '{path}' does not exist; check the path.")
    try:
        if path.suffix.lower() == ".json":
            rows = json.loads(path.read_text())
            if isinstance(rows, dict):
                rows = rows.get("checkpoints", [])
            rows = [{"path": r} if isinstance(r, str) else r for r in rows]
        else:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        out = []
        for r in rows:
            step = r.get("step")
            out.append((str(path.parent / r["path"]),
                        None if step in (None, "") else float(step)))
        return out
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise OnnxDiagError(
            f"Cannot read checkpoint listing '{path}' ({type(exc).__name__}: {exc}); expected a "
            "list of paths or of {\"path\": ..., \"step\": ...} (JSON), or path,step columns (CSV)."
        ) from exc


@dataclass(frozen=True)
class ScoredCheckpoint:
    """The result of one worker: the probe result's dict, or the error that stopped it."""

    checkpoint: Checkpoint
    result: dict | None
    error: str | None
    n_params: int | None = None
    architecture: str | None = None

    def to_dict(self) -> dict:
        return {"path": self.checkpoint.path, "index": self.checkpoint.index,
                "step": self.checkpoint.step, "n_params": self.n_params,
                "architecture": self.architecture, "error": self.error, "result": self.result}


def score_checkpoint(checkpoint: Checkpoint, probe_args: dict, eval_args: dict | None,
                     options: dict) -> ScoredCheckpoint:
    """Load one checkpoint, find its head, run the probe (worker entry point)."""
    from ..data.source import open_data
    from ..errors import OnnxDiagError as _UserError
    from ..graph import analyze_structure
    from ..model.io import get_input_specs, load_model
    from .probe import probe_model

    try:
        model = load_model(checkpoint.path)
        structure = analyze_structure(model, head=options.get("head"),
                                      features=options.get("features"))
        specs = get_input_specs(model)
        probe = open_data(inputs=specs, **probe_args)
        evaluation = open_data(inputs=specs, **eval_args) if eval_args else None
        result = probe_model(model, structure, probe, eval_source=evaluation,
                             targets=options.get("targets", "auto"),
                             norm=options.get("norm", "feature"),
                             include_bias=options.get("include_bias", False),
                             providers=options.get("providers"), threads=options.get("threads"))
        return ScoredCheckpoint(checkpoint, result.to_dict(), None, structure.n_params,
                                architecture_signature(structure))
    except _UserError as exc:
        return ScoredCheckpoint(checkpoint, None, str(exc))
    except Exception as exc:  # noqa: BLE001 - one bad checkpoint must not stop the series
        return ScoredCheckpoint(checkpoint, None, f"{type(exc).__name__}: {exc}")


def architecture_signature(structure) -> str:
    """A short fingerprint of layer geometry: equal for checkpoints of one architecture."""
    parts = [f"{layer.op_type}:{layer.n_in}>{layer.n_out}" for layer in structure.layers]
    return f"{len(parts)}L:" + ",".join(parts)


def score_checkpoints(checkpoints: Sequence[Checkpoint], probe_args: dict,
                      eval_args: dict | None = None, *, options: dict | None = None,
                      jobs: int | None = None, progress: bool = False,
                      executor=None) -> list[ScoredCheckpoint]:
    """Score every checkpoint, one unit of work per checkpoint.

    ``executor``: an :class:`onnxdiag.executor.Executor` (default: local worker processes,
    ``jobs`` of them). On Ray the probe (and evaluation) samples are read once here and
    shipped once through the object store; locally each worker reads them from the
    source. Results come back in series order; failed checkpoints carry ``error``.
    """
    from ..runtime.executor import LocalExecutor, wants_gpu

    options = dict(options or {})
    executor = executor or LocalExecutor(jobs)
    descriptions = None
    if not executor.reads_paths:
        probe_args, eval_args, descriptions = _materialize(checkpoints, probe_args, eval_args)
    n_local = max(1, min(jobs or os.cpu_count() or 1, len(checkpoints)))
    if not executor.reads_paths or n_local > 1:
        # Cores go to processes, not to ORT's intra-op threads (benchmarks/RESULTS.md).
        options.setdefault("threads", 1)
    results: dict[int, ScoredCheckpoint] = {}
    for i, scored, error in executor.map(_score_unit, checkpoints,
                                         (probe_args, eval_args, options),
                                         label="Scoring checkpoints" if progress else None,
                                         gpu=wants_gpu(options.get("providers"))):
        if scored is None:  # the unit itself died (worker crash); keep the message
            scored = ScoredCheckpoint(checkpoints[i], None, error)
        results[i] = scored
    out = [results[i] for i in range(len(checkpoints))]
    if descriptions is not None:
        for s in out:
            if s.result is not None:
                s.result["data"] = descriptions[0]
    return out


def _score_unit(checkpoint, probe_args, eval_args, options):
    return score_checkpoint(checkpoint, probe_args, eval_args, options)


def _materialize(checkpoints, probe_args: dict, eval_args: dict | None):
    """Read the probe (and evaluation) samples once, as arrays for the object store."""
    from ..data.source import open_data
    from ..model.io import get_input_specs, load_model

    specs, first_error = None, None
    for c in checkpoints:
        try:
            specs = get_input_specs(load_model(c.path))
            break
        except OnnxDiagError as exc:
            first_error = first_error or exc
    if specs is None:
        raise OnnxDiagError(f"No checkpoint could be loaded; the first error was: {first_error}")

    def read(args):
        source = open_data(inputs=specs, **args)
        arrays, labels = source.to_arrays()
        if labels is not None:
            arrays["labels"] = labels
        shipped = dict(source=arrays, batch_size=source.batch_size)
        return shipped, source.describe()

    probe, probe_desc = read(probe_args)
    evaluation, eval_desc = read(eval_args) if eval_args else (None, None)
    return probe, evaluation, (probe_desc, eval_desc)
