"""The structured-pruning verbs (SPEC B6): ``prune-channels`` and ``prune-sweep``.

Channel scores (higher = keep) come from the model alone (magnitude, bn_scale, random)
or from one channel-statistics pass over calibration data (ix, relevance, two_axis,
peer). Budgets are FLOPs-matched by construction: with the ``uniform`` budget every
score removes the same number of channels from every group.
"""

from __future__ import annotations

import numpy as np

from .analysis import CommandResult, _check_out, _finish, _header, _open
from .errors import OnnxDiagError
from .report import SCHEMA_VERSION, build_metadata, render_table

MODEL_SCORES = ("magnitude", "bn_scale", "random")
STAT_SCORES = ("ix", "relevance", "two_axis", "peer")
SCORES = MODEL_SCORES + STAT_SCORES
#: SPEC B6 two_axis = alpha·norm(I_X) − beta·norm(I(T;Y)); beta grid {0, .1, .25, .5, 1}.
DEFAULT_ALPHA, DEFAULT_BETA = 1.0, 0.25


def _norm(v: np.ndarray) -> np.ndarray:
    lo, hi = np.nanmin(v), np.nanmax(v)
    return np.zeros_like(v) if hi - lo <= 0 else (v - lo) / (hi - lo)


def stat_scores(model, structure, source, *, targets="auto", seed=0, providers=None,
                progress=False) -> dict:
    """ChannelScores per analysed layer from one statistics pass (SPEC B2–B3)."""
    from .channel_report import score_collected
    from .collect import collect_channel_moments

    stats = collect_channel_moments(model, structure, source, targets=targets, seed=seed,
                                    providers=providers,
                                    label="Channel statistics" if progress else None)
    return {name: s for name, (_, s, _) in score_collected(model, stats, structure).items()}


def layer_scores(name: str, model, structure, channel_scores: dict | None, *,
                 alpha=DEFAULT_ALPHA, beta=DEFAULT_BETA, seed=0) -> tuple[dict, list[str]]:
    """{layer: (n_out,) scores} for score ``name``; layers without statistics fall back
    to magnitude (listed in the returned notes)."""
    from .structured import bn_scale_scores, magnitude_scores, random_scores

    if name not in SCORES:
        raise OnnxDiagError(f"Unknown channel score {name!r}; choose one of {', '.join(SCORES)}.")
    if name == "magnitude":
        return magnitude_scores(model, structure), []
    if name == "bn_scale":
        out = magnitude_scores(model, structure)
        out.update(bn_scale_scores(model, structure))
        return out, ["bn_scale: layers without BN scored by magnitude"]
    if name == "random":
        return random_scores(structure, seed=seed), []
    if channel_scores is None:
        raise OnnxDiagError(f"Score {name!r} needs calibration data for the channel statistics; "
                            "pass --data FILE.")
    out = magnitude_scores(model, structure)
    fallback = sorted(set(out) - set(channel_scores))
    for layer, cs in channel_scores.items():
        out[layer] = stat_score(name, cs.scores, alpha=alpha, beta=beta)
    notes = [f"{name}: {len(fallback)} layer(s) without channel statistics scored by "
             f"magnitude: {', '.join(fallback[:5])}"] if fallback else []
    return out, notes


def stat_score(name: str, s: dict, *, alpha=DEFAULT_ALPHA, beta=DEFAULT_BETA) -> np.ndarray:
    """One statistics-based channel score (higher = keep) from ChannelScores.scores."""
    if name == "ix":
        return s["input_capture"]
    if name == "relevance":
        return s["task_info"]
    if name == "peer":
        return 1.0 - s["peer_r2"]
    return alpha * _norm(s["input_capture"]) - beta * _norm(s["task_info"])


def _eval(model, structure, source, providers=None):
    from .probe import evaluate_model, make_head_runner

    if source is None:
        return None
    return evaluate_model(make_head_runner(model, structure.head, providers=providers),
                          structure.head, source).to_dict()


