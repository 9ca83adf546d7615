"""The ``select`` verb: score a checkpoint series and pick one without validation data."""

from __future__ import annotations

from pathlib import Path

from ..errors import OnnxDiagError
from ..report import (
    SCHEMA_VERSION,
    build_metadata,
    rows_to_csv,
)
from .analyze import readout_row
from .base import CommandResult, check_out, finish_old

#: Readouts shown as columns of the per-checkpoint text table.
TABLE_READOUTS = ("head_grad", "head_grad_feature", "loss", "confidence", "entropy",
                  "curvature")


def select_report(checkpoints, *, data, labels=None, eval_data=None, eval_labels=None,
                  limit=None, seed=0, batch_size=64, providers=None, head=None, features=None,
                  targets="auto", norm="feature", include_bias=False, window=5, patience=3,
                  select_by=None, jobs=None, executor=None, out=None, overwrite=False,
                  write=True, progress=True) -> CommandResult:
    """Score a checkpoint series and pick one without validation data (``onnxdiag select``).

    Every checkpoint sees the same probe batch (fixed indices, saved in the report). A
    checkpoint that fails is reported and skipped. With ``eval_data`` each readout's
    choice is compared with the labelled oracle (SPEC A3); when the checkpoints differ in
    architecture the series is ranked as a zoo ("screening"). ``executor``: ``local``
    (default, ``jobs`` worker processes), ``ray`` or ``ray=HOST:PORT`` (one Ray task per
    checkpoint, the probe batch shipped once), or an :class:`~onnxdiag.executor.Executor`.
    """
    from ..runtime.executor import open_executor
    from ..selection.checkpoints import list_checkpoints, score_checkpoints
    from ..selection.readouts import HEAD_GRAD_NAMES, get_readout

    folder = check_out(out, "select", overwrite, write)
    series = list_checkpoints(checkpoints)
    select_by = select_by or HEAD_GRAD_NAMES[norm]
    get_readout(select_by)
    probe_args = dict(source=data, labels=labels, limit=limit, seed=seed, batch_size=batch_size)
    eval_args = None if eval_data is None else dict(source=eval_data, labels=eval_labels,
                                                    seed=seed, batch_size=batch_size)
    options = dict(head=head, features=features, targets=targets, norm=norm,
                   include_bias=include_bias, providers=providers)
    with open_executor(executor, jobs) as ex:
        scored = score_checkpoints(series, probe_args, eval_args, options=options, jobs=jobs,
                                   progress=progress, executor=ex)
        ran_on = ex.describe()
    ok = [s for s in scored if s.error is None]
    if not ok:
        raise OnnxDiagError(f"No checkpoint could be scored; the first error was: "
                            f"{scored[0].error}")
    params = dict(checkpoints=[str(c) for c in checkpoints], data=data, labels=labels,
                  eval_data=eval_data, eval_labels=eval_labels, limit=limit, seed=seed,
                  batch_size=batch_size, providers=providers, head=head, features=features,
                  targets=targets, norm=norm, include_bias=include_bias, window=window,
                  patience=patience, select_by=select_by, jobs=jobs, executor=str(executor or
                                                                                  "local"))
    section = summarize_series(ok, window=window, patience=patience, select_by=select_by,
                               has_eval=eval_data is not None)
    section["checkpoints"] = [s.to_dict() for s in scored]
    section["failed"] = [{"path": s.checkpoint.path, "error": s.error} for s in scored
                         if s.error is not None]
    meta = build_metadata(command="select", parameters=params,
                          data={"probe": ok[0].result["data"]})
    meta["executor"] = ran_on
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "selection": section}
    text = render_selection(section, ok, select_by)
    table = rows_to_csv([{"index": s.checkpoint.index, "step": s.checkpoint.step,
                          "flagged": i in section["flagged"],
                          "selected": i == section.get("selected"),
                          **readout_row(s.checkpoint.path, s.result)}
                         for i, s in enumerate(ok)])
    return finish_old("select", report, text, text, folder, overwrite, csv=table,
                   csv_name="checkpoints.csv")


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
        acc = [s.result["evaluation"]["accuracy"] for s in ok]
        loss = [s.result["evaluation"]["loss"] for s in ok]
        out["accuracy"], out["loss"] = acc, loss
        if zoo:
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


def render_selection(section: dict, ok, select_by: str) -> str:
    """Readout-vs-checkpoint table, the choice, and (with labels) how good it was."""
    from ..report import render_table

    rows = []
    for i, s in enumerate(ok):
        vals = s.result["readouts"]["values"]
        row = {"#": i, "checkpoint": _short(s.checkpoint.path), "step": s.checkpoint.step}
        row.update({n: vals.get(n) for n in TABLE_READOUTS if n in vals})
        if "accuracy" in section:
            row["top1 %"] = 100 * section["accuracy"][i]
        row["flag"] = "degenerate" if i in section["flagged"] else ""
        rows.append(row)
    lines = ["== Checkpoints ==", render_table(rows).rstrip()]
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
        lines += ["", _render_evaluation(section["evaluation"])]
    if "screening" in section:
        srows = [{"readout": n, "spearman": r["spearman"], "kendall": r["kendall"],
                  "params spearman": r["baseline_spearman"],
                  "sign": "WRONG" if r["wrong_sign"] else "ok"}
                 for n, r in section["screening"].items()]
        lines += ["", render_table(srows, title="== Screening (architectures ranked) ==").rstrip()]
    return "\n".join(lines) + "\n"


def _render_evaluation(ev: dict) -> str:
    from ..report import render_table

    rows = []
    for name, r in ev["readouts"].items():
        sel = r.get("selected") or {}
        rows.append({"readout": name, "better": r["direction"],
                     "pearson": r["vs_accuracy"]["pearson"],
                     "spearman": r["vs_accuracy"]["spearman"],
                     "pick": sel.get("index"), "top1 %": _pct(sel.get("accuracy")),
                     "gap pp": sel.get("gap_window_pp"), "gap all pp": sel.get("gap_overall_pp"),
                     "sign": "WRONG" if r["wrong_sign"] else ""})
    o, last, rnd = ev["oracle_window"], ev["last"], ev["random"]
    lines = ["== Selection vs labels (SPEC A3) ==", render_table(rows).rstrip(),
             f"oracle in window: #{o['index']} {_pct(o['accuracy']):.2f} %; best overall: "
             f"#{ev['oracle_overall']['index']} {_pct(ev['oracle_overall']['accuracy']):.2f} %",
             f"baselines: last checkpoint gap {last['gap_window_pp']:.2f} pp; random checkpoint "
             f"expected gap {rnd['gap_window_pp']:.2f} pp"]
    wrong = [n for n, r in ev["readouts"].items() if r["wrong_sign"]]
    if wrong:
        lines.append("WARNING: on this run the correlation with accuracy has the WRONG SIGN for: "
                     + ", ".join(wrong) + " — do not select with these here.")
    return "\n".join(lines)


def _pct(x):
    return None if x is None else 100.0 * x


def _short(path: str) -> str:
    return Path(path).name
