"""The library functions behind the CLI verbs (same names, same parameters).

Each returns a :class:`CommandResult`: the JSON-ready report, a text summary, and
the report folder it was written to (``out=None`` with ``write=False`` writes
nothing). Inputs are validated and the output folder checked before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import OnnxDiagError
from .report import (
    SCHEMA_VERSION,
    build_metadata,
    rows_to_csv,
    to_json,
    to_jsonable,
    write_report,
)
from .report.sections import render_readouts, render_structure

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
    from .sample import get_sample

    sample = get_sample()
    return sample.model, sample


def inspect_model(model=None, *, head=None, features=None):
    """Structure of a model and its text rendering (``onnxdiag inspect``)."""
    from .graph import analyze_structure
    from .model_io import load_model

    path, _ = resolve_model(model)
    structure = analyze_structure(load_model(path), head=head, features=features)
    return structure, render_structure(to_jsonable(structure.to_dict()))


def _check_out(out, command: str, overwrite: bool, write: bool) -> Path | None:
    """Fail before any work when the report folder cannot be written."""
    if not write:
        return None
    from .report.write import check_report_folder

    return check_report_folder(Path(out) if out else DEFAULT_REPORT_ROOT / command,
                               overwrite=overwrite)


def _open(source, specs, *, labels=None, limit=None, seed=0, batch_size=64):
    from .data import open_data

    return open_data(source, specs, labels=labels, limit=limit, seed=seed, batch_size=batch_size)


def _finish(command: str, report: dict, text: str, summary: str, folder,
            overwrite, *, csv: str | None = None, csv_name: str | None = None) -> CommandResult:
    """Write the report folder (report.json, report.txt, the CSV table when given)."""
    if folder is not None:
        files = {"report.json": to_json(report), "report.txt": text}
        if csv is not None:
            files[csv_name or f"{command}.csv"] = csv
        write_report(folder, files, overwrite=overwrite)
    return CommandResult(report=report, summary=summary, text=text, folder=folder, csv=csv)


def analyze(model=None, *, data=None, labels=None, eval_data=None, eval_labels=None,
            limit=None, seed=0, batch_size=64, providers=None, head=None, features=None,
            targets="auto", norm="feature", include_bias=False, out=None, overwrite=False,
            write=True) -> CommandResult:
    """The main job (``onnxdiag analyze``): structure, readouts, evaluation of one model.

    With ``model=None`` the bundled sample is used with its calibration data as the
    probe batch and its evaluation sample as ``eval_data``.
    """
    path, sample = resolve_model(model)
    if sample is not None:
        data = data if data is not None else sample.calibration
        eval_data = eval_data if eval_data is not None else sample.evaluation
    params = dict(data=data, labels=labels, eval_data=eval_data, eval_labels=eval_labels,
                  limit=limit, seed=seed, batch_size=batch_size, providers=providers,
                  head=head, features=features, targets=targets, norm=norm,
                  include_bias=include_bias)
    return _single_model_report("analyze", path, params, out=out, overwrite=overwrite,
                                write=write, structure_section=True)


def readouts_report(model, *, data, labels=None, eval_data=None, eval_labels=None, limit=None,
                    seed=0, batch_size=64, providers=None, head=None, features=None,
                    targets="auto", norm="feature", include_bias=False, out=None,
                    overwrite=False, write=True) -> CommandResult:
    """Readouts of one model on a probe batch (``onnxdiag readouts``)."""
    params = dict(data=data, labels=labels, eval_data=eval_data, eval_labels=eval_labels,
                  limit=limit, seed=seed, batch_size=batch_size, providers=providers,
                  head=head, features=features, targets=targets, norm=norm,
                  include_bias=include_bias)
    return _single_model_report("readouts", model, params, out=out, overwrite=overwrite,
                                write=write, structure_section=False)


def _single_model_report(command, path, p, *, out, overwrite, write, structure_section):
    from .graph import analyze_structure
    from .model_io import get_input_specs, load_model, model_hash
    from .probe import make_head_runner, probe_model

    folder = _check_out(out, command, overwrite, write)
    model = load_model(path)
    structure = analyze_structure(model, head=p["head"], features=p["features"])
    specs = get_input_specs(model)
    probe = evaluation = runner = None
    if p["data"] is not None:
        probe = _open(p["data"], specs, labels=p["labels"], limit=p["limit"], seed=p["seed"],
                      batch_size=p["batch_size"])
    if p["eval_data"] is not None:
        evaluation = _open(p["eval_data"], specs, labels=p["eval_labels"], seed=p["seed"],
                           batch_size=p["batch_size"])
    sections, texts = {}, []
    if structure_section:
        sections["structure"] = structure.to_dict()
        texts.append(render_structure(to_jsonable(sections["structure"])))
    if probe is not None:
        runner = make_head_runner(model, structure.head, providers=p["providers"])
        result = probe_model(model, structure, probe, eval_source=evaluation,
                             targets=p["targets"], norm=p["norm"],
                             include_bias=p["include_bias"], runner=runner,
                             label="Probing")
        sections["readouts"] = result.to_dict()
        texts.append(render_readouts(to_jsonable(sections["readouts"])))
        if command == "analyze":
            from .channel_report import channel_section

            sections["channels"], ch_text = channel_section(
                model, probe, structure, targets=p["targets"], seed=p["seed"],
                providers=p["providers"], model_name=str(path), label="Channel statistics")
            texts.append(ch_text)
            sections["repairability"], rr_text = _repairability(model, probe, structure, p)
            texts.append(rr_text)
    elif command == "analyze":
        texts.append("== Readouts ==\nskipped: no --data given (readouts need a probe batch).\n")
    meta = build_metadata(command=command, parameters=p, model_path=path,
                          model_hash=model_hash(model), runner=runner,
                          data={"probe": probe.describe() if probe else None,
                                "eval": evaluation.describe() if evaluation else None})
    report = {"schema": SCHEMA_VERSION, "metadata": meta, **sections}
    text = _header(meta) + "\n".join(texts)
    table = None
    if "readouts" in sections:
        table = rows_to_csv([_readout_row(path, to_jsonable(sections["readouts"]))])
    return _finish(command, report, text, text, folder, overwrite, csv=table,
                   csv_name="readouts.csv")


def _repairability(model, probe, structure, p) -> tuple[dict, str]:
    """The RR section of analyze; a model without prunable layers gets a one-line note."""
    from .sparse_report import repairability_section

    try:
        return repairability_section(model, probe, structure=structure,
                                     providers=p["providers"])
    except OnnxDiagError as exc:
        return ({"skipped": str(exc)},
                f"== Repairability (SPEC C2) ==\nskipped: {exc}\n")


def _readout_row(path, result: dict) -> dict:
    """One CSV row: model, every readout value, evaluation and the degenerate flag."""
    r = result["readouts"]
    row = {"model": str(path), **r["values"], "n_samples": r["n_samples"],
           "targets": r["targets"], "degenerate": r["degenerate"]}
    ev = result.get("evaluation") or {}
    row.update({"top1": ev.get("accuracy"), "eval_loss": ev.get("loss")})
    return row


def _header(meta: dict) -> str:
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



# --------------------------------------------------------------------------- select

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
    from .checkpoints import list_checkpoints, score_checkpoints
    from .executor import open_executor
    from .readouts import HEAD_GRAD_NAMES, get_readout

    folder = _check_out(out, "select", overwrite, write)
    series = list_checkpoints(checkpoints)
    select_by = select_by or HEAD_GRAD_NAMES[norm]
    get_readout(select_by)
    probe_args = dict(source=data, labels=labels, limit=limit, seed=seed, batch_size=batch_size)
    eval_args = None if eval_data is None else dict(source=eval_data, labels=eval_labels,
                                                    seed=seed, batch_size=batch_size)
    options = dict(head=head, features=features, targets=targets, norm=norm,
                   include_bias=include_bias, providers=providers)
    ex, own = open_executor(executor, jobs)
    try:
        scored = score_checkpoints(series, probe_args, eval_args, options=options, jobs=jobs,
                                   progress=progress, executor=ex)
        ran_on = ex.describe()
    finally:
        if own:
            ex.close()
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
                          **_readout_row(s.checkpoint.path, s.result)}
                         for i, s in enumerate(ok)])
    return _finish("select", report, text, text, folder, overwrite, csv=table,
                   csv_name="checkpoints.csv")


def _series_values(ok, name: str) -> list[float]:
    return [s.result["readouts"]["values"].get(name, float("nan")) for s in ok]


def summarize_series(ok, *, window, patience, select_by: str, has_eval: bool) -> dict:
    """Selection (and, with labels, its evaluation) over successfully scored checkpoints."""
    from .readouts import READOUTS
    from .selection import early_stop, evaluate_selection, rank_models, select_checkpoint

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
    from .report import render_table

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
    from .report import render_table

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
