"""The ``channels`` verb: two-axis channel scores and their structure, per model or series."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..channels.layers import score_collected
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

#: Echoed into every report (the method's "our default" choices are parameters).
DEFAULTS = dict(n_positions=16, task_samples="match", k_peers=10, ridge=1e-3, k_clusters=4,
                null_quantile=0.95)


@dataclass(frozen=True)
class ChannelsOptions:
    """The ``channels`` verb's own options (``docs/METHODS.md §B1``–§B4).

    ``targets``: "labels", "pseudo" or "auto" (labels when the data have them).
    ``task_samples``: "match" (T per sampled position) or "gap" (per-input means over
    positions). ``n_positions``: positions per input (spatial positions of a conv,
    tokens of a linear layer: ``docs/METHODS.md §D``). ``k_peers`` / ``ridge``: the
    peer reconstruction R². ``layers``: only these layers (None: every conv and linear
    layer with ≥ 4 channels, head excluded). ``tap``: where each layer's samples come
    from ("auto", "output", "input"; :func:`onnxdiag.channels.taps.choose_taps`).
    ``seed``: the positions, the permutation control and the k-means.
    ``triplet_partners`` / ``triplet_top``: the higher-order structure by depth
    (docs/METHODS.md §B4, :mod:`onnxdiag.channels.higher`): triplets among each channel's
    m most correlated partners, the top ones averaged.
    """

    targets: str = "auto"
    task_samples: str = "match"
    n_positions: int = 16
    k_peers: int = 10
    ridge: float = 1e-3
    layers: tuple | None = None
    tap: str = "auto"
    seed: int = 0
    triplet_partners: int = 10
    triplet_top: int = 10

    def __post_init__(self):
        if self.layers is not None and not isinstance(self.layers, tuple):
            object.__setattr__(self, "layers", tuple(self.layers))

    def settings(self):
        """The :class:`~onnxdiag.channels.collect.StatsSettings` of the statistics pass."""
        from ..channels.collect import StatsSettings

        return StatsSettings(layers=self.layers, n_positions=self.n_positions,
                             task_samples=self.task_samples, targets=self.targets,
                             seed=self.seed, tap=self.tap)


@dataclass(frozen=True)
class _ModelChannels:
    """One model's statistics, scores (per layer: Layer, ChannelScores, floor) and B4
    summary."""

    path: object
    stats: object
    scored: dict
    summary: dict
    sha256: str | None = None
    higher: dict | None = None


def channels_report(models, *, data, options: ChannelsOptions = ChannelsOptions(),
                    head: HeadChoice = HeadChoice(),  # noqa: B008 - frozen records
                    runtime: Runtime = Runtime(),  # noqa: B008
                    report: ReportTarget = ReportTarget()) -> CommandResult:  # noqa: B008
    """Two-axis channel scores and structure analyses (``onnxdiag channels``).

    ``models``: one model path, or several (a checkpoint series in training order) for
    the trajectory of the §B4 statistics. ``data``: the calibration
    :class:`~onnxdiag.commands.base.DataRequest` (or a path). Writes report.json,
    report.txt and channels.csv (one row per channel of the last model).

    ``runtime.executor``: ``local`` (default) with ``runtime.jobs`` worker processes
    (default 1: the single streaming pass in this process), ``ray`` / ``ray=HOST:PORT``,
    or an :class:`~onnxdiag.runtime.executor.Executor`. With more than one worker the
    calibration set is sharded into runs of whole batches, each worker streams its shard
    into the mergeable moments and the driver merges them
    (:func:`onnxdiag.channels.collect.collect_channel_moments_sharded`): the same
    statistics to float64 rounding.
    """
    from ..runtime.executor import open_executor

    models = [models] if isinstance(models, (str, bytes)) or not hasattr(models, "__iter__") \
        else list(models)
    folder = report.folder("channels")
    request = DataRequest.of(data)
    with open_executor(runtime.executor, runtime.jobs, local_jobs=1) as ex:
        per_model = [_model_channels(path, request, options, head, runtime, ex)
                     for path in models]
        ran_on = ex.describe()
    section = _section(per_model)
    params = {"models": [str(m) for m in models], **dataclasses.asdict(options),
              "data": request.params(), "head": head.head, "features": head.features,
              "providers": runtime.providers, "executor": runtime.executor_name(),
              "jobs": runtime.jobs, "defaults": DEFAULTS}
    meta = build_metadata(providers=runtime.providers,
                          command="channels", parameters=params, model_path=models[-1],
                          model_hash=per_model[-1].sha256,
                          data={"calibration": per_model[-1].stats.data})
    meta["model_hashes"] = [m.sha256 for m in per_model]
    meta["executor"] = ran_on
    out = {"schema": SCHEMA_VERSION, "metadata": meta, "channels": section}
    text = render_header(meta) + render_channels(section)
    return finish("channels", out, text, folder, report.overwrite,
                  csv=channel_rows_csv(per_model[-1].scored, per_model[-1].higher),
                  csv_name="channels.csv")


def _model_channels(path, request: DataRequest, options: ChannelsOptions, head: HeadChoice,
                    runtime: Runtime, ex) -> _ModelChannels:
    """One model's statistics pass (here, or sharded on ``ex``) and its scores."""
    from ..channels.collect import collect_channel_moments, collect_channel_moments_sharded
    from ..model.io import get_input_specs, load_model, model_hash

    model = load_model(path)
    structure = find_structure(model, head, request, providers=runtime.providers)
    refuse_dense(structure)
    label = "Channel statistics" if runtime.progress else None
    if ex.in_process:  # one streaming pass here, as without an executor
        source = request.open(get_input_specs(model), classes=structure.head.n_classes)
        structure = at_data_shapes(model, structure, source, runtime.providers)
        stats = collect_channel_moments(model, structure, source,
                                        options.settings(), providers=runtime.providers,
                                        label=label)
    else:
        stats = collect_channel_moments_sharded(model, structure, request, options.settings(),
                                                executor=ex, providers=runtime.providers,
                                                label=label)
    scored, summary = _score(model, stats, structure, options)
    return _ModelChannels(path, stats, scored, summary, model_hash(model),
                          _higher(stats, options))