def prune_channels_report(model, *, output, ratio=0.5, score="two_axis", data=None,
                          labels=None, eval_data=None, eval_labels=None, budget="uniform",
                          alpha=DEFAULT_ALPHA, beta=DEFAULT_BETA, plan=None, plan_out=None,
                          finetune=False, train_data=None, train_labels=None, epochs=5,
                          lr=1e-4, max_batches=200, limit=None, seed=0, batch_size=64,
                          providers=None, head=None, features=None, targets="auto",
                          out=None, overwrite=False, write=True, progress=True
                          ) -> CommandResult:
    """Remove channels physically and emit a smaller ONNX model (``onnxdiag prune-channels``).

    ``plan``: a plan JSON to replay (hash-checked) instead of scoring. The emitted model
    gets a sidecar ``<output>.json``: plan, FLOPs/params/file size before and after,
    CPU latency at batch 1 and 32, agreement with the source, accuracy before/after.
    """
    from .emit import compare_models, emit_model, finalize_model, measure_latency
    from .graph import analyze_structure
    from .model_io import check_output_path, get_input_specs, load_model
    from .probe import make_head_runner
    from .structured import load_plan, plan_pruning, prune_channels, save_plan

    folder = _check_out(out, "prune-channels", overwrite, write)
    check_output_path(output, protect=[model, data, eval_data, plan])
    m = load_model(model)
    structure = analyze_structure(m, head=head, features=features)
    specs = get_input_specs(m)
    calib = None if data is None else _open(data, specs, labels=labels, limit=limit, seed=seed,
                                            batch_size=batch_size)
    evaluation = None if eval_data is None else _open(eval_data, specs, labels=eval_labels,
                                                      seed=seed, batch_size=batch_size)
    notes = []
    if plan is not None:
        the_plan = load_plan(plan)
    else:
        cs = None
        if score in STAT_SCORES:
            if calib is None:
                raise OnnxDiagError(f"Score {score!r} needs calibration data; pass --data FILE.")
            cs = stat_scores(m, structure, calib, targets=targets, seed=seed,
                             providers=providers, progress=progress)
        scores, notes = layer_scores(score, m, structure, cs, alpha=alpha, beta=beta, seed=seed)
        the_plan = plan_pruning(m, structure, scores, ratio, budget=budget, seed=seed,
                                score_name=score)
    pruned, record = prune_channels(m, structure, the_plan)
    pruned = finalize_model(pruned)
    ft = None
    if finetune:
        pruned, ft = _finetune(pruned, train_data, train_labels, specs, epochs=epochs, lr=lr,
                               max_batches=max_batches, seed=seed, batch_size=batch_size,
                               evaluation=evaluation)
        pruned = finalize_model(pruned)
    verify = evaluation or calib
    p_struct = analyze_structure(pruned, head=structure.head.node_name)
    comparison = None if verify is None else compare_models(
        make_head_runner(m, structure.head), make_head_runner(pruned, p_struct.head), verify,
        structure.head)
    x = _example_input(specs, verify)
    latency = {"source_ms": measure_latency(m, {1: x[:1], 32: x}),
               "pruned_ms": measure_latency(pruned, {1: x[:1], 32: x})}
    sidecar = {"tool": "onnxdiag prune-channels", "plan": the_plan.to_dict(),
               "record": record.to_dict(), "comparison_with_source": comparison,
               "latency_cpu": latency, "accuracy_before": _eval(m, structure, evaluation),
               "accuracy_after": _eval(pruned, p_struct, evaluation), "finetune": ft,
               "notes": notes, "flops_ratio": _ratio(record.flops_after, record.flops_before),
               "params_ratio": _ratio(record.params_after, record.params_before)}
    info = emit_model(pruned, output, source_path=model, sidecar=sidecar,
                      protect=[model, data, eval_data, plan])
    if plan_out:
        save_plan(the_plan, plan_out)
    info["file_size_ratio"] = _ratio(info["emitted"]["file_bytes"], info.get("source_file_bytes"))
    meta = build_metadata(command="prune-channels", model_path=model,
                          parameters=dict(output=str(output), ratio=ratio, score=score,
                                          budget=budget, alpha=alpha, beta=beta,
                                          plan=plan, finetune=finetune, epochs=epochs, lr=lr,
                                          seed=seed, limit=limit, data=data,
                                          eval_data=eval_data))
    report = {"schema": SCHEMA_VERSION, "metadata": meta, "prune_channels": info}
    text = _header(meta) + render_prune(info)
    return _finish("prune-channels", report, text, text, folder, overwrite)


