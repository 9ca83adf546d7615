"""The ``lesion`` verb: lesion / substitute channels and test which score predicts the damage."""

from __future__ import annotations

import numpy as np

from ..channels.layers import score_collected
from ..report import SCHEMA_VERSION, build_metadata, render_table
from ..report.text import dict_rows_csv
from .base import CommandResult, check_out, finish_old, open_source, render_header
from .channels import fmt_nan3


def lesion_report(model, *, eval_data, layers, eval_labels=None, data=None, labels=None,
                  channels=None, sample=None, substitute=False, pairs=0, limit=None, seed=0,
                  batch_size=64, providers=None, head=None, features=None, targets="auto",
                  n_positions=16, k_peers=10, ridge=1e-3, out=None, overwrite=False,
                  write=True, progress=True) -> CommandResult:
    """Lesion channels (and substitute them from their peers) on labelled data (SPEC B5).

    ``data`` (calibration, unlabelled is fine) is needed for ``substitute`` and for the
    damage test: it gives the channel scores and the peers' ridge coefficients. The
    "which score predicts damage" test bins channels by task information.
    """
    from ..channels.clustering import damage_test
    from ..channels.collect import collect_channel_moments
    from ..channels.interventions import lesion_study
    from ..graph import analyze_structure
    from ..model.io import get_input_specs, load_model, model_hash

    folder = check_out(out, "lesion", overwrite, write)
    if substitute and data is None:
        from ..errors import OnnxDiagError

        raise OnnxDiagError("--substitute needs calibration data (--data) to fit each channel's "
                            "peer reconstruction; pass --data FILE.")
    m = load_model(model)
    structure = analyze_structure(m, head=head, features=features)
    known = {la.node_name for la in structure.layers}
    for name in layers:
        if name not in known:
            _unknown_layer(name, structure)
    specs = get_input_specs(m)
    evaluation = open_source(eval_data, specs, labels=eval_labels, seed=seed, batch_size=batch_size)
    scores = {}
    if data is not None:
        source = open_source(data, specs, labels=labels, limit=limit, seed=seed, batch_size=batch_size)
        stats = collect_channel_moments(m, structure, source, layers=layers,
                                        n_positions=n_positions, targets=targets, seed=seed,
                                        providers=providers,
                                        label="Channel statistics" if progress else None)
        scored = score_collected(m, stats, structure, k_peers=k_peers, ridge=ridge)
        scores = {name: s for name, (_, s, _) in scored.items()}
    study = lesion_study(m, structure, evaluation, layers=layers,
                         channels={la: channels for la in layers} if channels else None,
                         sample=sample, seed=seed, scores=scores, substitute=substitute,
                         pairs=pairs, providers=providers,
                         progress_label="Lesions" if progress else None)
    section = {"study": study.to_dict(), "rows": study.to_rows()}
    if scores:
        rows = [r for r in study.to_rows() if r.get("task_info") is not None]
        if len(rows) >= 8:
            section["damage_test"] = damage_test(
                np.array([r["damage"] for r in rows]), np.array([r["task_info"] for r in rows]),
                np.array([r["peer_r2"] for r in rows]),
                np.array([r["input_capture"] for r in rows]))
    params = dict(model=str(model), eval_data=eval_data, layers=list(layers),
                  channels=channels, sample=sample, substitute=substitute, pairs=pairs,
                  data=data, limit=limit, seed=seed, n_positions=n_positions, k_peers=k_peers,
                  ridge=ridge, targets=targets)
    meta = build_metadata(command="lesion", parameters=params, model_path=model,
                          model_hash=model_hash(m), data={"eval": evaluation.describe()})
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "lesion": section}
    text = render_header(meta) + render_lesions(section)
    return finish_old("lesion", report, text, text, folder, overwrite,
                   csv=dict_rows_csv(section["rows"]), csv_name="lesions.csv")


def _unknown_layer(name, structure):
    from ..errors import OnnxDiagError

    names = [la.node_name for la in structure.layers]
    raise OnnxDiagError(f"Layer {name!r} is not in the model (first 5 of {len(names)}: "
                        f"{', '.join(names[:5])}); `onnxdiag inspect MODEL` lists the layers.")


def render_lesions(section: dict) -> str:
    """Per-layer damage / recovery summary and the damage test."""
    study = section["study"]
    base = study["base"]
    lines = ["== Lesions (SPEC B5) ==",
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