def refuse_dense(structure) -> None:
    """OnnxDiagError for a per-position head: the target T of docs/METHODS.md §B3 is one
    logit margin per image, which a head applied at every position does not give."""
    from ..errors import OnnxDiagError

    if structure.head is not None and structure.head.dense:
        raise OnnxDiagError(
            f"Head {structure.head.node_name!r} is applied at every position (a segmentation "
            "or detection head, docs/METHODS.md §A4); the channel statistics need one target "
            "per image (§B3). Use readouts/select for this model, or name a per-image head "
            "with --head/--features.")


def at_data_shapes(model, structure, source, providers=None):
    """``structure`` with the layer shapes and FLOPs at the first batch of ``source``
    where shape inference left dimensions open (tokens: ``docs/METHODS.md §D``)."""
    from ..graph.structure import at_batch_shapes

    first = next(iter(source.batches()), None)
    return structure if first is None else at_batch_shapes(model, structure, first.feeds,
                                                           providers=providers)


def _score(model, stats, structure, options) -> tuple[dict, dict]:
    """(per-layer scores, the §B4 summary) of collected statistics."""
    from ..channels.clustering import summarize_layers

    scored = score_collected(model, stats, structure, k_peers=options.k_peers,
                             ridge=options.ridge)
    return scored, summarize_layers([s for _, s, _ in scored.values()], seed=options.seed)


def _higher(stats, options) -> dict:
    """Per analysed layer (with ≥ 3 channels): its higher-order structure (§B4)."""
    from ..channels.higher import higher_order_layer

    out = {}
    for name, lm in stats.layers.items():
        if lm.n_channels < 3:
            continue
        _, cov_local = lm.local_moments()
        cov_yy, cov_yt, var_t = lm.target_moments()
        out[name] = higher_order_layer(cov_local, cov_yy, cov_yt, var_t, layer=name,
                                       k_peers=options.k_peers, ridge=options.ridge,
                                       triplet_partners=options.triplet_partners,
                                       triplet_top=options.triplet_top)
    return out


def depth_section(higher: dict) -> dict:
    """The §B4 depth table: one row per layer in graph order, the trends against depth."""
    from ..channels.higher import depth_trends

    rows = [{"depth": d, **h.to_dict()} for d, h in enumerate(higher.values())]
    params = next(iter(higher.values())).params if higher else {}
    return {"layers": rows, "trends": depth_trends(rows), "params": params}


def _section(per_model: list[_ModelChannels]) -> dict:
    last = per_model[-1]
    stats = last.stats
    layers = [_layer_row(row, *last.scored[row["layer"]], stats.taps)
              for row in last.summary["layers"]]
    trajectory = [{"model": str(m.path), **m.summary["median"]}
                  for m in per_model] if len(per_model) > 1 else []
    section = {"model": str(last.path), "targets": stats.targets,
            "targets_flag": "pseudo-labels (predicted class), not ground truth"
            if stats.targets == "pseudo" else "",
            "task_samples": stats.task_samples, "n_positions": stats.n_positions,
            "n_images": stats.n_images, "kinds": dict(stats.kinds),
            "median": last.summary["median"], "layers": layers, "trajectory": trajectory}
    if last.higher is not None:
        section["depth"] = depth_section(last.higher)
    return section


