"""The ``orthogonality`` verb: update–information orthogonality over a checkpoint series
(docs/METHODS.md §B4).

For checkpoints θ_1..θ_T of one architecture, per analysed layer and step t: the cosine
between the weight update θ_{t+1} − θ_t and the closed-form gradients at θ_t of the
layer's total input capture Σ_i I_X(i) and total task information Σ_i I(T;Y_i)
(:mod:`onnxdiag.channels.gradients`), from one streaming pass per checkpoint over the
calibration data (:mod:`onnxdiag.channels.inputs`).  Also reported: the cosine between
the two gradients, the update's norm, and the chance level of |cos| for a random
direction in the layer's weight space, √(2 / (π d)) for d weights.  The same moments give
the higher-order structure by depth of the last checkpoint (§B4).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, render_table
from ..report.text import rows_to_csv
from .base import (
    CommandResult,
    DataRequest,
    HeadChoice,
    ReportTarget,
    Runtime,
    find_structure,
    finish,
    render_header,
)


@dataclass(frozen=True)
class OrthogonalityOptions:
    """Options of ``orthogonality`` (docs/METHODS.md §B4).

    ``targets``: "labels", "pseudo" or "auto" (labels when the data have them): the target
    T of the task information. ``n_positions``: sampled positions (tokens) per input.
    ``layers``: only these layers (None: every Conv with group 1 and every Gemm/MatMul
    with a constant weight and ≥ 4 outputs, head excluded). ``early``: how many first
    updates count as early training in the summary. ``seed``: the sampled positions.
    ``k_peers`` / ``ridge`` / ``triplet_partners``: the depth table (§B4).
    """

    targets: str = "auto"
    n_positions: int = 16
    layers: tuple | None = None
    early: int = 2
    seed: int = 0
    k_peers: int = 10
    ridge: float = 1e-3
    triplet_partners: int = 10

    def __post_init__(self):
        if self.layers is not None and not isinstance(self.layers, tuple):
            object.__setattr__(self, "layers", tuple(self.layers))


def orthogonality_report(checkpoints, *, data,
                         options: OrthogonalityOptions = OrthogonalityOptions(),  # noqa: B008
                         head: HeadChoice = HeadChoice(),  # noqa: B008 (frozen records)
                         runtime: Runtime = Runtime(),  # noqa: B008
                         report: ReportTarget = ReportTarget(),  # noqa: B008
                         ) -> CommandResult:
    """Update–information orthogonality of a checkpoint series (``onnxdiag orthogonality``).

    ``checkpoints``: .onnx files in training order, a folder or a JSON/CSV listing (at
    least 2, one architecture). ``data``: the calibration request. Writes report.json,
    report.txt and orthogonality.csv (one row per layer and update)."""
    from ..selection.checkpoints import list_checkpoints

    request = DataRequest.of(data)
    if request is None:
        raise OnnxDiagError("orthogonality needs calibration data: pass --data (data=...).")
    with report.claim("orthogonality") as claim:
        series = list_checkpoints(checkpoints)
        if len(series) < 2:
            raise OnnxDiagError(f"orthogonality needs at least 2 checkpoints; got "
                                f"{len(series)}. Pass a checkpoint series in training order.")
        passes = [_checkpoint_pass(c, request, options, head, runtime) for c in series]
        section = _section(series, passes, options)
        params = {"checkpoints": [c.path for c in series], **dataclasses.asdict(options),
                  "data": request.params(), "head": head.head, "features": head.features,
                  "providers": runtime.providers}
        meta = build_metadata(command="orthogonality", parameters=params,
                              model_path=series[-1].path, model_hash=passes[-1][3],
                              data={"calibration": passes[-1][1]})
        meta["model_hashes"] = [p[3] for p in passes]
        out = {"schema": SCHEMA_VERSION, "metadata": meta, "orthogonality": section}
        text = render_header(meta) + render_orthogonality(section)
        return finish("orthogonality", out, text, claim, report.overwrite,
                      csv=rows_to_csv(section["rows"]), csv_name="orthogonality.csv")


def _checkpoint_pass(checkpoint, request, options, head, runtime):
    """(InputMoments per layer, data description, targets, sha256) of one checkpoint."""
    from ..channels.inputs import collect_input_moments, find_input_layers
    from ..model.io import get_input_specs, load_model, model_hash
    from ..selection.probe import resolve_targets
    from .channels import refuse_dense

    model = load_model(checkpoint.path)
    structure = find_structure(model, head, request, providers=runtime.providers)
    refuse_dense(structure)
    source = request.open(get_input_specs(model), classes=structure.head.n_classes)
    targets = resolve_targets(options.targets, source.has_labels)
    if targets == "expected":
        raise OnnxDiagError("--targets expected applies to readouts only; use labels or "
                            "pseudo.")
    layers = find_input_layers(model, structure, options.layers)
    moments = collect_input_moments(
        model, structure, source, layers, targets=targets, n_positions=options.n_positions,
        seed=options.seed, providers=runtime.providers,
        label=f"Input moments {checkpoint.index}" if runtime.progress else None)
    return moments, source.describe(), targets, model_hash(model)


def _check_series(series, passes) -> list[str]:
    """The layer names shared by the series; OnnxDiagError when the architectures differ."""
    first = passes[0][0]
    for c, (moments, *_) in zip(series[1:], passes[1:]):
        shapes = {k: m.W.shape for k, m in moments.items()}
        if shapes != {k: m.W.shape for k, m in first.items()}:
            raise OnnxDiagError(f"Checkpoint {c.path!r} has other layers or weight shapes than "
                                f"{series[0].path!r}; orthogonality needs one architecture.")
    return list(first)


def update_rows(series, passes, layers: list[str]) -> list[dict]:
    """One row per layer and update t → t+1 (the cosines of the module docstring)."""
    from ..channels.gradients import cosine, information_gradients

    rows = []
    for depth, name in enumerate(layers):
        for t in range(len(series) - 1):
            now, nxt = passes[t][0][name], passes[t + 1][0][name]
            g = information_gradients(now.W, now.cov_x, now.cov_xt, now.var_t)
            delta = nxt.W - now.W
            rows.append({
                "layer": name, "depth": depth, "t": t, "from": series[t].path,
                "to": series[t + 1].path, "step_from": series[t].step,
                "step_to": series[t + 1].step,
                "cos_input_capture": cosine(delta, g.input_capture_grad),
                "cos_task_info": cosine(delta, g.task_info_grad),
                "cos_gradients": cosine(g.input_capture_grad, g.task_info_grad),
                "update_norm": float((delta ** 2).sum() ** 0.5),
                "input_capture": g.input_capture, "task_info": g.task_info,
                "chance_abs_cos": math.sqrt(2.0 / (math.pi * delta.size))})
    return rows


def _median_abs(values) -> float | None:
    values = sorted(abs(v) for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def summarize_updates(rows: list[dict], early: int) -> list[dict]:
    """Per layer: median |cos| over the first ``early`` updates and over the later ones."""
    out = []
    for name in dict.fromkeys(r["layer"] for r in rows):
        mine = [r for r in rows if r["layer"] == name]
        row = {"layer": name, "depth": mine[0]["depth"],
               "chance_abs_cos": mine[0]["chance_abs_cos"]}
        for key in ("cos_input_capture", "cos_task_info"):
            row[f"{key}_early"] = _median_abs(r[key] for r in mine if r["t"] < early)
            row[f"{key}_late"] = _median_abs(r[key] for r in mine if r["t"] >= early)
        out.append(row)
    return out


def _section(series, passes, options) -> dict:
    from .channels import depth_section

    layers = _check_series(series, passes)
    rows = update_rows(series, passes, layers)
    summary = summarize_updates(rows, options.early)
    overall = {k: _median_abs(r[k] for r in summary) for k in summary[0] if
               k.startswith("cos_") or k == "chance_abs_cos"}
    return {"checkpoints": [c.path for c in series], "steps": [c.step for c in series],
            "layers": layers, "targets": passes[-1][2], "n_positions": options.n_positions,
            "early": options.early, "rows": rows, "summary": summary, "overall": overall,
            "depth": depth_section(_higher_last(passes[-1][0], options))}


def _higher_last(moments: dict, options) -> dict:
    """The §B4 higher-order structure of the last checkpoint, from its input moments."""
    from ..channels.higher import higher_order_layer

    out = {}
    for name, m in moments.items():
        if m.W.shape[0] >= 3:
            cov_yy, cov_yt, var_t = m.output_moments()
            out[name] = higher_order_layer(cov_yy, cov_yy, cov_yt, var_t, layer=name,
                                           k_peers=options.k_peers, ridge=options.ridge,
                                           triplet_partners=options.triplet_partners)
    return out


def render_orthogonality(section: dict) -> str:
    """Per layer: cos(update, ∇ΣI_X) and cos(update, ∇ΣI(T;Y)) per update, the summary."""
    from .channels import render_depth

    n = len(section["checkpoints"]) - 1
    lines = ["== Update–information orthogonality (docs/METHODS.md §B4) ==",
             f"{n + 1} checkpoints, {len(section['layers'])} layers, targets="
             f"{section['targets']}; chance |cos| of a random direction: √(2/(π d))"]
    for key, what in (("cos_input_capture", "cos(Δθ, ∇ Σ I_X)"),
                      ("cos_task_info", "cos(Δθ, ∇ Σ I(T;Y))")):
        table = [{"layer": name, **{f"{t}→{t + 1}": r[key] for t in range(n)
                                    for r in section["rows"]
                                    if r["layer"] == name and r["t"] == t}}
                 for name in section["layers"]]
        lines.append(render_table(table, title=what).rstrip())
    summary = [{"layer": r["layer"], "chance": r["chance_abs_cos"],
                "|cos| I_X early": r["cos_input_capture_early"],
                "|cos| I_X late": r["cos_input_capture_late"],
                "|cos| I_T early": r["cos_task_info_early"],
                "|cos| I_T late": r["cos_task_info_late"]} for r in section["summary"]]
    lines.append(render_table(summary, title=f"median |cos| over the first {section['early']} "
                                             "updates (early) and the rest (late)").rstrip())
    o = section["overall"]
    lines.append("median over layers, late updates: |cos| with ∇ΣI_X "
                 f"{_fmt(o.get('cos_input_capture_late'))}, with ∇ΣI(T;Y) "
                 f"{_fmt(o.get('cos_task_info_late'))}, chance {_fmt(o.get('chance_abs_cos'))} "
                 "(published: nearly orthogonal to both after early training)")
    if section["depth"]["layers"]:
        lines.append(render_depth(section["depth"]) + "  (last checkpoint, from the input "
                                                       "moments)")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
