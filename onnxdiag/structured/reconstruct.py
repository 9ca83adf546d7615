"""Structured reconstruction repair (docs/METHODS.md §E2): removed input channels of each
consumer regressed on the kept ones and folded into the consumer's weights.

For a consumer y = W x + b whose input channels R are removed and S kept, the dense
model's input moments (one streamed float64 pass, :func:`collect_input_moments`) give

    A = Σ_RS (Σ_SS + λI)⁻¹,  λ = ridge · mean diag Σ_SS,   c = μ_R − A μ_S,
    W'_{:,S} = W_{:,S} + W_{:,R} A,   b' = b + W_{:,R} c.

A k×k conv consumer gets the same A at every kernel tap and the bias term summed over
the taps, which is exact away from the borders only: where a tap falls on the zero
padding both x_R and x_S are 0 there, while c is still added (our approximation, noted in
the record).  Grouped and depthwise consumers cannot mix channels and are skipped.

:func:`reconstruct_model` folds the repair into a copy of the **dense** model (the removed
columns are still there, and are sliced away by :func:`~onnxdiag.structured.prune_channels`
afterwards), so that pruning the result equals "prune, then repair". Never modifies its
input model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np
import onnx
from onnx import helper

from ..graph import GraphIndex, Structure
from ..graph._records import jsonable
from ..model.edit import ModelEditor
from ..stats import Moments
from .rows import expose_sampled_rows, gatherable, position_feeds

#: λ = DEFAULT_RIDGE · mean diag Σ_SS (docs/METHODS.md §E2, our default).
DEFAULT_RIDGE = 0.01
#: Widest consumer input reconstructed: its float64 covariance is MAX_FEATURES² · 8 bytes
#: (128 MiB) and the greedy choice inverts it (a Flatten into a Gemm can be far wider).
MAX_FEATURES = 4096


@dataclass(frozen=True)
class ConsumerSite:
    """A layer reading a prunable group's channels: its input ``tensor`` (the tensor it
    reads, after any BN / activation), weight ``layout`` and input width ``n_in``;
    ``skip``: why it cannot be reconstructed (a grouped conv), or None."""

    node_name: str
    tensor: str
    layout: str
    n_in: int
    channels_axis: int
    skip: str | None = None


@dataclass(frozen=True)
class LayerRepair:
    """One consumer's reconstruction: removed / kept input counts, λ, and its output
    error relative to its dense output power, unrepaired vs reconstructed (from the
    moments; exact for Gemm, MatMul and 1×1 convs at dense inputs, a k×k conv's taps
    counted as if independent)."""

    node_name: str
    n_removed: int
    n_kept: int
    ridge: float
    error_before: float
    error_after: float
    skipped: str | None = None

    def to_dict(self) -> dict:
        return {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class ReconstructionRecord:
    """What :func:`reconstruct_model` did: one :class:`LayerRepair` per consumer, notes."""

    layers: tuple[LayerRepair, ...]
    ridge: float
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        done = [la for la in self.layers if la.skipped is None]
        return {"ridge": self.ridge, "layers": [la.to_dict() for la in self.layers],
                "n_reconstructed": len(done), "notes": list(self.notes),
                "mean_error_before": _mean([la.error_before for la in done]),
                "mean_error_after": _mean([la.error_after for la in done])}


def _mean(values) -> float | None:
    return float(np.mean(values)) if values else None


# -- where ------------------------------------------------------------------------------------
def consumer_sites(structure: Structure, group_ids=None) -> dict[str, ConsumerSite]:
    """{consumer node: site} of every consumer of the groups ``group_ids`` (default: every
    prunable group)."""
    wanted = [g.group_id for g in structure.groups if g.prunable] if group_ids is None \
        else [int(g) for g in group_ids]
    out = {}
    for gid in wanted:
        for consumer in structure.groups[gid].consumers:
            layer = structure.get_layer(consumer.node_name)
            conv = layer.weight_layout == "oihw"
            skip = f"grouped conv (groups={layer.groups}) cannot mix channels" \
                if layer.groups > 1 else f"input of {layer.n_in} features is wider than " \
                f"{MAX_FEATURES}" if layer.n_in > MAX_FEATURES else None
            out[layer.node_name] = ConsumerSite(layer.node_name, layer.input,
                                                layer.weight_layout, layer.n_in,
                                                1 if conv else -1, skip)
    return out


def removed_inputs(structure: Structure, removed: Mapping) -> dict[str, list[int]]:
    """{consumer node: its removed input features, ascending} for ``removed``
    ({group id: channels}); a consumer reading several pruned groups (a Concat) loses
    the union."""
    out: dict[str, set[int]] = defaultdict(set)
    for gid, channels in removed.items():
        for c in structure.groups[int(gid)].consumers:
            out[c.node_name].update((c.channel_offset + ch) * c.block_size + j
                                    for ch in channels for j in range(c.block_size))
    return {k: sorted(v) for k, v in out.items() if v}


# -- statistics -------------------------------------------------------------------------------
#: Spatial positions sampled per image for a conv consumer's input, as the statistics pass
#: of docs/METHODS.md §B1 (all when H·W is smaller); every token of a MatMul / Gemm
#: consumer's input is taken.
DEFAULT_POSITIONS = 16


def collect_input_moments(model: onnx.ModelProto, sites: Mapping[str, ConsumerSite], batches,
                          *, providers=None, positions: int | None = DEFAULT_POSITIONS,
                          seed: int = 0, in_graph: bool = True) -> dict[str, Moments]:
    """{input tensor: Moments over its channels} of the ``sites``' inputs in one pass over
    ``batches`` (a list of feed dicts or a DataSource): every token of a linear
    consumer's input is a sample; of a conv consumer's, ``positions`` seeded positions
    per image (docs/METHODS.md §B1's draw; None: every position). Where a conv input's
    spatial size is static the graph gathers the sampled rows itself (:mod:`.rows`; the
    same rows; ``in_graph=False``: exposed whole and sampled in NumPy). Never modifies
    ``model``."""
    from ..runtime.runner import OrtRunner, single_threaded_blas

    tensors = {s.tensor: s for s in sites.values() if s.skip is None}
    if not tensors:
        return {}
    exposed, wanted, inputs, convs, gathered = _moments_graph(model, tensors, positions,
                                                              in_graph)
    # threads that sleep between runs leave the cores to the moment updates (1.7 → 1.2 ×
    # a dense pass on 4,000 images, benchmarks/RESULTS.md)
    runner = OrtRunner(exposed, providers=providers, spinning=False)
    moments = {t: Moments(s.n_in) for t, s in tensors.items()}
    extra = (lambda idx: position_feeds(inputs, positions, seed, idx)) if inputs else None
    with single_threaded_blas():  # small products between ORT runs on the same cores
        for indices, out in _stream(runner, batches, list(wanted.values()), extra):
            for t, s in tensors.items():
                x = out[wanted[t]]
                rows = _sampled(x, positions, seed, indices) if t in convs else \
                    x.reshape(-1, s.n_in) if t in gathered else channel_rows(x, s.channels_axis)
                moments[t].update(rows)
    return moments


def _moments_graph(model, tensors, positions, in_graph):
    """(graph, {tensor: its output}, {positions input: spatial size}, {conv input sampled
    in NumPy: rank}, {conv input gathered in the graph}) for :func:`collect_input_moments`."""
    from ..model.expose import expose_channels_last, expose_tensors

    index = GraphIndex(model)
    ranks = {t: index.rank(t) for t, s in tensors.items() if s.channels_axis == 1}
    convs = {t: r for t, r in ranks.items() if r is not None and r > 2}
    sizes = {t: gatherable(index, t, tensors[t].n_in, positions) for t in convs} \
        if in_graph else {}
    gathered = {t: (convs.pop(t), n, tensors[t].n_in) for t, n in sizes.items() if n}
    # conv inputs channels-last: ORT folds the Transpose into its blocked layout's reorder
    exposed, names = expose_channels_last(model, convs, tag="recon")
    inputs = {}
    if gathered:
        exposed, rows, inputs = expose_sampled_rows(exposed, gathered, tag="recon_rows")
        names.update(rows)
    linear = [t for t in tensors if t not in convs and t not in gathered]
    exposed = expose_tensors(exposed, linear) if linear else exposed
    return exposed, {t: names.get(t, t) for t in tensors}, inputs, convs, set(gathered)


def _sampled(x: np.ndarray, positions: int | None, seed: int, indices) -> np.ndarray:
    """Rows (samples, C) of a channels-last (N, …, C) map: ``positions`` per image drawn
    as docs/METHODS.md §B1 (stats.draw_positions), or all."""
    from ..stats import draw_positions

    flat = x.reshape(x.shape[0], -1, x.shape[-1])
    if positions is None or flat.shape[1] <= positions:
        return flat.reshape(-1, x.shape[-1])
    picked = draw_positions(flat.shape[1], positions, seed=seed, sample_indices=indices)
    return flat[np.arange(flat.shape[0])[:, None], picked].reshape(-1, x.shape[-1])


def _stream(runner, batches, names, extra=None):
    """(sample indices, outputs) per batch; ``extra(indices)``: feeds added to each."""
    def feeds_of(feeds, indices):
        return {**feeds, **extra(indices)} if extra is not None else feeds

    if isinstance(batches, list):
        seen = 0
        for feeds in batches:
            n = len(next(iter(feeds.values())))
            indices = np.arange(seen, seen + n)
            yield indices, runner.run(feeds_of(feeds, indices), names)
            seen += n
    else:
        for batch in batches.batches():
            yield batch.indices, runner.run(feeds_of(batch.feeds, batch.indices), names)


def channel_rows(x: np.ndarray, axis: int) -> np.ndarray:
    """``x`` as (samples, channels): channels on ``axis`` (1 for NC…, −1 for …C)."""
    x = np.moveaxis(np.asarray(x), axis, -1)
    return x.reshape(-1, x.shape[-1])


# -- the fit and the fold ---------------------------------------------------------------------
def fit_reconstruction(moments: Moments, removed, ridge: float = DEFAULT_RIDGE):
    """(A (|R|, |S|), c (|R|,), kept S, λ) regressing the removed inputs on the kept ones
    (module docstring)."""
    n = moments.n_features
    r = np.asarray(sorted(int(i) for i in removed), dtype=np.int64)
    s = np.setdiff1d(np.arange(n), r)
    cov, mu = moments.cov(), moments.mean
    css = cov[np.ix_(s, s)]
    lam = float(ridge) * float(np.mean(np.diag(css))) if s.size else 0.0
    a = np.linalg.solve(css + lam * np.eye(s.size), cov[np.ix_(s, r)]).T
    return a, mu[r] - a @ mu[s], s, lam


def fold(weight: np.ndarray, bias: np.ndarray | None, layout: str, a, c, r, s):
    """(W', b') of the module docstring for a weight in ``layout`` (oihw, oi or io);
    ``bias`` None counts as zeros.  Float64 arithmetic, the weight's dtype back."""
    w = np.asarray(weight, dtype=np.float64)
    w = w.T if layout == "io" else w  # (out, in, ...)
    b = np.zeros(w.shape[0]) if bias is None else np.asarray(bias, np.float64).ravel()
    w_r = w[:, r]
    out = w.copy()
    out[:, s] += np.einsum("or...,rs->os...", w_r, a)
    b_new = b + w_r.reshape(w_r.shape[0], w_r.shape[1], -1).sum(axis=2) @ c
    out = out.T if layout == "io" else out
    return out.astype(weight.dtype), b_new


def weight_gram(weight: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """(G = Σ_{o,taps} w wᵀ over the input channels, W̄ = Σ_taps W as (out, in))."""
    w = np.asarray(weight, dtype=np.float64)
    w = w.T if layout == "io" else w
    taps = w.reshape(w.shape[0], w.shape[1], -1)
    return np.einsum("oit,ojt->ij", taps, taps), taps.sum(axis=2)


def output_errors(moments: Moments, weight, layout: str, r, a) -> tuple[float, float]:
    """(error unrepaired, error reconstructed), each relative to the consumer's dense
    output power: zeroing R costs tr(G_RR Σ_RR) + ‖W̄_R μ_R‖²; the reconstruction leaves
    tr(G_RR E) with E the residual covariance of x_R − A x_S (mean matched by c)."""
    g, wbar = weight_gram(weight, layout)
    cov, mu = moments.cov(), moments.mean
    r = np.asarray(r, dtype=np.int64)
    s = np.setdiff1d(np.arange(cov.shape[0]), r)
    power = float(np.sum(g * cov) + np.sum((wbar @ mu) ** 2))
    g_rr = g[np.ix_(r, r)]
    before = float(np.sum(g_rr * cov[np.ix_(r, r)]) + np.sum((wbar[:, r] @ mu[r]) ** 2))
    c_rs = cov[np.ix_(r, s)]
    resid = cov[np.ix_(r, r)] - a @ c_rs.T - c_rs @ a.T + a @ cov[np.ix_(s, s)] @ a.T
    after = float(np.sum(g_rr * resid))
    scale = power if power > 0 else 1.0
    return before / scale, max(after, 0.0) / scale


# -- the model edit ---------------------------------------------------------------------------
def reconstruct_model(model: onnx.ModelProto, structure: Structure, removed: Mapping,
                      moments: Mapping[str, Moments], *, ridge: float = DEFAULT_RIDGE
                      ) -> tuple[onnx.ModelProto, ReconstructionRecord]:
    """A copy of the dense ``model`` with every consumer of the ``removed`` channels
    ({group id: channels}) reconstructed from ``moments`` (:func:`collect_input_moments`
    of the dense model); prune it with the same ``removed`` afterwards.  Consumers
    without a bias get one (a Conv / Gemm input, an Add after a MatMul)."""
    sites = consumer_sites(structure, list(removed))
    editor = ModelEditor(model)
    repairs, notes = [], []
    for name, r in removed_inputs(structure, removed).items():
        site = sites[name]
        if site.skip is not None:
            repairs.append(LayerRepair(name, len(r), site.n_in - len(r), 0.0, float("nan"),
                                       float("nan"), site.skip))
            continue
        repairs.append(_repair_one(editor, structure.get_layer(name), site, r,
                                   moments[site.tensor], ridge))
    if any(structure.get_layer(la.node_name).kernel not in ((), (1,), (1, 1))
           for la in repairs if la.skipped is None):
        notes.append("k×k conv consumers: the same A at every tap and the bias shift summed "
                     "over the taps, exact away from the zero-padded border only")
    skipped = [la.node_name for la in repairs if la.skipped]
    if skipped:
        why = sorted({la.skipped for la in repairs if la.skipped})
        notes.append(f"not reconstructed: {', '.join(skipped[:5])} ({'; '.join(why[:2])})")
    return editor.finish(), ReconstructionRecord(tuple(repairs), ridge, tuple(notes))


def _repair_one(editor: ModelEditor, layer, site: ConsumerSite, r, moment: Moments,
                ridge: float) -> LayerRepair:
    """Fit, fold and write one consumer's repair; its LayerRepair."""
    weight = editor.value(layer.weight)
    bias = editor.value(layer.bias) if layer.bias else None
    a, c, s, lam = fit_reconstruction(moment, r, ridge)
    before, after = output_errors(moment, weight, site.layout, r, a)
    w_new, b_new = fold(weight, bias, site.layout, a, c, r, s)
    editor.set_input(layer.node_name, 1, w_new)
    _write_bias(editor, layer, bias, b_new.astype(weight.dtype))
    return LayerRepair(layer.node_name, len(r), len(s), lam, before, after)


def _write_bias(editor: ModelEditor, layer, old, new: np.ndarray) -> None:
    """The consumer's bias := ``new``: in place (its bias input, or the Add after it), or a
    new one (Conv / Gemm input 2, an Add after a MatMul)."""
    if old is not None:
        node = editor.node(layer.bias_node) if layer.bias_node else editor.node(layer.node_name)
        slot = list(node.input).index(layer.bias)
        # a bias that broadcast one value (Gemm's C of shape (1,)) becomes per-channel
        shape = np.shape(old) if np.size(old) == new.size else new.shape
        editor.set_input(node.name, slot, new.reshape(shape))
        return
    if layer.op_type in ("Conv", "Gemm"):
        editor.set_input(layer.node_name, 2, new)
        return
    bias = editor.add_initializer(f"{layer.node_name}.reconstructed_bias", new)
    out = editor.unique(f"{layer.output}_before_bias")
    editor.set_output(layer.node_name, 0, out)
    editor.insert_after(layer.node_name, [helper.make_node(
        "Add", [out, bias], [layer.output], name=editor.unique(f"{layer.node_name}/bias"))])


def prune_reconstructed(model: onnx.ModelProto, structure: Structure, removed: Mapping,
                        moments: Mapping[str, Moments], *, ridge: float = DEFAULT_RIDGE,
                        features: str | None = None):
    """(pruned model, PruneRecord, ReconstructionRecord): the consumers of ``removed``
    reconstructed on the dense ``model`` (:func:`reconstruct_model`), then the channels
    removed. The folded model is analysed again (a bias added to a consumer that is also
    a pruned member is sliced with it); its groups must be the dense model's."""
    import dataclasses

    from ..graph import analyze_structure
    from ..model.finalize import EditError
    from .prune import prune_channels

    folded, record = reconstruct_model(model, structure, removed, moments, ridge=ridge)
    head = structure.head.node_name if structure.head is not None else None
    again = analyze_structure(folded, head=head, features=features,
                              require_head=head is not None)
    for gid in removed:
        old, new = structure.groups[int(gid)], again.groups[int(gid)] \
            if int(gid) < len(again.groups) else None
        if new is None or new.members != old.members or new.n_channels != old.n_channels:
            raise EditError(f"channel group {gid} changed under the reconstruction's edit")
    pruned, prune_record = prune_channels(folded, dataclasses.replace(again, head=None),
                                          removed)
    return pruned, prune_record, record