def _layer_row(row: dict, layer, scores, floor, taps: dict) -> dict:
    """One layer's report row: its §B4 summary, notes, extremes, floor and scores."""
    r2 = scores.scores["peer_r2"]
    order = np.argsort(-r2, kind="stable")
    info = scores.scores.get("task_info")
    return {
        **row, "op_type": layer.op_type, "normalization": layer.normalization,
        "bn_folded": bool(layer.bn_folded), "tap": taps.get(row["layer"], "output"),
        "note": ("BN folded into the conv: y is post-BN; input_capture and signal_power "
                 "are scale-dependent, the rho-based scores are unchanged")
        if layer.bn_folded else "",
        "most_substitutable": order[:3].tolist(), "least_substitutable": order[-3:].tolist(),
        "median_peer_r2": float(np.median(r2)),
        "noise_floor": floor.to_dict(),
        "n_above_floor": None if info is None else floor.count_above(info),
        "scores": scores.to_dict(),
    }


def channel_section(model, source, structure, options: ChannelsOptions | None = None, *,
                    providers=None, model_name: str = "", label: str | None = None,
                    **fields) -> tuple[dict, str]:
    """The channel section of ``onnxdiag analyze``: ``(section dict, rendered text)``.

    One statistics pass over ``source`` (a DataSource, e.g. the probe batch), the scores
    and the §B4 structure per layer; the summary per layer is the axis correlations, the
    ARI, the noise floor count and the most / least substitutable channels (by peer R²,
    with their R² values), and the two axes per channel (``axes``: ``input_capture``,
    ``task_info``, for the report's scatter plot); the other per-channel scores are left
    to ``onnxdiag channels``.
    ``options``: a :class:`ChannelsOptions`, or its fields as keywords (``targets=…,
    seed=…``; given fields replace those of ``options``). ``model`` is a loaded
    ModelProto (never modified) and ``structure`` its
    :func:`onnxdiag.graph.analyze_structure`. ``targets="expected"`` (a readout-only
    choice) is treated as ``auto``. A model without an analysable conv or linear layer
    (≥ 4 channels, not the head) gives ``{"skipped": reason, "layers": []}`` instead of
    an error, so ``analyze`` can always call it.
    """
    from ..channels.collect import collect_channel_moments, find_analysed_layers

    options = dataclasses.replace(options or ChannelsOptions(), **fields)
    if options.targets == "expected":
        options = dataclasses.replace(options, targets="auto")
    if options.layers is None and not find_analysed_layers(structure):
        reason = "no conv or linear layer with at least 4 output channels (head excluded)"
        return ({"skipped": reason, "layers": []},
                f"== Channels: two axes (docs/METHODS.md §B) ==\nskipped: {reason}.\n")
    stats = collect_channel_moments(model, structure, source, options.settings(),
                                    providers=providers, label=label)
    scored, summary = _score(model, stats, structure, options)
    section = _section([_ModelChannels(model_name, stats, scored, summary)])
    for row in section["layers"]:
        scores = row.pop("scores")["scores"]
        r2 = scores["peer_r2"]
        row["axes"] = {k: None if scores.get(k) is None else [float(v) for v in scores[k]]
                       for k in ("input_capture", "task_info")}
        row["most_substitutable_r2"] = [float(r2[i]) for i in row["most_substitutable"]]
        row["least_substitutable_r2"] = [float(r2[i]) for i in row["least_substitutable"]]
    section["params"] = {k: getattr(options, k) for k in
                         ("n_positions", "task_samples", "k_peers", "ridge", "seed", "tap")}
    return section, render_channels(section)


def channel_rows_csv(scored, higher: dict | None = None) -> str:
    """One CSV row per channel: layer, channel, every score (and the §B4 higher-order
    values R²_1 and triplet synergy when ``higher`` is given)."""
    rows = []
    for name, (_, scores, _) in scored.items():
        extra = (higher or {}).get(name)
        for row in scores.to_rows():
            if extra is not None:
                row.update({k: float(v[row["channel"]]) for k, v in extra.channels.items()
                            if k in ("r2_single", "triplet_synergy")})
            rows.append(row)
    return rows_to_csv(rows)


