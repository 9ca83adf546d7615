"""Which channels to keep: the per-layer scores of every ``--score`` (higher = keep).

Model-only scores (magnitude, bn_scale, random), statistics-based ones (ix, relevance,
two_axis, peer, synergy, redundancy) from one channel-statistics pass, and the
consumer-input ones (recon: the repair-aware greedy choice, wanda: |W|·‖X‖;
docs/METHODS.md §E3) from the consumers' input moments."""

from __future__ import annotations

import numpy as np
import onnx

from ..errors import OnnxDiagError

MODEL_SCORES = ("magnitude", "bn_scale", "random")


STAT_SCORES = ("ix", "relevance", "two_axis", "peer", "synergy", "redundancy")


#: Target T of the channel statistics (docs/METHODS.md §B3).
TARGETS = ("auto", "labels", "pseudo")


#: From the consumers' input moments (structured/reconstruct.collect_input_moments).
CONSUMER_SCORES = ("recon", "wanda")


SCORES = MODEL_SCORES + STAT_SCORES + CONSUMER_SCORES


#: docs/METHODS.md §B6: two_axis = alpha·norm(I_X) − beta·norm(I(T;Y)); beta grid
#: {0, .1, .25, .5, 1}.
DEFAULT_ALPHA, DEFAULT_BETA = 1.0, 0.25


def _norm(v: np.ndarray) -> np.ndarray:
    lo, hi = np.nanmin(v), np.nanmax(v)
    return np.zeros_like(v) if hi - lo <= 0 else (v - lo) / (hi - lo)


def stat_scores(model, structure, source, *, targets="auto", seed=0, providers=None,
                progress=False) -> dict:
    """ChannelScores per analysed layer from one statistics pass (docs/METHODS.md §B2–§B3)."""
    from ..channels.collect import collect_channel_moments
    from ..channels.layers import score_collected

    # On a copy: the pass's model exposure (onnx-graphsurgeon's import) marks the tensors
    # of Constant nodes as named "", which changes the model's hash (and a plan's).
    model = _copy(model)
    stats = collect_channel_moments(model, structure, source, targets=targets, seed=seed,
                                    providers=providers,
                                    label="Channel statistics" if progress else None)
    return {name: s for name, (_, s, _) in score_collected(model, stats, structure).items()}


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def layer_scores(name: str, model, structure, channel_scores: dict | None, *,
                 alpha=DEFAULT_ALPHA, beta=DEFAULT_BETA, seed=0, moments=None,
                 ridge=None) -> tuple[dict, list[str]]:
    """{layer: (n_out,) scores} for score ``name`` ({group id: (n,)} for the consumer
    scores, on ``moments``); layers without statistics fall back to magnitude (listed
    in the returned notes)."""
    from . import bn_scale_scores, magnitude_scores, random_scores

    if name not in SCORES:
        raise OnnxDiagError(f"Unknown channel score {name!r}; choose one of {', '.join(SCORES)}.")
    if name in CONSUMER_SCORES:
        return consumer_scores(name, model, structure, moments, ridge=ridge)
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
    prunable = {m for g in structure.groups if g.prunable for m in g.members}
    fallback = sorted((set(out) - set(channel_scores)) & prunable)
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
    if name == "synergy":  # target axis: keep the channels with the most synergy Syn(i)
        return s["synergy"]
    if name == "redundancy":  # target axis: keep the least redundant (low Red_T(i)), as peer
        return -s["redundancy"]
    return alpha * _norm(s["input_capture"]) - beta * _norm(s["task_info"])


def consumer_scores(name: str, model, structure, moments, *, ridge=None):
    """({group id: scores} of ``recon`` or ``wanda``, the magnitude of the groups they
    cannot score; notes)."""
    from . import magnitude_scores
    from .recon_score import recon_scores, wanda_scores
    from .reconstruct import DEFAULT_RIDGE

    if moments is None:
        raise OnnxDiagError(f"Score {name!r} needs calibration data for the consumers' input "
                            "statistics; pass --data FILE.")
    if name == "recon":
        groups, missing = recon_scores(model, structure, moments,
                                       ridge=DEFAULT_RIDGE if ridge is None else ridge)
    else:
        groups, missing = wanda_scores(model, structure, moments)
    notes = [f"{name}: group(s) {', '.join(missing[:5])} have no consumer it can score "
             "(grouped convs, none): scored by magnitude"] if missing else []
    return {**magnitude_scores(model, structure), **groups}, notes


def consumer_moments(model, structure, calib, providers=None) -> dict:
    """The consumers' input moments of every prunable group on ``calib`` (one pass), for
    the consumer scores and the reconstruction; on a copy (see stat_scores)."""
    from .reconstruct import collect_input_moments, consumer_sites

    if calib is None:
        raise OnnxDiagError("The recon / wanda scores and the reconstruction need calibration "
                            "data for the consumers' input statistics; pass --data FILE.")
    return collect_input_moments(_copy(model), consumer_sites(structure), calib,
                                 providers=providers)
