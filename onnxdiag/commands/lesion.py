"""The ``lesion`` verb: lesion / substitute channels and test which score predicts the damage."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..channels.layers import score_collected
from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, render_table
from ..report.text import rows_to_csv
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
)
from .channels import fmt_nan3


@dataclass(frozen=True)
class LesionOptions:
    """The ``lesion`` verb's own options (``docs/METHODS.md §B5``).

    ``layers``: node names of the layers whose channels are lesioned (required).
    ``channels``: these channel indices in every layer (None: all, or ``sample``
    seeded random ones per layer). ``substitute``: also replace each channel by its
    ridge reconstruction from its peers (needs calibration data). ``pairs``: random
    channel pairs per layer for pair lesions. ``targets``, ``n_positions``, ``k_peers``,
    ``ridge``: the channel scores computed on the calibration data. ``seed``: every
    random choice.
    """

    layers: tuple
    channels: tuple | None = None
    sample: int | None = None
    substitute: bool = False
    pairs: int = 0
    targets: str = "auto"
    n_positions: int = 16
    k_peers: int = 10
    ridge: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        for name in ("layers", "channels"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))


def lesion_report(model, *, data=None, eval_data, options: LesionOptions,
                  head: HeadChoice = HeadChoice(),  # noqa: B008 - frozen records
                  runtime: Runtime = Runtime(),  # noqa: B008
                  report: ReportTarget = ReportTarget()) -> CommandResult:  # noqa: B008
    """Lesion channels (and substitute them from their peers) on labelled data
    (``docs/METHODS.md §B5``).

    ``eval_data``: the labelled evaluation :class:`~onnxdiag.commands.base.DataRequest`
    (or a path) the damage is measured on. ``data`` (calibration, unlabelled is fine)
    gives the channel scores and the peers' ridge coefficients: it is needed for
    ``options.substitute`` and for the damage test, which bins the channels by task
    information. Writes report.json, report.txt and lesions.csv (one row per lesion).
    """
    from ..channels.interventions import lesion_study
    from ..model.io import get_input_specs, load_model, model_hash

    folder = report.folder("lesion")
    request, eval_request = DataRequest.of(data), DataRequest.of(eval_data)
    if options.substitute and request is None:
        raise OnnxDiagError("--substitute needs calibration data (--data) to fit each channel's "
                            "peer reconstruction; pass --data FILE.")
    m = load_model(model)
    structure = find_structure(m, head, request or eval_request,
                               providers=runtime.providers)
    _check_layers(options.layers, structure)
    specs = get_input_specs(m)
    classes = structure.head.n_classes
    evaluation = eval_request.open(specs, classes=classes)
    source = None if request is None else request.open(specs, classes=classes)
    scores = _channel_scores(m, structure, source, options, runtime)
    o = options
    study = lesion_study(m, structure, evaluation, layers=list(o.layers),
                         channels={la: list(o.channels) for la in o.layers} if o.channels
                         else None, sample=o.sample, seed=o.seed, scores=scores,
                         substitute=o.substitute, pairs=o.pairs, providers=runtime.providers,
                         progress_label="Lesions" if runtime.progress else None)
    section = _section(study, scores)
    params = {"model": str(model), **dataclasses.asdict(options),
              "data": None if request is None else request.params(),
              "eval_data": eval_request.params(), "head": head.head,
              "features": head.features, "providers": runtime.providers}
    meta = build_metadata(providers=runtime.providers,
                          command="lesion", parameters=params, model_path=model,
                          model_hash=model_hash(m),
                          data=describe_sources(calibration=source, evaluation=evaluation))
    out = {"schema": SCHEMA_VERSION, "metadata": meta, "lesion": section}
    text = render_header(meta) + render_lesions(section)
    return finish("lesion", out, text, folder, report.overwrite,
                  csv=rows_to_csv(section["rows"]), csv_name="lesions.csv")


def _channel_scores(model, structure, source, options: LesionOptions, runtime) -> dict:
    """{layer: ChannelScores} of the lesioned layers from ``source``; {} without data."""
    if source is None:
        return {}
    from ..channels.collect import collect_channel_moments

    stats = collect_channel_moments(model, structure, source, layers=options.layers,
                                    n_positions=options.n_positions, targets=options.targets,
                                    seed=options.seed, providers=runtime.providers,
                                    label="Channel statistics" if runtime.progress else None)
    scored = score_collected(model, stats, structure, k_peers=options.k_peers,
                             ridge=options.ridge)
    return {name: s for name, (_, s, _) in scored.items()}


def _section(study, scores: dict) -> dict:
    """The report section: the study, its rows and (with scores) the damage test."""
    from ..channels.clustering import damage_test

    section = {"study": study.to_dict(), "rows": study.to_rows()}
    rows = [r for r in section["rows"] if r.get("task_info") is not None]
    if scores and len(rows) >= 8:
        section["damage_test"] = damage_test(
            np.array([r["damage"] for r in rows]), np.array([r["task_info"] for r in rows]),
            np.array([r["peer_r2"] for r in rows]),
            np.array([r["input_capture"] for r in rows]))
    return section


def _check_layers(layers, structure) -> None:
    """A one-line user error unless every name in ``layers`` is a layer of the model."""
    names = [la.node_name for la in structure.layers]
    for name in layers or [None]:
        if name not in names:
            what = "No layer to lesion" if name is None else \
                f"Layer {name!r} is not in the model"
            raise OnnxDiagError(f"{what} (first 5 of {len(names)}: {', '.join(names[:5])}); "
                                "name one with --layer; `onnxdiag inspect MODEL` lists the "
                                "layers.")


def render_lesions(section: dict) -> str:
    """Per-layer damage / recovery summary and the damage test."""
    study = section["study"]
    base = study["base"]
    lines = ["== Lesions (docs/METHODS.md §B5) ==",
             f"base: top-1 {100 * base['accuracy']:.2f} %, loss {base['loss']:.4f} on "
             f"{base['n_samples']} labelled samples; {study['timing']['n_edits']} edited models, "
             f"{study['timing']['seconds_per_edit'] or 0:.3f} s each"]
    rows = []
    for layer in study["params"]["layers"]:
        ls = [r for r in study["lesions"] if r["layer"] == layer]
        dmg = np.array([r["damage"] for r in ls])
        rec = np.array([r["recovery"] for r in ls if r["recovery"] is not None])
        rows.append({"layer": layer, "channels": len(ls), "mean damage": float(dmg.mean()),
                     "max damage": float(dmg.max()),
                     "mean acc drop pp": float(np.mean([r["acc_drop"] for r in ls])),
                     "median recovery": float(np.median(rec)) if rec.size else None})
    lines.append(render_table(rows).rstrip())
    if study["pairs"]:
        ex = np.array([p["excess"] for p in study["pairs"]])
        lines.append(f"pair lesions: {len(ex)}, mean excess damage {ex.mean():.4g}")
    test = section.get("damage_test")
    if test:
        pooled = test["pooled"]
        cells = ", ".join(f"{k} {fmt_nan3(v.get('spearman'))}" for k, v in pooled.items()
                          if isinstance(v, dict))
        lines.append(f"which score predicts damage (Spearman, pooled over {test['n']} channels): "
                     f"{cells}")
        for b in test["bins"]:
            sp = ", ".join(f"{k} {fmt_nan3(v.get('spearman'))}" for k, v in b["spearman"].items())
            lines.append(f"  task-info bin {b['bin']} (n={b['n']}): {sp}")
    lines += [f"note: {n}" for n in study["notes"]]
    return "\n".join(lines) + "\n"
