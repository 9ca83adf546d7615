"""METHODS §B5 interventions: channel lesions and peer substitution as inference-only graph edits.

Every edit is made with :class:`onnxdiag.model.edit.ModelEditor` on a private copy (no
function here modifies the model it is given) and comes back through its checked
``finish()``: shapes re-inferred, full checker.  Models come from
:func:`onnxdiag.model.io.load_model` (unique node names), ``layer`` records from
:func:`onnxdiag.graph.analyze_structure` on that model.

"Zero channel c" (B5 lesion) zeroes weight row c and bias entry c, and by the layer's BN:
- ``bn_position == "after"``: also the BN's scale and shift at c, so the BN output is exactly 0
  (zeroing the conv alone would leave the shift β − μγ/√(σ²+ε)).
- ``"before_next"`` (pre-activation BN behind an activation / pooling): that BN is NOT touched:
  it may read a sum (a residual stream) other layers also write, and the activation need not
  map 0 to 0; the lesion is y_c = 0, and downstream the BN still adds its constant for c.
- no BN (``bn_folded`` or none): the (post-BN) output is 0.
Initializers read by other nodes are copied first (only this layer's node is rewired);
computed weights (Transpose, Constant nodes) become new initializers.

Substitution (B5) replaces the pre-BN output y_c by a + Σ_j β_j y_{peers_j}: the layer's output
tensor is renamed and one inserted node (a 1×1 Conv; MatMul+Add for Gemm/MatMul) computes the
original tensor from it (identity rows for the other channels), so every consumer and graph
output sees the substitution.  Reconstructions read the layer's ORIGINAL outputs, also when
several channels are substituted at once.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import helper

from ..errors import OnnxDiagError
from ..evaluate import Evaluation, evaluate
from ..graph import Layer
from ..model.edit import ModelEditor
from ..model.expose import expose_tensors
from ..runtime.runner import OrtRunner

#: Recovery is undefined (None) when the lesion damage is at most this (METHODS §B5 ratio).
MIN_DAMAGE = 1e-6


# -- graph editing -------------------------------------------------------------------------
def _constant(ed: ModelEditor, tensor: str) -> np.ndarray:
    value = ed.value(tensor)
    if value is None:
        raise OnnxDiagError(f"Tensor {tensor!r} is not a constant; only layers with constant "
                            "weights, biases and BN parameters can be edited.")
    return value


def _edit_input(ed: ModelEditor, node_name: str, slot: int,
                fn: Callable[[np.ndarray], np.ndarray]) -> None:
    """Input ``slot`` of a node becomes ``fn(copy of its value)``, copy-on-write."""
    name = ed.node(node_name).input[slot]
    value = np.ascontiguousarray(fn(_constant(ed, name)))
    ed.set_input(node_name, slot, value, stem=f"{name}_edited")


# -- lesion --------------------------------------------------------------------------------
def _check_channels(layer: Layer, channels) -> np.ndarray:
    """Sorted distinct channels; OnnxDiagError when empty or out of range."""
    chans = np.asarray(list(channels), dtype=np.int64).reshape(-1)
    bad = chans[(chans < 0) | (chans >= layer.n_out)]
    if chans.size == 0 or bad.size:
        raise OnnxDiagError(
            f"Channel {int(bad[0]) if bad.size else '(none)'} is not a channel of layer "
            f"{layer.node_name!r}, which has {layer.n_out}; give channels 0..{layer.n_out - 1}.")
    return np.unique(chans)


def _zero_weight(w: np.ndarray, layer: Layer, chans: np.ndarray) -> np.ndarray:
    if layer.weight_layout in ("oihw", "oi"):
        w[chans] = 0
    elif layer.weight_layout == "io":
        w[:, chans] = 0
    else:  # "iohw" ConvTranspose: output channel c = g·(C_out/groups) + j
        per_out, per_in = w.shape[1], w.shape[0] // layer.groups
        for g, j in (divmod(int(c), per_out) for c in chans):
            w[g * per_in:(g + 1) * per_in, j] = 0
    return w


def _zero_entries(v: np.ndarray, chans: np.ndarray, n_out: int | None = None) -> np.ndarray:
    """Zero entries ``chans`` of a constant holding one value per channel in any shape, or
    with ``n_out``, of a bias input broadcast to (..., n_out) first (Gemm's C may be scalar)."""
    if n_out is not None:
        v = np.broadcast_to(v, np.broadcast_shapes(v.shape, (n_out,))).copy()
        v[..., chans] = 0
        return v
    flat = v.reshape(-1).copy()
    flat[chans] = 0
    return flat.reshape(v.shape)


def _apply_lesion(ed: ModelEditor, layer: Layer, chans: np.ndarray) -> None:
    _edit_input(ed, layer.node_name, 1, lambda w: _zero_weight(w, layer, chans))
    if layer.bias is not None:
        owner = layer.bias_node or layer.node_name
        slot = list(ed.node(owner).input).index(layer.bias)
        n_out = None if layer.bias_node else layer.n_out
        _edit_input(ed, owner, slot, lambda b: _zero_entries(b, chans, n_out))
    if layer.bn_position == "after":  # BN scale and shift 0 → BN output exactly 0
        for slot in (1, 2):
            _edit_input(ed, layer.bn_node, slot, lambda v: _zero_entries(v, chans))


def lesion_note(layer: Layer) -> str:
    """One line saying what a lesion of ``layer`` zeroes (see the module docstring)."""
    if layer.bn_position == "after":
        return f"{layer.node_name}: weights, bias and BN {layer.bn_node!r} output zeroed"
    if layer.bn_position == "before_next":
        return (f"{layer.node_name}: output y_c zeroed; pre-activation BN {layer.bn_node!r} "
                "before the next layer not touched (it still adds its shift for the channel)")
    return f"{layer.node_name}: weights and bias zeroed" + (
        " (BN folded: the post-BN output is 0)" if layer.bn_folded else "")


def lesion_channels(model: onnx.ModelProto, layer: Layer, channels: Sequence[int]
                    ) -> onnx.ModelProto:
    """A copy of ``model`` with output channels ``channels`` of ``layer`` zeroed (METHODS §B5).

    BN-aware as in the module docstring; shapes re-inferred, full checker passed.  Works for
    Conv, ConvTranspose, Gemm and MatMul layers.  Never modifies ``model``.
    Raises OnnxDiagError for a channel out of range or a non-constant parameter.
    """
    chans = _check_channels(layer, channels)
    ed = ModelEditor(model)
    _apply_lesion(ed, layer, chans)
    return ed.finish()


# -- substitution --------------------------------------------------------------------------
def _substitution_matrix(layer: Layer, channels, peers, beta, intercept):
    """(C, C) map M and (C,) bias b with y' = M y + b: identity except rows ``channels``."""
    chans = [int(c) for c in channels]
    if len(_check_channels(layer, chans)) != len(chans) \
            or not len(peers) == len(beta) == len(intercept) == len(chans):
        raise ValueError("channels must be distinct, with one peers/beta/intercept entry each")
    matrix, bias = np.eye(layer.n_out), np.zeros(layer.n_out)
    for c, p, b, a in zip(chans, peers, beta, intercept):
        p = np.asarray(p, dtype=np.int64).reshape(-1)
        b = np.asarray(b, dtype=np.float64).reshape(-1)
        if len(p) and len(_check_channels(layer, p)) != len(p) or c in p or len(p) != len(b):
            raise ValueError(f"channel {c}: peers must be distinct, exclude the channel and "
                             "have one beta each")
        matrix[c] = 0.0
        matrix[c, p] = b
        bias[c] = float(a)
    return matrix, bias


def _apply_substitution(ed: ModelEditor, layer: Layer, matrix, bias) -> None:
    dtype = _constant(ed, layer.weight).dtype
    pre = ed.unique(f"{layer.output}_presub")
    ed.set_output(layer.node_name, 0, pre)  # the new node produces the original name
    name = ed.unique(f"{layer.node_name}_substitute")
    b = ed.add_initializer(f"{name}.bias", bias.astype(dtype))
    if layer.op_type.startswith("Conv"):
        w = matrix.reshape(*matrix.shape, *(1,) * len(layer.kernel)).astype(dtype)
        new = [helper.make_node("Conv", [pre, ed.add_initializer(f"{name}.weight", w), b],
                                [layer.output], name=name)]
    else:  # channels are the last axis: y' = y Mᵀ + b
        w = ed.add_initializer(f"{name}.weight", matrix.T.astype(dtype))
        mid = ed.unique(f"{name}_matmul")
        new = [helper.make_node("MatMul", [pre, w], [mid], name=mid),
               helper.make_node("Add", [mid, b], [layer.output], name=ed.unique(f"{name}_add"))]
    ed.insert_after(layer.node_name, new)


def substitute_channels(model: onnx.ModelProto, layer: Layer, channels: Sequence[int],
                        peers: Sequence[Sequence[int]], beta: Sequence[Sequence[float]],
                        intercept: Sequence[float]) -> onnx.ModelProto:
    """A copy of ``model`` where y_c (c = channels[k]) of ``layer``'s pre-BN output is
    replaced by intercept[k] + beta[k] @ y[peers[k]] (METHODS §B5 peer substitution).

    One inserted node (1×1 Conv; MatMul+Add for Gemm/MatMul) reads the original outputs.
    Shapes re-inferred, full checker passed.  Never modifies ``model``.
    Raises ValueError for inconsistent coefficients, OnnxDiagError for bad channels.
    """
    matrix, bias = _substitution_matrix(layer, channels, peers, beta, intercept)
    ed = ModelEditor(model)
    _apply_substitution(ed, layer, matrix, bias)
    return ed.finish()


def substitute_channel(model: onnx.ModelProto, layer: Layer, channel: int,
                       peers: Sequence[int], beta: Sequence[float], intercept: float
                       ) -> onnx.ModelProto:
    """:func:`substitute_channels` for one channel, e.g. with the ``(peers, beta,
    intercept)`` of :func:`onnxdiag.channels.peer_regression`."""
    return substitute_channels(model, layer, [channel], [peers], [beta], [intercept])


# -- records ---------------------------------------------------------------------------------
class _Record:
    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class ChannelLesion(_Record):
    """One channel's lesion (and substitution) result (METHODS §B5).

    damage = loss(lesioned) − loss(base); acc_drop in percentage points; ``sub_*`` for the
    peer-substituted model (None without); recovery = (damage − sub_damage) / damage, None
    when damage ≤ MIN_DAMAGE.  ``peers`` / ``scores``: the channel's ChannelScores entries.
    """

    layer: str
    channel: int
    loss: float
    accuracy: float
    damage: float
    acc_drop: float
    sub_loss: float | None = None
    sub_damage: float | None = None
    sub_acc_drop: float | None = None
    recovery: float | None = None
    peers: tuple[int, ...] = ()
    scores: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PairLesion(_Record):
    """Two channels of one layer lesioned together; excess = damage − max(Δ_i, Δ_j)."""

    layer: str
    channels: tuple[int, int]
    loss: float
    accuracy: float
    damage: float
    acc_drop: float
    excess: float


@dataclass(frozen=True, eq=False)
class LesionStudy(_Record):
    """Base evaluation, per-channel and pair lesions, notes, parameters and timing
    (``seconds_per_edit``: mean of copy + edit + serialize + session + evaluation)."""

    base: Evaluation
    lesions: tuple[ChannelLesion, ...]
    pairs: tuple[PairLesion, ...]
    notes: tuple[str, ...]
    params: dict
    timing: dict

    def for_layer(self, layer: str) -> tuple[ChannelLesion, ...]:
        return tuple(r for r in self.lesions if r.layer == layer)

    def to_rows(self) -> list[dict]:
        """One dict per (layer, channel): the B5 columns, then every score (None if absent)."""
        names = list(dict.fromkeys(k for r in self.lesions for k in r.scores))
        cols = ("layer", "channel", "damage", "acc_drop", "sub_damage", "recovery")
        return [{**{c: getattr(r, c) for c in cols}, **{n: r.scores.get(n) for n in names}}
                for r in self.lesions]


# -- the study -----------------------------------------------------------------------------
class _Study:
    """One ORT session per edited model, built from the bytes of :meth:`ModelEditor.finish`
    (each edit checked in full; the base model is a no-op edit, evaluated once)."""

    def __init__(self, model, structure, source, providers):
        self.head, self.source, self.providers, self.times = structure.head, source, providers, []
        self.base = expose_tensors(model, [self.head.features, self.head.logits])
        self.base_eval = self.evaluate(lambda ed: None)
        self.base_seconds = self.times.pop()

    def evaluate(self, edit: Callable[[ModelEditor], None]) -> Evaluation:
        start = time.perf_counter()
        ed = ModelEditor(self.base)
        edit(ed)
        runner = OrtRunner(ed.finish().SerializeToString(), providers=self.providers)
        result = evaluate(runner, self.head, self.source)
        self.times.append(time.perf_counter() - start)
        return result

    def lesion(self, layer: Layer, chans) -> tuple[Evaluation, float, float]:
        """Evaluation, damage and accuracy drop (pp) of ``layer`` with ``chans`` zeroed."""
        ev = self.evaluate(lambda ed: _apply_lesion(ed, layer, np.asarray(chans)))
        return ev, ev.loss - self.base_eval.loss, 100.0 * (self.base_eval.accuracy - ev.accuracy)

    def channel(self, layer: Layer, c: int, scores, substitute: bool) -> ChannelLesion:
        ev, damage, drop = self.lesion(layer, [c])
        extra = {} if scores is None else {
            "peers": tuple(int(p) for p in scores.peers[c]),
            "scores": {k: float(v[c]) for k, v in scores.scores.items()}}
        if substitute and scores is not None:
            m, b = _substitution_matrix(layer, [c], [scores.peers[c]], [scores.peer_beta[c]],
                                        [scores.peer_intercept[c]])
            sv = self.evaluate(lambda ed: _apply_substitution(ed, layer, m, b))
            sub = sv.loss - self.base_eval.loss
            extra.update(sub_loss=sv.loss, sub_damage=sub, recovery=(damage - sub) / damage
                         if damage > MIN_DAMAGE else None,
                         sub_acc_drop=100.0 * (self.base_eval.accuracy - sv.accuracy))
        return ChannelLesion(layer.node_name, int(c), ev.loss, ev.accuracy, damage, drop, **extra)

    def pair(self, layer: Layer, pair: tuple[int, int], singles: dict) -> PairLesion:
        ev, damage, drop = self.lesion(layer, pair)
        return PairLesion(layer.node_name, pair, ev.loss, ev.accuracy, damage, drop,
                          damage - max(singles[pair[0]], singles[pair[1]]))


def _layer_rng(seed: int, layer: str) -> np.random.Generator:
    """Seeded per layer name: a layer's draw does not depend on the other layers."""
    return np.random.default_rng([seed, zlib.crc32(layer.encode())])


def _pick_channels(layer: Layer, given, sample: int | None, seed: int) -> np.ndarray:
    if given is not None:
        return _check_channels(layer, given)
    if sample is None or sample >= layer.n_out:
        return np.arange(layer.n_out)
    return np.sort(_layer_rng(seed, layer.node_name).choice(layer.n_out, sample, replace=False))


def _pick_pairs(chans: Sequence[int], pairs: int, rng) -> list[tuple[int, int]]:
    rows, cols = np.triu_indices(len(chans), 1)
    take = np.sort(rng.choice(len(rows), size=min(pairs, len(rows)), replace=False))
    return [(int(chans[rows[k]]), int(chans[cols[k]])) for k in take]


def _layer_plan(structure, name: str, scores, substitute: bool) -> tuple[Layer, list[str]]:
    """The layer (user errors for an unknown name or mismatched scores) and its notes."""
    try:
        layer = structure.get_layer(name)
    except KeyError as exc:
        raise OnnxDiagError(f"{exc.args[0]}; `onnxdiag inspect MODEL` lists the layers.") from exc
    if scores is not None and scores.n_channels != layer.n_out:
        raise OnnxDiagError(f"Scores for {name!r} have {scores.n_channels} channels but the "
                            f"layer has {layer.n_out}; score this model's layer.")
    if substitute and scores is not None and scores.peer_intercept is None:
        raise OnnxDiagError(f"Scores for {name!r} have no intercepts (scored without channel "
                            "means); rescore with mean_y to substitute.")
    skipped = substitute and scores is None
    return layer, [lesion_note(layer)] + [f"{name}: no scores, substitution skipped"] * skipped


def lesion_study(model: onnx.ModelProto, structure, eval_source, *, layers: Sequence[str],
                 channels: dict[str, Sequence[int]] | None = None, sample: int | None = None,
                 seed: int = 0, scores: dict | None = None, substitute: bool = False,
                 pairs: int = 0, providers=None, progress_label: str | None = None
                 ) -> LesionStudy:
    """METHODS §B5 lesions of ``layers`` evaluated on labelled, re-readable ``eval_source``.

    Per (layer, channel): damage and accuracy drop vs the base model (evaluated once); with
    ``substitute`` and ``scores[layer]`` (ChannelScores with intercepts) the substituted
    damage and recovery; with ``pairs`` > 0 that many seeded random pairs of the layer's
    studied channels and their excess damage.  ``channels[layer]`` fixes a layer's channels,
    else ``sample`` draws that many (seeded per layer; None = all).  One ORT session per
    edit, built from bytes.  Never modifies ``model``.

    Raises OnnxDiagError (unknown layer, bad channel, mismatched scores), DataError.
    """
    from ..runtime.progress import progress

    scores, channels, layers = scores or {}, channels or {}, list(dict.fromkeys(layers))
    study = _Study(model, structure, eval_source, providers)
    plan, notes = [], []
    for name in layers:
        layer, layer_notes = _layer_plan(structure, name, scores.get(name), substitute)
        notes += layer_notes
        plan += [(layer, int(c)) for c in _pick_channels(layer, channels.get(name), sample, seed)]
    jobs = progress(plan, len(plan), progress_label) if progress_label else plan
    rows = [study.channel(la, c, scores.get(la.node_name), substitute) for la, c in jobs]
    pair_rows = []
    for name in layers if pairs > 0 else ():
        singles = {r.channel: r.damage for r in rows if r.layer == name}
        chosen = _pick_pairs(sorted(singles), pairs, _layer_rng(seed + 1, name))
        pair_rows += [study.pair(structure.get_layer(name), p, singles) for p in chosen]
        notes += [] if chosen else [f"{name}: fewer than 2 channels studied, no pairs"]
    undefined = sum(r.sub_damage is not None and r.recovery is None for r in rows)
    notes += [f"recovery undefined (None) for {undefined} channel(s) whose lesion damage is "
              f"<= {MIN_DAMAGE:g}"] if undefined else []
    timing = {"base_seconds": study.base_seconds, "n_edits": len(study.times),
              "seconds_total": float(sum(study.times)),
              "seconds_per_edit": float(np.mean(study.times)) if study.times else None}
    params = {"layers": list(layers), "channels": {k: list(v) for k, v in channels.items()},
              "sample": sample, "seed": seed, "substitute": substitute, "pairs": pairs,
              "min_damage": MIN_DAMAGE}
    return LesionStudy(study.base_eval, tuple(rows), tuple(pair_rows), tuple(notes), params,
                       timing)
