"""``select --prune S`` / ``--prune-channels R``: choose the checkpoint that survives
compression (docs/METHODS.md §A5).

Each checkpoint is one unit of work on the executor (:func:`~.select_prune_unit.prune_unit`):
dense readouts, the pruned + repaired model (the pruning verbs' own steps), its readouts
and its agreement with its own dense model. The series is then ranked by the label-free
criteria of :mod:`onnxdiag.selection.pruned`; with labels each criterion's pick is scored
on the *pruned* accuracy against the oracle pruned checkpoint, next to "best dense, then
prune".
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import OnnxDiagError
from ..report import SCHEMA_VERSION, build_metadata, render_table, rows_to_csv
from .base import finish


def select_pruned_report(checkpoints, *, data, eval_data, options, prune, head, runtime,
                         report):
    """The ``select`` report with pruning (called by
    :func:`~onnxdiag.commands.select.select_report` when ``prune`` is given)."""
    from ..selection.checkpoints import list_checkpoints
    from ..selection.readouts import HEAD_GRAD_NAMES, get_readout

    prune.check()
    if prune.plan is not None and not Path(prune.plan).is_file():
        raise OnnxDiagError(f"Plan '{prune.plan}' does not exist; give the JSON written by "
                            "prune-channels --plan-out.")
    with report.claim("select") as claim:
        series = list_checkpoints(checkpoints)
        select_by = options.select_by or HEAD_GRAD_NAMES[options.norm]
        get_readout(select_by)
        if prune.write_pruned:
            Path(prune.write_pruned).mkdir(parents=True, exist_ok=True)
        units, sources, ran_on = _run_units(series, data, eval_data, options, prune, head,
                                            runtime)
        section = summarize_pruned(units, options, select_by, has_eval=eval_data is not None,
                                   rank_by=prune.rank_by)
        section["prune"] = _settings(prune)
        params = {"checkpoints": [str(c) for c in ([checkpoints] if isinstance(
            checkpoints, (str, Path)) else checkpoints)],
                  **dataclasses.asdict(dataclasses.replace(options, select_by=select_by)),
                  "prune": {**dataclasses.asdict(prune), "pruner": prune.pruner.params()},
                  "data": data.params(), "eval_data": None if eval_data is None
                  else eval_data.params(), "head": head.head, "features": head.features,
                  "providers": runtime.providers, "jobs": runtime.jobs,
                  "executor": runtime.executor_name()}
        meta = build_metadata(providers=runtime.providers, command="select",
                              parameters=params, data=sources)
        meta["executor"] = ran_on
        result = {"schema": SCHEMA_VERSION, "metadata": meta, "pruned_selection": section}
        return finish("select", result, render_pruned(section), claim, report.overwrite,
                      csv=_csv(section), csv_name="checkpoints.csv")


def _settings(prune) -> dict:
    if prune.structured:
        return {"kind": "channels", "ratio": prune.channels, "score": prune.score,
                "budget": prune.budget, "plan": prune.plan, "repair": prune.repair or "bn"}
    return {"kind": "unstructured", "sparsity": prune.sparsity,
            "allocation": prune.allocation, "repair": prune.repair or "cr+bn"}


def _run_units(series, data, eval_data, options, prune, head, runtime):
    """(one dict per checkpoint: the unit's result or its error, the data descriptions,
    the executor description); raises when every checkpoint failed."""
    from ..runtime.executor import open_executor, raise_failures, wants_gpu
    from ..selection.checkpoints import ScoringOptions, open_shared_data
    from .select_prune_unit import prune_unit

    shared = open_shared_data(series, data, eval_data)
    scoring = ScoringOptions(head=head.head, features=head.features, targets=options.targets,
                             norm=options.norm, include_bias=options.include_bias,
                             providers=runtime.providers, ignore_index=options.ignore_index)
    out = [None] * len(series)
    with open_executor(runtime.executor, runtime.jobs) as ex:
        if not ex.in_process and min(ex.capacity, len(series)) > 1:
            scoring = dataclasses.replace(scoring, threads=1)
        shipped = [None if d is None else ex.ship(d.request, d.source) for d in shared]
        label = "Pruning checkpoints" if runtime.progress else None
        for i, result, error in ex.map(prune_unit, series, (*shipped, scoring, prune),
                                       label=label, gpu=wants_gpu(runtime.providers)):
            c = series[i]
            out[i] = {"path": c.path, "index": c.index, "step": c.step, "error": error,
                      **(result or {})}
        ran_on = ex.describe()
    if not any(u["error"] is None for u in out):
        raise_failures([u["error"] for u in out],
                       "No checkpoint could be pruned and scored; the first error was: {first}")
    described = {role: d.description for role, d in zip(("calibration", "evaluation"), shared)
                 if d is not None}
    return out, described, ran_on


def summarize_pruned(units: list[dict], options, select_by: str, *, has_eval: bool,
                     rank_by: str = "agreement") -> dict:
    """The ``pruned_selection`` section: checkpoints, criteria, the label-free choice and
    ranking and, with labels, every criterion's gap to the oracle pruned checkpoint."""
    from ..selection.pruned import BEST_DENSE, criteria, ranking
    from ..selection.series import evaluate_selection, select_checkpoint

    ok = [u for u in units if u["error"] is None]
    targets = ok[0]["dense"]["readouts"]["targets"]
    series, directions, label_free = criteria(
        [u["dense"]["readouts"]["values"] for u in ok],
        [u["pruned"]["readouts"]["values"] for u in ok],
        [u["agreement"]["top1_agreement"] for u in ok], select_by=select_by, targets=targets)
    flagged = [i for i, u in enumerate(ok) if u["dense"]["readouts"]["degenerate"]]
    headline = rank_by if rank_by in series else "agreement"
    pick = select_checkpoint(series[headline], directions[headline], window=options.window,
                             flagged=flagged)
    topo = sorted({u["topology_hash"] for u in ok})
    out = {"n_scored": len(ok), "select_by": select_by, "targets": targets,
           "window": options.window, "flagged": flagged, "headline": headline,
           "selected": pick, "selected_path": ok[pick]["path"],
           "ranking": ranking(series, directions, headline), "topology_hashes": topo,
           "criteria": {n: {"direction": directions[n], "label_free": label_free[n],
                            "values": v} for n, v in series.items()},
           "checkpoints": units,
           "failed": [{"path": u["path"], "error": u["error"]} for u in units
                      if u["error"] is not None]}
    if has_eval and all(u[k]["evaluation"] for u in ok for k in ("dense", "pruned")):
        dense_acc = [u["dense"]["evaluation"]["accuracy"] for u in ok]
        pruned_acc = [u["pruned"]["evaluation"]["accuracy"] for u in ok]
        ev = evaluate_selection({**series, BEST_DENSE: dense_acc}, pruned_acc,
                                [u["pruned"]["evaluation"]["loss"] for u in ok],
                                window=options.window, patience=options.patience,
                                flagged=flagged, directions={**directions, BEST_DENSE: "higher"})
        out.update(dense_accuracy=dense_acc, pruned_accuracy=pruned_acc,
                   evaluation=ev.to_dict())
    return out


