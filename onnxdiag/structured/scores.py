"""Channel scores computable from the model alone, and group scores (docs/METHODS.md §B6).

Scores are "higher = keep".  Layer-level scores map a layer name to one value per
output channel ``(n_out,)``; group-level scores map a group id to ``(n_channels,)``.
Scores from channel statistics (ix, two_axis, relevance, peer) come from
:class:`onnxdiag.channels.ChannelScores` and are passed in the same layer-level form.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx

from ..errors import OnnxDiagError
from ..graph import GraphIndex, Structure


def magnitude_scores(model: onnx.ModelProto, structure: Structure) -> dict[str, np.ndarray]:
    """L2 norm of each layer's output filter (docs/METHODS.md §B6 ``magnitude``):
    ``{layer: (n_out,)}``.

    Conv filters are ``W[o]`` (all input channels and taps), Gemm/MatMul columns the
    weights producing one output feature.  Layers with a computed weight are left out.
    Never modifies ``model``.
    """
    index = GraphIndex(model)
    out = {}
    for layer in structure.layers:
        w = index.get_constant(layer.weight)
        if w is None or layer.weight_layout not in ("oihw", "oi", "io"):
            continue
        w = np.asarray(w, dtype=np.float64)
        w = w.T if layer.weight_layout == "io" else w
        out[layer.node_name] = np.linalg.norm(w.reshape(w.shape[0], -1), axis=1)
    return out


def bn_scale_scores(model: onnx.ModelProto, structure: Structure) -> dict[str, np.ndarray]:
    """|γ| of the BatchNormalization of each layer that has one (network slimming):
    ``{layer: (n_out,)}``; layers without BN are left out.  Never modifies ``model``."""
    index = GraphIndex(model)
    out = {}
    for layer in structure.layers:
        node = index.node_by_name.get(layer.bn_node or "")
        gamma = None if node is None else index.get_constant(node.input[1])
        if gamma is not None and gamma.size == layer.n_out:
            out[layer.node_name] = np.abs(np.asarray(gamma, dtype=np.float64).ravel())
    return out


def random_scores(structure: Structure, seed: int = 0) -> dict[int, np.ndarray]:
    """Uniform random group-level scores ``{group_id: (n_channels,)}``
    (docs/METHODS.md §B6 ``random``)."""
    rng = np.random.default_rng(seed)
    return {g.group_id: rng.random(g.n_channels) for g in structure.groups}


def score_groups(structure: Structure, scores: Mapping,
                 groups: Iterable[int] | None = None) -> dict[int, np.ndarray]:
    """Group scores ``{group_id: (n_channels,)}`` for ``groups`` (default: all prunable).

    Layer-level scores (str keys) are min–max normalised per layer, then summed over
    the group's members (a member at offset o gives channels o … o+n−1); members
    without scores are skipped.  An attention head (``block_size`` = head_dim) scores
    the sum over its head_dim features of every member (its rows of Q, K and V).
    Group-level scores (int keys) are used as given.
    NaN counts as the lowest score (a channel with no signal goes first), ±inf as the
    highest / lowest.

    Raises:
        OnnxDiagError: a group has no scored member, or a score has the wrong length.
    """
    wanted = [g.group_id for g in structure.groups if g.prunable] if groups is None \
        else [int(g) for g in groups]
    by_group = {_as_int(k): v for k, v in scores.items() if _as_int(k) is not None}
    out, missing = {}, []
    for gid in wanted:
        group = structure.groups[gid]
        if gid in by_group:
            out[gid] = _checked(by_group[gid], group.n_channels, f"group {gid}")
            continue
        parts = [_blocks(normalize_minmax(_checked(scores[m], structure.get_layer(m).n_out,
                                                   f"layer {m!r}")), o, group)
                 for m, o in zip(group.members, group.member_offsets) if m in scores]
        if parts:
            out[gid] = np.sum(parts, axis=0)
        else:
            missing.append(f"{gid} ({', '.join(group.members[:3])})")
    if missing:
        raise OnnxDiagError(
            f"No scores for channel group(s) {'; '.join(missing[:5])}"
            f"{f' (first 5 of {len(missing)})' if len(missing) > 5 else ''}: score one of "
            "their layers, or name the groups to prune.")
    return out


def _blocks(normalized: np.ndarray, offset: int, group) -> np.ndarray:
    """A member's normalised feature scores summed per group channel: features
    ``(offset + c)·b … (offset + c)·b + b − 1`` for ``b`` = ``group.block_size`` (the
    head_dim features of one attention head; one feature otherwise)."""
    b, n = group.block_size, group.n_channels
    return normalized[offset * b:(offset + n) * b].reshape(n, b).sum(axis=1)


def _as_int(key) -> int | None:
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key)
    return None


def _checked(values, n: int, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).ravel()
    if arr.size != n:
        raise OnnxDiagError(f"Scores for {what} have {arr.size} values; expected {n} "
                            "(one per output channel).")
    finite = arr[np.isfinite(arr)]
    low, high = (finite.min(), finite.max()) if finite.size else (0.0, 0.0)
    return np.nan_to_num(arr, nan=low - 1.0, posinf=high + 1.0, neginf=low - 1.0)


def normalize_minmax(arr: np.ndarray) -> np.ndarray:
    """``arr`` min–max to [0, 1] (docs/METHODS.md §B6, per-layer normalisation); constant →
    zeros."""
    span = arr.max() - arr.min()
    return (arr - arr.min()) / span if span > 0 else np.zeros_like(arr)
