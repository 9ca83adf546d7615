"""Checkpoint series: listing, scoring every checkpoint on one probe batch
(docs/METHODS.md §A3).

The probe and evaluation data are opened once (:func:`open_shared_data`) and shipped to
the executor's workers once (``Executor.ship``: the request itself where workers can
reopen its path, else its samples); each unit of work loads one checkpoint file and
scores it (:func:`score_checkpoint`), so every checkpoint sees the identical probe
batch. A checkpoint that fails to load or score is reported and skipped.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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
    """The result of one worker: the probe result's dict, or the error that stopped it.

    ``n_params``: parameters the graph computes with, per use (an initializer the exporter
    shares between cloned layers counts once per layer), the count the baselines use;
    ``n_stored``: the same initializers as stored, each once (Structure.n_params /
    n_stored)."""

    checkpoint: Checkpoint
    result: dict | None
    error: str | None
    n_params: int | None = None
    architecture: str | None = None
    n_stored: int | None = None

    def to_dict(self) -> dict:
        return {"path": self.checkpoint.path, "index": self.checkpoint.index,
                "step": self.checkpoint.step, "n_params": self.n_params,
                "n_stored": self.n_stored, "architecture": self.architecture,
                "error": self.error, "result": self.result}


@dataclass(frozen=True)
class ScoringOptions:
    """How each checkpoint is scored: head choice, readout options, ONNX Runtime providers
    and intra-op ``threads`` (None: ORT's default); ``ignore_index``: the label-map value of
    ignored positions (per-position heads, docs/METHODS.md §A4)."""

    head: str | None = None
    features: str | None = None
    targets: str = "auto"
    norm: str = "feature"
    include_bias: bool = False
    providers: Any = None
    threads: int | None = None
    ignore_index: int = 255


@dataclass(frozen=True)
class SharedData:
    """One data role opened once for a series: the ``request`` workers reopen (or its
    samples in memory), the ``source`` opened here, and its ``description``."""

    request: Any
    source: Any
    description: dict


def open_shared_data(checkpoints: Sequence[Checkpoint], *requests) -> list[SharedData | None]:
    """Open each DataRequest (None stays None) for the inputs of the first checkpoint
    that loads, so that every checkpoint sees the same samples: a stream (a loader
    script, a reader) is read into memory once.

    Raises:
        OnnxDiagError: no checkpoint loads, or the data do not fit it.
    """
    specs = _first_input_specs(checkpoints)
    return [None if r is None else _open_shared(r, specs) for r in requests]


def _open_shared(request, specs) -> SharedData:
    source = request.open(specs)
    if source.random_access:
        return SharedData(request, source, source.describe())
    memory = request.in_memory(source)
    return SharedData(memory, memory.open(specs), source.describe())


def _first_input_specs(checkpoints):
    from ..model.io import get_input_specs, load_model

    first_error = None
    for c in checkpoints:
        try:
            return get_input_specs(load_model(c.path))
        except OnnxDiagError as exc:
            first_error = first_error or exc
    raise OnnxDiagError(f"No checkpoint could be loaded; the first error was: {first_error}")


def score_checkpoint(checkpoint: Checkpoint, probe, evaluation,
                     options: ScoringOptions = ScoringOptions()) -> ScoredCheckpoint:
    """Load one checkpoint, find its head, run the probe (the worker's unit of work).

    ``probe`` / ``evaluation``: what :meth:`~onnxdiag.runtime.executor.Executor.ship`
    sent (evaluation may be None). Raises what stops it (the executor reports it).
    """
    from ..graph import analyze_structure
    from ..model.io import get_input_specs, load_model
    from ..runtime.executor import receive
    from .probe import probe_model

    model = load_model(checkpoint.path)
    structure = analyze_structure(model, head=options.head, features=options.features)
    specs = get_input_specs(model)
    result = probe_model(model, structure, receive(probe, specs),
                         eval_source=None if evaluation is None else receive(evaluation, specs),
                         targets=options.targets, norm=options.norm,
                         include_bias=options.include_bias, providers=options.providers,
                         threads=options.threads, ignore_index=options.ignore_index)
    return ScoredCheckpoint(checkpoint, result.to_dict(), None, structure.n_params,
                            architecture_signature(structure), structure.n_stored)


def architecture_signature(structure) -> str:
    """A short fingerprint of layer geometry: equal for checkpoints of one architecture."""
    parts = [f"{layer.op_type}:{layer.n_in}>{layer.n_out}" for layer in structure.layers]
    return f"{len(parts)}L:" + ",".join(parts)


def score_checkpoints(checkpoints: Sequence[Checkpoint], probe, evaluation=None, *,
                      options: ScoringOptions = ScoringOptions(), executor,
                      progress: bool = False) -> list[ScoredCheckpoint]:
    """Score every checkpoint, one unit of work per checkpoint on ``executor``.

    ``probe`` / ``evaluation``: the shipped data (``executor.ship``), sent once as shared
    arguments. Results come back in series order; a failed checkpoint carries its
    :class:`~onnxdiag.runtime.executor.UnitError` as ``error``.
    """
    from ..runtime.executor import wants_gpu

    if not executor.in_process and min(executor.capacity, len(checkpoints)) > 1:
        # Cores go to processes, not to ORT's intra-op threads (benchmarks/RESULTS.md).
        options = replace(options, threads=options.threads or 1)
    results: dict[int, ScoredCheckpoint] = {}
    for i, scored, error in executor.map(_score_unit, checkpoints, (probe, evaluation, options),
                                         label="Scoring checkpoints" if progress else None,
                                         gpu=wants_gpu(options.providers)):
        results[i] = scored if error is None else ScoredCheckpoint(checkpoints[i], None, error)
    return [results[i] for i in range(len(checkpoints))]


def _score_unit(checkpoint, probe, evaluation, options):
    return score_checkpoint(checkpoint, probe, evaluation, options)
