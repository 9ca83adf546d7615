"""The ``analyze``, ``inspect`` and ``readouts`` verbs: structure, readouts,
evaluation of one model (``analyze`` adds the channel axes and repairability)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, rows_to_csv, to_jsonable
from ..report.sections import render_readouts, render_structure
from .base import (
    CommandResult,
    DataRequest,
    HeadChoice,
    ReportTarget,
    Runtime,
    describe_sources,
    find_structure,
    finish,
    render_header,
    resolve_model,
)


@dataclass(frozen=True)
class ReadoutOptions:
    """Options of ``analyze`` and ``readouts`` (docs/METHODS.md §A1–A2).

    ``targets``: head-gradient targets, ``labels``, ``pseudo`` (argmax) or ``expected``
    (label-free); ``auto`` = labels when the probe data has them. ``norm``: the
    head-gradient normalisation used to select (``raw``, ``feature``, ``head``).
    ``include_bias``: add the bias gradient to the norm. ``seed``: random choices of the
    channel statistics (``analyze``). ``ignore_index``: the label-map value of ignored
    positions for a per-position head (docs/METHODS.md §A4).
    """

    targets: str = "auto"
    norm: str = "feature"
    include_bias: bool = False
    seed: int = 0
    ignore_index: int = 255


def inspect_model(model=None, *, head: HeadChoice = HeadChoice()):  # noqa: B008
    """Structure of a model and its text rendering (``onnxdiag inspect``):
    ``(Structure, text)``. ``model`` defaults to the bundled sample."""
    from ..graph import analyze_structure
    from ..model.io import load_model

    path, _ = resolve_model(model)
    m = load_model(path)
    structure = analyze_structure(m, head=head.head, features=head.features)
    return structure, render_structure({**to_jsonable(structure.to_dict()),
                                        "topology_hash": topology_of(m)})


def topology_of(model=None) -> str:
    """The topology hash of a model (a path, or loaded; None: the bundled sample): its
    architecture without weights (docs/METHODS.md §A5)."""
    from ..model.io import load_model
    from ..model.topology import topology_hash

    if model is None or not hasattr(model, "graph"):
        model = load_model(resolve_model(model)[0])
    return topology_hash(model)


def analyze(model=None, *, data=None, eval_data=None,
            options: ReadoutOptions = ReadoutOptions(),  # noqa: B008 (frozen records)
            head: HeadChoice = HeadChoice(),  # noqa: B008
            runtime: Runtime = Runtime(),  # noqa: B008
            report: ReportTarget = ReportTarget(),  # noqa: B008
            ) -> CommandResult:
    """The main job (``onnxdiag analyze``): structure, readouts, evaluation, channel axes
    and repairability of one model.

    With ``model=None`` the bundled sample is used, with its calibration data as the
    probe batch and its evaluation sample as ``eval_data``; a request without a source
    (``DataRequest(None, limit=256)``) keeps its settings for that default data.
    Without ``data`` only the structure is reported. The report folder is claimed
    before any work (``report.claim``). Never modifies the model file.
    """
    path, sample = resolve_model(model)
    data, eval_data = DataRequest.of(data), DataRequest.of(eval_data)
    if sample is not None:
        data = _with_default(data, sample.calibration)
        eval_data = _with_default(eval_data, sample.evaluation)
    roles = {"data": _given(data), "eval_data": _given(eval_data)}
    return _single_model_report("analyze", path, roles, options, head, runtime, report)


def readouts_report(model, *, data, eval_data=None,
                    options: ReadoutOptions = ReadoutOptions(),  # noqa: B008 (frozen records)
                    head: HeadChoice = HeadChoice(),  # noqa: B008
                    runtime: Runtime = Runtime(),  # noqa: B008
                    report: ReportTarget = ReportTarget(),  # noqa: B008
                    ) -> CommandResult:
    """Readouts of one model on a probe batch (``onnxdiag readouts``), with accuracy and
    loss on ``eval_data`` when given (docs/METHODS.md §A2)."""
    roles = {"data": DataRequest.of(data), "eval_data": DataRequest.of(eval_data)}
    if roles["data"] is None:
        raise OnnxDiagError("readouts need a probe batch: pass --data (data=...) with samples "
                            "of the model's inputs.")
    return _single_model_report("readouts", model, roles, options, head, runtime, report)


def _with_default(request, source) -> DataRequest:
    if request is None:
        return DataRequest(source)
    return request if request.source is not None else dataclasses.replace(request,
                                                                          source=source)


def _given(request):
    return None if request is None or request.source is None else request


def run_parameters(options, head: HeadChoice, runtime: Runtime, **roles) -> dict:
    """``metadata.parameters``: every option (defaults included), each data role's
    request (``roles``: {keyword: DataRequest or None}), the head choice and providers."""
    return {**dataclasses.asdict(options),
            **{role: None if req is None else req.params() for role, req in roles.items()},
            "head": head.head, "features": head.features, "providers": runtime.providers}


def _single_model_report(command, path, roles, options, head, runtime, report):
    from ..model.io import get_input_specs, load_model, model_hash

    with report.claim(command) as claim:
        model = load_model(path)
        structure = find_structure(model, head, roles["data"] or roles["eval_data"],
                                   providers=runtime.providers)
        specs = get_input_specs(model)
        classes = structure.head.n_classes if structure.head is not None else None
        probe, evaluation = (None if req is None else
                             open_checked(req, specs, classes, options.ignore_index)
                             for req in (roles["data"], roles["eval_data"]))
        sections, texts, runner = _sections(command, path, model, structure, probe,
                                            evaluation, options, runtime)
        meta = build_metadata(command=command, model_path=path, model_hash=model_hash(model),
                              parameters=run_parameters(options, head, runtime, **roles),
                              runner=runner,
                              data=describe_sources(calibration=probe, evaluation=evaluation))
        result = {"schema": SCHEMA_VERSION, "metadata": meta, **sections}
        text = render_header(meta) + "\n".join(texts)
        table = None
        if "readouts" in sections:
            table = rows_to_csv([readout_row(path, to_jsonable(sections["readouts"]))])
        return finish(command, result, text, claim, report.overwrite, csv=table,
                      csv_name="readouts.csv")


def open_checked(request, specs, classes, ignore_index: int):
    """``request`` opened for ``specs`` with its labels checked against ``classes`` (label
    maps may also hold ``ignore_index``), before any work."""
    from ..data.labels import check_label_range

    source = request.open(specs)
    if classes and source.has_labels:
        check_label_range(source, classes, ignore_index=ignore_index)
    return source


def _sections(command, path, model, structure, probe, evaluation, options, runtime):
    """({section: dict}, [text], head runner or None) of one model."""
    from ..evaluate import make_head_runner
    from ..selection.dense import render_dense
    from ..selection.probe import probe_model

    sections, texts, runner = {}, [], None
    if command == "analyze":
        sections["structure"] = structure.to_dict()
        texts.append(render_structure(to_jsonable(sections["structure"])))
    if probe is None:
        if command == "analyze":
            texts.append("== Readouts ==\nskipped: no --data given (readouts need a probe "
                         "batch).\n")
        return sections, texts, runner
    runner = make_head_runner(model, structure.head, providers=runtime.providers)
    result = probe_model(model, structure, probe, eval_source=evaluation,
                         targets=options.targets, norm=options.norm,
                         include_bias=options.include_bias, runner=runner,
                         label="Probing" if runtime.progress else None,
                         ignore_index=options.ignore_index)
    sections["readouts"] = result.to_dict()
    texts.append(render_readouts(to_jsonable(sections["readouts"]))
                 + render_dense(sections["readouts"]))
    if command == "analyze" and structure.head.dense:
        texts.append(_skip_dense(sections))
    elif command == "analyze":
        _analysis_sections(sections, texts, path, model, structure, probe, options, runtime)
    return sections, texts, runner


def _skip_dense(sections) -> str:
    """analyze on a per-position head: the channel and repairability sections need one
    target per image (docs/METHODS.md §B3), which a dense head does not define."""
    reason = ("the head is applied at every position (docs/METHODS.md §A4); the channel "
              "target T and the repairability agreement are defined per image only")
    sections["channels"] = {"skipped": reason, "layers": []}
    sections["repairability"] = {"skipped": reason}
    return f"== Channels and repairability ==\nskipped: {reason}.\n"


def _analysis_sections(sections, texts, path, model, structure, probe, options, runtime):
    """analyze's channel axes (§B2–B4) and repairability (§C2–C4) on the probe batch."""
    from .channels import channel_section

    sections["channels"], ch_text = channel_section(
        model, probe, structure, targets=options.targets, seed=options.seed,
        providers=runtime.providers, model_name=str(path),
        label="Channel statistics" if runtime.progress else None)
    texts.append(ch_text)
    sections["repairability"], rr_text = _repairability(model, probe, structure,
                                                        runtime.providers)
    texts.append(rr_text)


def _repairability(model, probe, structure, providers) -> tuple[dict, str]:
    """The RR section of analyze; a model without prunable layers gets a one-line note."""
    from .rr import repairability_section

    try:
        return repairability_section(model, probe, structure=structure, providers=providers)
    except OnnxDiagError as exc:
        return ({"skipped": str(exc)},
                f"== Repairability (docs/METHODS.md §C2) ==\nskipped: {exc}\n")


def readout_row(path, result: dict) -> dict:
    """One CSV row: model, every readout value, evaluation and the degenerate flag."""
    r = result["readouts"]
    row = {"model": str(path), **r["values"], "n_samples": r["n_samples"],
           "targets": r["targets"], "degenerate": r["degenerate"]}
    ev = result.get("evaluation") or {}
    row.update({"top1": ev.get("accuracy"), "eval_loss": ev.get("loss")})
    if ev.get("miou") is not None:
        row["miou"] = ev["miou"]
    return row