def _ratio(a, b):
    return None if not a or not b else a / b


def _example_input(specs, source) -> dict:
    """A batch of 32 for latency: real data when available, else zeros of the input shape."""
    if source is not None:
        feeds = next(iter(source.batches())).feeds
        if all(v.shape[0] >= 32 for v in feeds.values()):
            return _Feeds({k: v[:32] for k, v in feeds.items()})
    return _Feeds({s.name: np.zeros([32] + [d or 1 for d in s.shape[1:]], dtype=s.dtype)
                   for s in specs})


class _Feeds(dict):
    def __getitem__(self, key):  # slice every input: feeds[:1]
        if isinstance(key, slice):
            return _Feeds({k: v[key] for k, v in self.items()})
        return super().__getitem__(key)


def _finetune(model, train_data, train_labels, specs, *, epochs, lr, max_batches, seed,
              batch_size, evaluation):
    if train_data is None:
        raise OnnxDiagError("--finetune needs labelled training data; pass --train-data FILE.")
    from .finetune import finetune_model

    train = _open(train_data, specs, labels=train_labels, seed=seed, batch_size=batch_size)
    tuned, record = finetune_model(model, train, epochs=epochs, lr=lr, max_batches=max_batches,
                                   seed=seed, eval_source=evaluation)
    return tuned, record.to_dict()


def render_prune(info: dict) -> str:
    rec, plan = info["record"], info["plan"]
    lat = info["latency_cpu"]
    acc_b, acc_a = info.get("accuracy_before"), info.get("accuracy_after")
    rows = [{"": "source", "params": rec["params_before"], "FLOPs": rec["flops_before"],
             "file bytes": info.get("source_file_bytes"),
             "ms b=1": lat["source_ms"]["1"], "ms b=32": lat["source_ms"]["32"],
             "top-1 %": None if not acc_b else 100 * acc_b["accuracy"]},
            {"": "pruned", "params": rec["params_after"], "FLOPs": rec["flops_after"],
             "file bytes": info["emitted"]["file_bytes"],
             "ms b=1": lat["pruned_ms"]["1"], "ms b=32": lat["pruned_ms"]["32"],
             "top-1 %": None if not acc_a else 100 * acc_a["accuracy"]}]
    lines = ["== Structured pruning (SPEC B6) ==",
             f"score {plan['score']}, budget {plan['budget']}, ratio {plan['ratio']}: "
             f"{plan.get('n_removed', '')} channels removed -> {info['emitted']['path']}",
             render_table(rows).rstrip(),
             f"FLOPs ratio {_fmt(info['flops_ratio'])}, params ratio "
             f"{_fmt(info['params_ratio'])}, file-size ratio {_fmt(info.get('file_size_ratio'))}"
             f", CPU speed-up b=1 {_fmt(_speed(lat, '1'))}x, b=32 {_fmt(_speed(lat, '32'))}x"]
    cmp_ = info.get("comparison_with_source")
    if cmp_:
        lines.append(f"top-1 agreement with the source {100 * cmp_['top1_agreement']:.1f} % on "
                     f"{cmp_['n_samples']} samples")
    lines += [f"note: {n}" for n in info.get("notes", [])]
    return "\n".join(lines) + "\n"


def _speed(lat, b):
    return lat["source_ms"][b] / lat["pruned_ms"][b] if lat["pruned_ms"][b] else None


def _fmt(x):
    return "-" if x is None else f"{x:.3f}"
