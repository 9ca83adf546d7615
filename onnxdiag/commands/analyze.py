"""The ``analyze``, ``inspect`` and ``readouts`` verbs: structure, readouts,
evaluation of one model."""

from __future__ import annotations

from ..errors import OnnxDiagError
from ..report import (
    SCHEMA_VERSION,
    build_metadata,
    rows_to_csv,
    to_jsonable,
)
from ..report.sections import render_readouts, render_structure
from .base import CommandResult, check_out, finish_old, open_source, render_header, resolve_model


def inspect_model(model=None, *, head=None, features=None):
    """Structure of a model and its text rendering (``onnxdiag inspect``)."""
    from ..graph import analyze_structure
    from ..model.io import load_model

    path, _ = resolve_model(model)
    structure = analyze_structure(load_model(path), head=head, features=features)
    return structure, render_structure(to_jsonable(structure.to_dict()))


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
    from ..evaluate import make_head_runner
    from ..graph import analyze_structure
    from ..model.io import get_input_specs, load_model, model_hash
    from ..selection.probe import probe_model

    folder = check_out(out, command, overwrite, write)
    model = load_model(path)
    structure = analyze_structure(model, head=p["head"], features=p["features"])
    specs = get_input_specs(model)
    probe = evaluation = runner = None
    if p["data"] is not None:
        probe = open_source(p["data"], specs, labels=p["labels"], limit=p["limit"], seed=p["seed"],
                      batch_size=p["batch_size"])
    if p["eval_data"] is not None:
        evaluation = open_source(p["eval_data"], specs, labels=p["eval_labels"], seed=p["seed"],
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
            from .channels import channel_section

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
    text = render_header(meta) + "\n".join(texts)
    table = None
    if "readouts" in sections:
        table = rows_to_csv([readout_row(path, to_jsonable(sections["readouts"]))])
    return finish_old(command, report, text, text, folder, overwrite, csv=table,
                   csv_name="readouts.csv")


def _repairability(model, probe, structure, p) -> tuple[dict, str]:
    """The RR section of analyze; a model without prunable layers gets a one-line note."""
    from .rr import repairability_section

    try:
        return repairability_section(model, probe, structure=structure,
                                     providers=p["providers"])
    except OnnxDiagError as exc:
        return ({"skipped": str(exc)},
                f"== Repairability (SPEC C2) ==\nskipped: {exc}\n")


def readout_row(path, result: dict) -> dict:
    """One CSV row: model, every readout value, evaluation and the degenerate flag."""
    r = result["readouts"]
    row = {"model": str(path), **r["values"], "n_samples": r["n_samples"],
           "targets": r["targets"], "degenerate": r["degenerate"]}
    ev = result.get("evaluation") or {}
    row.update({"top1": ev.get("accuracy"), "eval_loss": ev.get("loss")})
    return row