def render_channels(section: dict) -> str:
    """Per-layer summary: axis correlations, ARI, noise floor, substitutable channels."""
    rows = [{"layer": la["layer"], "C": la["n_channels"],
             "rho(I_X,I_T)": la.get("input_capture_vs_task_info"),
             "rho(R_X,Syn)": la.get("peer_overlap_vs_synergy"), "ARI": la.get("ari"),
             "med R2": la["median_peer_r2"],
             "I_T>floor": la["n_above_floor"],
             "most subst.": ",".join(map(str, la["most_substitutable"])),
             "least subst.": ",".join(map(str, la["least_substitutable"])),
             "norm": _norm_cell(la),
             "y from": "input" if la.get("tap") == "input" else ""}
            for la in section["layers"]]
    med = section["median"]
    lines = ["== Channels: two axes (docs/METHODS.md §B) ==",
             f"{section['n_images']} inputs x up to {section['n_positions']} positions each "
             f"(spatial positions of a conv, tokens of a linear layer), targets="
             f"{section['targets']}, task samples={section['task_samples']}",
             f"analysed: {_kinds_text(section.get('kinds') or {})}",
             render_table(rows).rstrip(),
             "median over layers: spearman(I_X, I(T;Y)) = "
             f"{fmt_nan3(med.get('input_capture_vs_task_info'))}, spearman(R_X, Syn) = "
             f"{fmt_nan3(med.get('peer_overlap_vs_synergy'))}, ARI = {fmt_nan3(med.get('ari'))} "
             "(published, trained CIFAR-100 nets: ~0.01 and ARI ~0.02; ~0.7 at init)",
             "I_T>floor: channels whose task information exceeds the 95th percentile of the "
             "permutation control (T shuffled across inputs)."]
    if any(la.get("tap") == "input" for la in section["layers"]):
        lines.append("y from = input: the conv was evaluated in float64 at the sampled "
                     "positions from its input (far fewer values to copy out of ONNX "
                     "Runtime); other layers sample ONNX Runtime's conv output.")
    if section["targets_flag"]:
        lines.append(f"NOTE: targets are {section['targets_flag']}.")
    if section.get("depth"):
        lines.append(render_depth(section["depth"]))
    if section["trajectory"]:
        traj = [{"checkpoint": t["model"].rsplit("/", 1)[-1],
                 "rho(I_X,I_T)": t.get("input_capture_vs_task_info"),
                 "rho(R_X,Syn)": t.get("peer_overlap_vs_synergy"), "ARI": t.get("ari")}
                for t in section["trajectory"]]
        lines.append(render_table(traj, title="trajectory (medians over layers)").rstrip())
    return "\n".join(lines) + "\n"


def _norm_cell(la: dict) -> str:
    if la.get("bn_folded"):
        return "BN folded"
    return {"batchnorm": "BN", "layernorm": "LN", "rmsnorm": "RMS"}.get(
        la.get("normalization") or "", "")


def _kinds_text(kinds: dict) -> str:
    names = {"conv": "conv layer(s) (Conv)", "linear": "linear layer(s) (Gemm/MatMul; "
             "positions are tokens, or one per input)"}
    return ", ".join(f"{n} {names.get(k, k)}" for k, n in kinds.items()) or "none"
def render_depth(depth: dict) -> str:
    """The §B4 higher-order table: singleton vs distributed R², pair vs triplet synergy."""
    rows = [{"depth": r["depth"], "layer": r["layer"], "C": r["n_channels"],
             "R2 1 peer": r["r2_single"], f"R2 {r['params']['k_peers']} peers": r["r2_multi"],
             "share 1/k": r["single_share"], "pair Syn": r["pair_synergy"],
             "triplet Syn": r["triplet_synergy"], "excess": r["triplet_excess"]}
            for r in depth["layers"]]
    t = depth["trends"]
    return "\n".join([
        render_table(rows, title="higher-order structure by depth (docs/METHODS.md §B4; "
                                 "medians over channels)").rstrip(),
        "spearman vs depth: share 1/k "
        f"{fmt_nan3(t.get('single_share'))}, R2 k peers {fmt_nan3(t.get('r2_multi'))}, "
        f"triplet Syn {fmt_nan3(t.get('triplet_synergy'))}, excess "
        f"{fmt_nan3(t.get('triplet_excess'))} (published: singleton duplicates early, "
        "distributed shells deep: share falls with depth; triplet synergy rises with depth)"])


def fmt_nan3(x) -> str:
    return "nan" if x is None or not np.isfinite(x) else f"{x:.3f}"