def _csv(section: dict) -> str:
    rows = []
    ok = [u for u in section["checkpoints"] if u["error"] is None]
    for i, u in enumerate(ok):
        row = {"index": u["index"], "path": u["path"], "step": u["step"],
               "selected": i == section["selected"],
               "topology_hash": u["topology_hash"], "pruned_sha256": u["pruned_sha256"]}
        row.update({n: c["values"][i] for n, c in section["criteria"].items()})
        if "pruned_accuracy" in section:
            row.update(dense_top1=section["dense_accuracy"][i],
                       pruned_top1=section["pruned_accuracy"][i])
        rows.append(row)
    return rows_to_csv(rows)


def render_pruned(section: dict) -> str:
    """Per-checkpoint table, the choice and ranking, and (with labels) the gaps."""
    ok = [u for u in section["checkpoints"] if u["error"] is None]
    sb, crit = section["select_by"], section["criteria"]
    rows = []
    for i, u in enumerate(ok):
        row = {"#": i, "checkpoint": Path(u["path"]).name,
               f"dense {sb}": crit[f"dense:{sb}"]["values"][i] if f"dense:{sb}" in crit
               else None,
               f"pruned {sb}": crit[f"pruned:{sb}"]["values"][i] if f"pruned:{sb}" in crit
               else None, "agree %": 100 * crit["agreement"]["values"][i]}
        if "combined" in crit:
            row["combined rank"] = crit["combined"]["values"][i]
        if "pruned_accuracy" in section:
            row["dense top1 %"] = 100 * section["dense_accuracy"][i]
            row["pruned top1 %"] = 100 * section["pruned_accuracy"][i]
        rows.append(row)
    p = section["prune"]
    what = (f"S = {p['sparsity']:g}, {p['allocation']}, repair {p['repair']}"
            if p["kind"] == "unstructured" else
            f"channels: plan {p['plan']}" if p.get("plan") else
            f"channels R = {p['ratio']:g}, {p['score']}, {p['budget']}, repair {p['repair']}")
    lines = [f"== Checkpoints, dense and pruned ({what}; docs/METHODS.md §A5) ==",
             render_table(rows).rstrip()]
    lines += [f"SKIPPED {f['path']}: {f['error']}" for f in section["failed"]]
    if len(section["topology_hashes"]) > 1:
        lines.append(f"note: {len(section['topology_hashes'])} architectures (topology "
                     "hashes) in this series")
    else:
        lines.append(f"topology hash {section['topology_hashes'][0][:16]}… (one architecture)")
    lines.append(f"selected by {section['headline']} (window {section['window']}): "
                 f"#{section['selected']} {section['selected_path']}")
    lines.append("ranking (best first, all checkpoints): "
                 + ", ".join(f"#{i}" for i in section["ranking"]))
    if "evaluation" in section:
        lines += ["", _render_gaps(section)]
    return "\n".join(lines) + "\n"


def _render_gaps(section: dict) -> str:
    from ..selection.pruned import BEST_DENSE

    ev, crit = section["evaluation"], section["criteria"]
    rows = []
    for name, r in ev["readouts"].items():
        sel = r.get("selected") or {}
        rows.append({"criterion": name, "label-free": "no" if name == BEST_DENSE else
                     ("yes" if crit[name]["label_free"] else "no"),
                     "spearman": r["vs_accuracy"]["spearman"], "pick": sel.get("index"),
                     "pruned top1 %": None if sel.get("accuracy") is None
                     else 100 * sel["accuracy"], "gap pp": sel.get("gap_window_pp")})
    o = ev["oracle_window"]
    bd = (ev["readouts"][BEST_DENSE].get("selected") or {})
    return "\n".join([
        "== Selection for the pruned model vs labels: gap to the oracle pruned checkpoint ==",
        render_table(rows).rstrip(),
        f"oracle pruned checkpoint in window: #{o['index']} {100 * o['accuracy']:.2f} %; best "
        f"dense then prune: #{bd.get('index')} (gap {bd.get('gap_window_pp', float('nan')):.2f}"
        f" pp); last checkpoint gap {ev['last']['gap_window_pp']:.2f} pp; random "
        f"{ev['random']['gap_window_pp']:.2f} pp"])
