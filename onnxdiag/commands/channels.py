"""The ``channels`` verb: two-axis channel scores and their structure, per model or series."""

from __future__ import annotations

import numpy as np

from ..channels.layers import score_collected
from ..report import SCHEMA_VERSION, build_metadata, render_table
from ..report.text import dict_rows_csv
from .base import CommandResult, check_out, finish_old, open_source, render_header

#: Echoed into every report (SPEC: "our default" choices are parameters).
DEFAULTS = dict(n_positions=16, task_samples="match", k_peers=10, ridge=1e-3, k_clusters=4,
                null_quantile=0.95)


def channels_report(models, *, data, labels=None, limit=None, seed=0, batch_size=64,
                    providers=None, head=None, features=None, targets="auto",
                    task_samples="match", n_positions=16, k_peers=10, ridge=1e-3, layers=None,
                    executor=None, jobs=None, out=None, overwrite=False, write=True,
                    progress=True, tap="auto") -> CommandResult:
    """Two-axis channel scores and structure analyses (``onnxdiag channels``).

    ``models``: one model path, or several (a checkpoint series in training order) for
    the trajectory of the B4 statistics. Writes report.json, report.txt and
    channels.csv (one row per channel of the last model).

    ``executor``: ``local`` (default) with ``jobs`` worker processes (default 1: the
    single streaming pass in this process), ``ray`` / ``ray=HOST:PORT``, or an
    :class:`~onnxdiag.executor.Executor`. With more than one worker the calibration set
    is sharded into runs of whole batches, each worker streams its shard into the
    mergeable moments and the driver merges them
    (:func:`onnxdiag.collect.collect_channel_moments_sharded`): the same statistics to
    float64 rounding. ``tap``: where each layer's samples come from
    (:func:`onnxdiag.collect.choose_taps`; "output" forces ONNX Runtime's own conv outputs).
    """
    from ..channels.clustering import summarize_layers
    from ..channels.collect import collect_channel_moments, collect_channel_moments_sharded
    from ..graph import analyze_structure
    from ..model.io import get_input_specs, load_model, model_hash
    from ..runtime.executor import Executor, open_executor

    models = [models] if isinstance(models, (str, bytes)) or not hasattr(models, "__iter__") \
        else list(models)
    folder = check_out(out, "channels", overwrite, write)
    params = dict(models=[str(m) for m in models], data=data, labels=labels, limit=limit,
                  seed=seed, batch_size=batch_size, providers=providers, head=head,
                  features=features, targets=targets, task_samples=task_samples,
                  n_positions=n_positions, k_peers=k_peers, ridge=ridge, layers=layers,
                  tap=tap, executor=str(executor or "local") if not isinstance(executor, Executor)
                  else executor.name, jobs=jobs)
    with open_executor(executor, jobs, local_jobs=1) as ex:
        single = ex.in_process
        label = "Channel statistics" if progress else None
        per_model, hashes = [], []
        for path in models:
            model = load_model(path)
            structure = analyze_structure(model, head=head, features=features)
            opts = dict(layers=layers, n_positions=n_positions, task_samples=task_samples,
                        targets=targets, seed=seed, providers=providers, label=label, tap=tap)
            if single:  # one streaming pass here, as without an executor
                source = open_source(data, get_input_specs(model), labels=labels, limit=limit,
                               seed=seed, batch_size=batch_size)
                stats = collect_channel_moments(model, structure, source, **opts)
            else:
                stats = collect_channel_moments_sharded(
                    model, structure, data, executor=ex, labels=labels, limit=limit,
                    batch_size=batch_size, **opts)
            scored = score_collected(model, stats, structure, k_peers=k_peers, ridge=ridge)
            summary = summarize_layers([s for _, s, _ in scored.values()], seed=seed)
            per_model.append((path, stats, scored, summary))
            hashes.append(model_hash(model))
        ran_on = ex.describe()
    section = _section(per_model)
    meta = build_metadata(command="channels", parameters={**params, "defaults": DEFAULTS},
                          model_path=models[-1], model_hash=hashes[-1],
                          data={"probe": per_model[-1][1].data})
    meta["model_hashes"] = hashes
    meta["executor"] = ran_on
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "channels": section}
    text = render_header(meta) + render_channels(section)
    return finish_old("channels", report, text, text, folder, overwrite,
                   csv=channel_rows_csv(per_model[-1][2]), csv_name="channels.csv")


def _section(per_model) -> dict:
    path, stats, scored, summary = per_model[-1]
    layers = []
    for row in summary["layers"]:
        layer, scores, floor = scored[row["layer"]]
        r2 = scores.scores["peer_r2"]
        order = np.argsort(-r2, kind="stable")
        info = scores.scores.get("task_info")
        layers.append({
            **row, "bn_folded": bool(layer.bn_folded), "tap": stats.taps.get(row["layer"],
                                                                             "output"),
            "note": ("BN folded into the conv: y is post-BN; input_capture and signal_power "
                     "are scale-dependent, the rho-based scores are unchanged")
            if layer.bn_folded else "",
            "most_substitutable": order[:3].tolist(), "least_substitutable": order[-3:].tolist(),
            "median_peer_r2": float(np.median(r2)),
            "noise_floor": floor.to_dict(),
            "n_above_floor": None if info is None else floor.count_above(info),
            "scores": scores.to_dict(),
        })
    trajectory = [{"model": str(p), **{k: v for k, v in s["median"].items()}}
                  for p, _, _, s in per_model] if len(per_model) > 1 else []
    return {"model": str(path), "targets": stats.targets,
            "targets_flag": "pseudo-labels (predicted class), not ground truth"
            if stats.targets == "pseudo" else "",
            "task_samples": stats.task_samples, "n_positions": stats.n_positions,
            "n_images": stats.n_images, "median": summary["median"], "layers": layers,
            "trajectory": trajectory}


