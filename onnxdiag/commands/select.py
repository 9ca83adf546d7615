"""The ``select`` verb: score a checkpoint series and pick one without validation data."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, rows_to_csv
from .analyze import readout_row, run_parameters
from .base import (
    CommandResult,
    DataRequest,
    HeadChoice,
    ReportTarget,
    Runtime,
    finish,
)

#: Readouts shown as columns of the per-checkpoint text table.
TABLE_READOUTS = ("head_grad", "head_grad_feature", "loss", "confidence", "entropy",
                  "curvature")


@dataclass(frozen=True)
class SelectOptions:
    """Options of ``select`` (docs/METHODS.md §A3).

    ``targets`` / ``norm`` / ``include_bias``: the readouts' head gradient (as in
    :class:`~onnxdiag.commands.analyze.ReadoutOptions`). ``window``: select within the
    last K checkpoints, or ``"all"``. ``patience``: early stopping after this many
    checkpoints without improvement. ``select_by``: the readout of the headline choice
    (None: the head gradient of ``norm``). ``seed``: kept for the record (the probe
    subset's seed is the data request's). ``ignore_index``: the label-map value of
    ignored positions of a per-position head (docs/METHODS.md §A4); with such a head and
    labelled evaluation maps the checkpoints are ranked by mean IoU.
    """

    targets: str = "auto"
    norm: str = "feature"
    include_bias: bool = False
    window: int | str = 5
    patience: int = 3
    select_by: str | None = None
    seed: int = 0
    ignore_index: int = 255


def select_report(checkpoints, *, data, eval_data=None,
                  options: SelectOptions = SelectOptions(),  # noqa: B008 (frozen records)
                  head: HeadChoice = HeadChoice(),  # noqa: B008
                  runtime: Runtime = Runtime(),  # noqa: B008
                  report: ReportTarget = ReportTarget(),  # noqa: B008
                  prune=None) -> CommandResult:
    """Score a checkpoint series and pick one without validation data (``onnxdiag select``).

    ``checkpoints``: .onnx files in training order, a folder, or a JSON/CSV listing.
    Every checkpoint sees the same probe batch (fixed indices, saved in the report),
    read here once and shipped to the workers (``runtime.executor``: local worker
    processes by default, ``runtime.jobs`` of them; ``ray`` / ``ray=HOST:PORT``; or an
    :class:`~onnxdiag.runtime.executor.Executor`). A checkpoint that fails is reported and
    skipped. With ``eval_data`` each readout's choice is compared with the labelled
    oracle (docs/METHODS.md §A3); checkpoints of different architectures are ranked as a
    zoo ("screening"). ``prune``: a
    :class:`~onnxdiag.commands.select_prune_unit.PruneSelectOptions`; then every
    checkpoint is also pruned and repaired, and the series is ranked for the pruned
    deployment (docs/METHODS.md §A5; report section ``pruned_selection``).
    """
    from ..selection.checkpoints import list_checkpoints
    from ..selection.readouts import HEAD_GRAD_NAMES, get_readout

    data, eval_data = DataRequest.of(data), DataRequest.of(eval_data)
    if data is None:
        raise OnnxDiagError("select needs a probe batch: pass --data (data=...) with samples "
                            "of the model's inputs.")
    if prune is not None:
        from .select_pruned import select_pruned_report

        return select_pruned_report(checkpoints, data=data, eval_data=eval_data,
                                    options=options, prune=prune, head=head, runtime=runtime,
                                    report=report)
    with report.claim("select") as claim:
        series = list_checkpoints(checkpoints)
        select_by = options.select_by or HEAD_GRAD_NAMES[options.norm]
        get_readout(select_by)
        scored, sources, ran_on = _score_series(series, data, eval_data, options, head,
                                                runtime)
        ok = [s for s in scored if s.error is None]
        section = summarize_series(ok, window=options.window, patience=options.patience,
                                   select_by=select_by, has_eval=eval_data is not None)
        section["checkpoints"] = [s.to_dict() for s in scored]
        section["failed"] = [{"path": s.checkpoint.path, "error": s.error} for s in scored
                             if s.error is not None]
        params = {"checkpoints": [str(c) for c in _as_list(checkpoints)],
                  **run_parameters(dataclasses.replace(options, select_by=select_by), head,
                                   runtime, data=data, eval_data=eval_data),
                  "jobs": runtime.jobs, "executor": runtime.executor_name()}
        meta = build_metadata(providers=runtime.providers,
                              command="select", parameters=params, data=sources)
        meta["executor"] = ran_on
        result = {"schema": SCHEMA_VERSION, "metadata": meta, "selection": section}
        text = render_selection(section, ok, select_by)
        return finish("select", result, text, claim, report.overwrite,
                      csv=_table(section, ok), csv_name="checkpoints.csv")


def _as_list(checkpoints) -> list:
    return [checkpoints] if isinstance(checkpoints, (str, Path)) else list(checkpoints)


def _score_series(series, data, eval_data, options, head, runtime):
    """(scored checkpoints, {role: data description}, executor description); raises when
    no checkpoint could be scored (OnnxDiagError, or UnitFailure when a bug stopped them)."""
    from ..runtime.executor import open_executor, raise_failures
    from ..selection.checkpoints import ScoringOptions, open_shared_data, score_checkpoints

    shared = open_shared_data(series, data, eval_data)
    scoring = ScoringOptions(head=head.head, features=head.features, targets=options.targets,
                             norm=options.norm, include_bias=options.include_bias,
                             providers=runtime.providers, ignore_index=options.ignore_index)
    with open_executor(runtime.executor, runtime.jobs) as ex:
        shipped = [None if d is None else ex.ship(d.request, d.source) for d in shared]
        scored = score_checkpoints(series, *shipped, options=scoring, executor=ex,
                                   progress=runtime.progress)
        ran_on = ex.describe()
    if not any(s.error is None for s in scored):
        raise_failures([s.error for s in scored],
                       "No checkpoint could be scored; the first error was: {first}")
    for s in scored:
        if s.result is not None:  # the same probe batch everywhere, described once
            s.result["data"] = shared[0].description
    described = {role: d.description for role, d in zip(("calibration", "evaluation"), shared)
                 if d is not None}
    return scored, described, ran_on


def _table(section: dict, ok) -> str:
    return rows_to_csv([{"index": s.checkpoint.index, "step": s.checkpoint.step,
                         "flagged": i in section["flagged"],
                         "selected": i == section.get("selected"),
                         **readout_row(s.checkpoint.path, s.result), "n_stored": s.n_stored}
                        for i, s in enumerate(ok)])


def _series_values(ok, name: str) -> list[float]:
    return [s.result["readouts"]["values"].get(name, float("nan")) for s in ok]


def summarize_series(ok, *, window, patience, select_by: str, has_eval: bool) -> dict:
    """Selection (and, with labels, its evaluation) over successfully scored checkpoints."""
    from ..selection.readouts import READOUTS
    from ..selection.series import early_stop, evaluate_selection, rank_models, select_checkpoint

    names = [n for n in READOUTS if any(n in s.result["readouts"]["values"] for s in ok)]
    values = {n: _series_values(ok, n) for n in names}
    flagged = [i for i, s in enumerate(ok) if s.result["readouts"]["degenerate"]]
    zoo = len({s.architecture for s in ok}) > 1
    direction = READOUTS[select_by].direction
    out = {"n_scored": len(ok), "zoo": zoo, "select_by": select_by, "flagged": flagged,
           "window": window, "patience": patience,
           "paths": [s.checkpoint.path for s in ok], "steps": [s.checkpoint.step for s in ok]}
    if not zoo:
        pick = select_checkpoint(values[select_by], direction, window=window, flagged=flagged)
        stop = early_stop(values[select_by], direction, patience, flagged=flagged)
        out.update(selected=pick, selected_path=ok[pick].checkpoint.path,
                   early_stop={"stopped_at": stop.stopped_at, "keep": stop.best})
    if has_eval:
        quality = _quality(ok)
        acc = [s.result["evaluation"][quality] for s in ok]
        loss = [s.result["evaluation"]["loss"] for s in ok]
        out["accuracy"] = [s.result["evaluation"]["accuracy"] for s in ok]
        out["loss"], out["quality"] = loss, quality
        if quality == "miou":
            out["miou"] = acc
        if zoo:  # the per-use count: shared initializers count once per layer
            n_params = [s.n_params for s in ok]
            out["screening"] = {n: rank_models(values[n], acc, READOUTS[n].direction,
                                               n_params=n_params).to_dict()
                                for n in names if READOUTS[n].direction != "context"}
        else:
            out["evaluation"] = evaluate_selection(values, acc, loss, window=window,
                                                   patience=patience, flagged=flagged).to_dict()
            out["evaluation_without_first"] = (
                evaluate_selection({n: v[1:] for n, v in values.items()}, acc[1:], loss[1:],
                                   window=window, patience=patience,
                                   flagged=[i - 1 for i in flagged if i > 0]).to_dict()
                if len(ok) > 3 else None)
    return out


def _quality(ok) -> str:
    """What ranks the checkpoints: mean IoU when every evaluation has it (a per-position
    head on label maps, docs/METHODS.md §A4), else top-1 accuracy."""
    return "miou" if all(s.result["evaluation"].get("miou") is not None for s in ok) \
        else "accuracy"


def render_selection(section: dict, ok, select_by: str) -> str:
    """Readout-vs-checkpoint table, the choice, and (with labels) how good it was."""
    from ..report import render_table

    rows = []
    for i, s in enumerate(ok):
        vals = s.result["readouts"]["values"]
        row = {"#": i, "checkpoint": _short(s.checkpoint.path), "step": s.checkpoint.step}
        row.update({n: vals.get(n) for n in TABLE_READOUTS if n in vals})
        if "miou" in section:
            row["mIoU %"] = 100 * section["miou"][i]
        if "accuracy" in section:
            row["pixel %" if "miou" in section else "top1 %"] = 100 * section["accuracy"][i]
        row["flag"] = "degenerate" if i in section["flagged"] else ""
        rows.append(row)
    lines = ["== Checkpoints ==", render_table(rows).rstrip()]
    lines += _shared_params_lines(ok)
    for f in section["failed"]:
        lines.append(f"SKIPPED {f['path']}: {f['error']}")
    if "selected" in section:
        es = section["early_stop"]
        lines.append(f"selected by {select_by} (window {section.get('window', '')}): "
                     f"#{section['selected']} {section['selected_path']}")
        lines.append(f"early stopping: would stop at #{es['stopped_at']} keeping #{es['keep']}"
                     if es["stopped_at"] is not None else
                     f"early stopping: never triggered; best so far #{es['keep']}")
    if "evaluation" in section:
        lines += ["", _render_evaluation(section["evaluation"], section.get("quality"))]
    if "screening" in section:
        srows = [{"readout": n, "spearman": r["spearman"], "kendall": r["kendall"],
                  "params spearman": r["baseline_spearman"],
                  "sign": "WRONG" if r["wrong_sign"] else "ok"}
                 for n, r in section["screening"].items()]
        lines += ["", render_table(srows, title="== Screening (architectures ranked) ==").rstrip()]
    return "\n".join(lines) + "\n"


def _shared_params_lines(ok, k: int = 5) -> list[str]:
    """A line when some checkpoints store fewer parameters than they compute with (an
    exporter shared one initializer between layers with equal weights)."""
    shared = [(i, s) for i, s in enumerate(ok)
              if s.n_stored is not None and s.n_params is not None and s.n_stored != s.n_params]
    if not shared:
        return []
    shown = ", ".join(f"#{i} {s.n_stored:,} stored / {s.n_params:,} used"
                      for i, s in shared[:k])
    more = f" (first {k} of {len(shared)})" if len(shared) > k else ""
    return [f"shared initializers: {shown}{more}; n_params and its baselines count every use."]


def _render_evaluation(ev: dict, quality: str | None = None) -> str:
    from ..report import render_table

    column = "mIoU %" if quality == "miou" else "top1 %"
    rows = []
    for name, r in ev["readouts"].items():
        sel = r.get("selected") or {}
        rows.append({"readout": name, "better": r["direction"],
                     "pearson": r["vs_accuracy"]["pearson"],
                     "spearman": r["vs_accuracy"]["spearman"],
                     "pick": sel.get("index"), column: _pct(sel.get("accuracy")),
                     "gap pp": sel.get("gap_window_pp"), "gap all pp": sel.get("gap_overall_pp"),
                     "sign": "WRONG" if r["wrong_sign"] else ""})
    o, last, rnd = ev["oracle_window"], ev["last"], ev["random"]
    title = "== Selection vs labels (docs/METHODS.md §A3) ==" if quality != "miou" else \
        "== Selection vs labels: mean IoU (docs/METHODS.md §A3, §A4) =="
    lines = [title, render_table(rows).rstrip(),
             f"oracle in window: #{o['index']} {_pct(o['accuracy']):.2f} %; best overall: "
             f"#{ev['oracle_overall']['index']} {_pct(ev['oracle_overall']['accuracy']):.2f} %",
             f"baselines: last checkpoint gap {last['gap_window_pp']:.2f} pp; random checkpoint "
             f"expected gap {rnd['gap_window_pp']:.2f} pp"]
    wrong = [n for n, r in ev["readouts"].items() if r["wrong_sign"]]
    if wrong:
        lines.append("WARNING: on this run the correlation with "
                     f"{'mean IoU' if quality == 'miou' else 'accuracy'} has the WRONG SIGN for: "
                     + ", ".join(wrong) + " — do not select with these here.")
    return "\n".join(lines)


def _pct(x):
    return None if x is None else 100.0 * x


def _short(path: str) -> str:
    return Path(path).name