def channel_section(model, source, structure, *, targets="auto", seed=0, providers=None,
                    layers=None, n_positions=16, task_samples="match", k_peers=10, ridge=1e-3,
                    model_name: str = "", label: str | None = None,
                    tap: str = "auto") -> tuple[dict, str]:
    """The channel section of ``onnxdiag analyze``: ``(section dict, rendered text)``.

    One statistics pass over ``source`` (a DataSource, e.g. the probe batch), the scores
    and the B4 structure per layer; the summary per layer is the axis correlations, the
    ARI, the noise floor count and the most / least substitutable channels (by peer R²,
    with their R² values). Per-channel tables are left to ``onnxdiag channels``.
    ``model`` is a loaded ModelProto (never modified) and ``structure`` its
    :func:`onnxdiag.graph.analyze_structure`. ``targets="expected"`` (a readout-only
    choice) is treated as ``auto``. A model without an analysable conv (≥ 4 channels,
    not the head) gives ``{"skipped": reason, "layers": []}`` instead of an error, so
    ``analyze`` can always call it.
    """
    from ..channels.clustering import summarize_layers
    from ..channels.collect import collect_channel_moments, find_analysed_layers

    if targets == "expected":
        targets = "auto"
    if layers is None and not find_analysed_layers(structure):
        reason = "no conv layer with at least 4 output channels (head excluded)"
        return ({"skipped": reason, "layers": []},
                f"== Channels: two axes (SPEC B) ==\nskipped: {reason}.\n")
    stats = collect_channel_moments(model, structure, source, layers=layers,
                                    n_positions=n_positions, task_samples=task_samples,
                                    targets=targets, seed=seed, providers=providers,
                                    label=label, tap=tap)
    scored = score_collected(model, stats, structure, k_peers=k_peers, ridge=ridge)
    summary = summarize_layers([s for _, s, _ in scored.values()], seed=seed)
    section = _section([(model_name, stats, scored, summary)])
    for row in section["layers"]:
        r2 = row.pop("scores")["scores"]["peer_r2"]
        row["most_substitutable_r2"] = [float(r2[i]) for i in row["most_substitutable"]]
        row["least_substitutable_r2"] = [float(r2[i]) for i in row["least_substitutable"]]
    section["params"] = {"n_positions": n_positions, "task_samples": task_samples,
                         "k_peers": k_peers, "ridge": ridge, "seed": seed, "tap": tap}
    return section, render_channels(section)


def channel_rows_csv(scored) -> str:
    """One CSV row per channel: layer, channel, every score."""
    return dict_rows_csv([row for _, scores, _ in scored.values() for row in scores.to_rows()])


def render_channels(section: dict) -> str:
    """Per-layer summary: axis correlations, ARI, noise floor, substitutable channels."""
    rows = [{"layer": la["layer"], "C": la["n_channels"],
             "rho(I_X,I_T)": la.get("input_capture_vs_task_info"),
             "rho(R_X,Syn)": la.get("peer_overlap_vs_synergy"), "ARI": la.get("ari"),
             "med R2": la["median_peer_r2"],
             "I_T>floor": la["n_above_floor"],
             "most subst.": ",".join(map(str, la["most_substitutable"])),
             "least subst.": ",".join(map(str, la["least_substitutable"])),
             "BN": "folded" if la["bn_folded"] else "",
             "y from": "input" if la.get("tap") == "input" else ""}
            for la in section["layers"]]
    med = section["median"]
    lines = ["== Channels: two axes (SPEC B) ==",
             f"{section['n_images']} images x {section['n_positions']} positions, targets="
             f"{section['targets']}, task samples={section['task_samples']}",
             render_table(rows).rstrip(),
             "median over layers: spearman(I_X, I(T;Y)) = "
             f"{fmt_nan3(med.get('input_capture_vs_task_info'))}, spearman(R_X, Syn) = "
             f"{fmt_nan3(med.get('peer_overlap_vs_synergy'))}, ARI = {fmt_nan3(med.get('ari'))} "
             "(published, trained CIFAR-100 nets: ~0.01 and ARI ~0.02; ~0.7 at init)",
             "I_T>floor: channels whose task information exceeds the 95th percentile of the "
             "permutation control (T shuffled across images)."]
    if any(la.get("tap") == "input" for la in section["layers"]):
        lines.append("y from = input: the conv was evaluated in float64 at the sampled "
                     "positions from its input (far fewer values to copy out of ONNX "
                     "Runtime); other layers sample ONNX Runtime's conv output.")
    if section["targets_flag"]:
        lines.append(f"NOTE: targets are {section['targets_flag']}.")
    if section["trajectory"]:
        traj = [{"checkpoint": t["model"].rsplit("/", 1)[-1],
                 "rho(I_X,I_T)": t.get("input_capture_vs_task_info"),
                 "rho(R_X,Syn)": t.get("peer_overlap_vs_synergy"), "ARI": t.get("ari")}
                for t in section["trajectory"]]
        lines.append(render_table(traj, title="trajectory (medians over layers)").rstrip())
    return "\n".join(lines) + "\n"


def fmt_nan3(x) -> str:
    return "nan" if x is None or not np.isfinite(x) else f"{x:.3f}"
