"""Label-free repair of a pruned model: CR, BN recalibration, folded-BN affine (METHODS §C1).

Methods (``METHODS``): ``none``; ``bn`` (BN recalibration); ``cr`` / ``layer-cr`` /
``shrunk-cr`` (channel-wise, one-scalar-per-layer and shrunk variance matching) and
each of them ``+bn``.  Per repaired Conv ℓ (pre-BN output y, σ / μ over images ×
positions, unbiased):

- channel CR: α_c = min(cap, σ^d_c / (σ^p_c + 1e-8)); layer CR: one α = σ^d / (σ^p + 1e-8)
  with σ² the mean of the channel variances; shrunk CR: λ_c = r_c / (r_c + median r),
  r_c = σ^p²/σ^d², log α_c ← λ_c log α_c.  α scales the conv's output-channel weights
  and its bias (the conv's bias input or the constant of its bias Add).
- BN recalibration: each BatchNormalization's mean / variance ← the batch statistics of
  its input (unbiased variance) in the pruned, upstream-repaired model.
- Conv without BN (folded by the exporter, or absent) with a ``bn`` part: the affine
  y' = (y − μ^p)·α + μ^d (α from the CR variant; for ``bn`` the channel α) folded into
  the conv's weights and bias (a bias input is added when there is none).

Only what pruning changed is touched (**our default**, ``recalibrate="affected"``): convs
and BNs downstream of a pruned weight; ``recalibrate="all"`` recalibrates every BN.
The head is pruned but never rescaled (METHODS §C1 repairs Conv outputs).

Cost: one dense pass (dense σ, μ of the repaired convs) plus one sequential pass run in
segments (:class:`~onnxdiag.sparsity.segments.SegmentedPass`): every node once per
calibration image, one ONNX Runtime session per measurement point.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from ..errors import DataError, OnnxDiagError
from ..graph import GraphIndex
from ..graph._records import jsonable
from ..model.edit import ModelEditor
from ..model.expose import expose_tensors
from ..runtime.runner import OrtRunner
from ..stats import Moments
from .masks import write_masks
from .segments import SegmentedPass

METHODS = ("none", "bn", "cr", "cr+bn", "layer-cr", "layer-cr+bn", "shrunk-cr", "shrunk-cr+bn")
RECALIBRATE = ("affected", "all")
CR_EPS = 1e-8


@dataclass(frozen=True, eq=False)
class LayerRepair:
    """What was folded into one conv: y' = alpha·y + shift (per output channel).

    ``kind``: "scale" (CR; a BN follows or no BN part was asked) or "affine" (no BN:
    CR and re-standardisation in one).  Arrays are (C,); ``shift`` is zeros for "scale".
    """

    layer: str
    kind: str
    alpha: np.ndarray
    shift: np.ndarray
    sigma_dense: np.ndarray
    sigma_pruned: np.ndarray
    n_capped: int

    def to_dict(self, *, arrays: bool = False) -> dict:
        d = {"layer": self.layer, "kind": self.kind, "n_capped": self.n_capped,
             "alpha_min": float(self.alpha.min()), "alpha_median": float(np.median(self.alpha)),
             "alpha_max": float(self.alpha.max())}
        if arrays:
            d.update({k: jsonable(getattr(self, k)) for k in (
                "alpha", "shift", "sigma_dense", "sigma_pruned")})
        return d


@dataclass(frozen=True, eq=False)
class BNRepair:
    """New running statistics of one BatchNormalization: (C,) mean and unbiased var."""

    bn_node: str
    mean: np.ndarray
    var: np.ndarray
    n_samples: int

    def to_dict(self, *, arrays: bool = False) -> dict:
        d = {"bn_node": self.bn_node, "n_samples": self.n_samples}
        if arrays:
            d.update(mean=jsonable(self.mean), var=jsonable(self.var))
        return d


@dataclass(frozen=True, eq=False)
class RepairRecord:
    """The result of :func:`repair_model` (for the sidecar JSON, METHODS §C5).

    ``passes``: {"dense": full dense passes, "sequential": 1 when anything was repaired,
    "segments": ONNX Runtime sessions of the sequential pass}.
    """

    method: str
    alpha_cap: float
    recalibrate: str
    n_images: int
    layers: dict[str, LayerRepair]
    bns: dict[str, BNRepair]
    passes: dict
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self, *, arrays: bool = False) -> dict:
        return {"method": self.method, "alpha_cap": self.alpha_cap,
                "recalibrate": self.recalibrate, "n_images": self.n_images,
                "layers": {k: v.to_dict(arrays=arrays) for k, v in self.layers.items()},
                "bns": {k: v.to_dict(arrays=arrays) for k, v in self.bns.items()},
                "passes": dict(self.passes), "notes": list(self.notes)}


def parse_method(method: str) -> tuple[str | None, bool]:
    """``(cr_kind, with_bn)``: cr_kind in {None, "channel", "layer", "shrunk"}."""
    if method not in METHODS:
        raise OnnxDiagError(f"Unknown repair method {method!r}; choose one of "
                            f"{', '.join(METHODS)}.")
    with_bn = method == "bn" or method.endswith("+bn")
    base = method.removesuffix("+bn")
    kind = {"cr": "channel", "layer-cr": "layer", "shrunk-cr": "shrunk"}.get(base)
    return kind, with_bn


def cr_alpha(kind: str, var_dense: np.ndarray, var_pruned: np.ndarray,
             cap: float = 100.0) -> np.ndarray:
    """α (C,) of a CR variant (METHODS §C1) from per-channel dense / pruned variances."""
    vd, vp = np.maximum(var_dense, 0.0), np.maximum(var_pruned, 0.0)
    if kind == "layer":
        a = np.full(vd.shape, np.sqrt(vd.mean()) / (np.sqrt(vp.mean()) + CR_EPS))
    else:
        a = np.sqrt(vd) / (np.sqrt(vp) + CR_EPS)
    a = np.minimum(a, cap)
    if kind == "shrunk":
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(vd > 0, vp / np.where(vd > 0, vd, 1.0), np.inf)
            med = float(np.median(r[np.isfinite(r)])) if np.isfinite(r).any() else 0.0
            lam = np.where(np.isinf(r), 1.0, np.divide(r, r + med, out=np.ones_like(r),
                                                       where=(r + med) > 0))
            a = np.where(a > 0, np.exp(lam * np.log(np.where(a > 0, a, 1.0))), 0.0)
    return a


def repair_model(model: onnx.ModelProto, structure, masks: dict, calib_source, *,
                 method: str = "cr+bn", alpha_cap: float = 100.0, n_images: int | None = None,
                 recalibrate: str = "affected", providers=None, threads: int | None = None
                 ) -> tuple[onnx.ModelProto, RepairRecord]:
    """Prune ``model`` with ``masks`` and repair it on calibration data (METHODS §C1).

    Args:
        structure: :func:`~onnxdiag.graph.analyze_structure` of ``model``.
        masks: {layer node name: bool mask (True = kept)} (see :func:`make_masks`).
        calib_source: a DataSource or an iterable of feed dicts; the first ``n_images``
            samples (all when None) are held in memory for the sequential pass.
        method: one of ``METHODS``; alpha_cap: CR's cap on α (**our default** 100).

    Returns the repaired copy (``model`` is never modified; masks and repairs are one
    edit, checked once by ``ModelEditor.finish``) and its :class:`RepairRecord`.
    """
    cr_kind, with_bn = parse_method(method)
    if recalibrate not in RECALIBRATE:
        raise OnnxDiagError(f"recalibrate must be one of {', '.join(RECALIBRATE)}.")
    editor = ModelEditor(model)
    write_masks(editor, masks)
    batches = collect_batches(calib_source, n_images)
    index = editor.index
    affected = _affected(index, [n for n, m in masks.items() if not np.all(m)])
    convs = [la for la in structure.layers if la.node_name in masks and la.op_type == "Conv"
             and not la.is_head and la.output in affected]
    repaired = [la for la in convs if cr_kind or (with_bn and la.bn_node is None)]
    bns = [n for n in index.nodes if with_bn and n.op_type == "BatchNormalization"
           and (recalibrate == "all" or n.input[0] in affected)]
    n = sum(_batch_len(b) for b in batches)
    passes = {"dense": int(bool(repaired)), "sequential": int(bool(repaired or bns)),
              "segments": 0}
    if not (repaired or bns):
        return editor.finish(), RepairRecord(method, alpha_cap, recalibrate, n, {}, {}, passes)
    dense = _dense_moments(model, repaired, batches, providers, threads)
    done_layers, done_bns, passes["segments"] = _sequential(
        editor, index, batches, repaired, dense, bns, cr_kind, with_bn, alpha_cap, providers,
        threads)
    return editor.finish(), RepairRecord(method, alpha_cap, recalibrate, n, done_layers,
                                         done_bns, passes)


def _sequential(editor, index, batches, convs, dense, bns, cr_kind, with_bn, alpha_cap,
                providers, threads) -> tuple[dict, dict, int]:
    """Repair ``convs`` (to ``dense`` moments) and recalibrate ``bns`` of the model in
    ``editor`` in topological order, each measured with the upstream repairs in place;
    returns (LayerRepair per conv, BNRepair per BN, sessions run)."""
    seg = SegmentedPass(editor.model, batches, providers=providers, threads=threads)
    items = sorted([(seg.position(la.output), 0, i) for i, la in enumerate(convs)]
                   + [(seg.position(b.input[0]), 1, i) for i, b in enumerate(bns)])
    done_layers, done_bns = {}, {}
    for pos, kind, i in items:
        tensor = convs[i].output if kind == 0 else bns[i].input[0]
        seg.run_to(pos, keep=[tensor])
        if kind == 0:
            la = convs[i]
            done_layers[la.node_name] = _repair_conv(
                seg, editor, index, la, dense[la.node_name], cr_kind, with_bn, alpha_cap)
        else:
            done_bns[bns[i].name] = _recalibrate_bn(seg, editor, bns[i])
    return done_layers, done_bns, seg.n_segments


def recalibrate_batchnorm(model: onnx.ModelProto, calib_source, *, dense_model=None,
                          kept_channels: dict | None = None, alpha_cap: float = 100.0,
                          n_images: int | None = None, head: str | None = None,
                          dense_moments: dict | None = None, providers=None,
                          threads: int | None = None) -> tuple[onnx.ModelProto, RepairRecord]:
    """Label-free recovery of a model whose channels were removed (structured pruning).

    Every BatchNormalization's running mean / variance is set to the batch statistics of
    its input (unbiased variance) on ``calib_source``. With ``dense_model`` (the model
    before pruning, same node names), every non-head Conv *without* a BN (folded by the
    exporter, or absent) gets the equivalent re-standardisation instead, as METHODS §C1's
    ``bn`` repair: y' = (y − μ^p)·σ^d/σ^p + μ^d per output channel (σ ratio capped at
    ``alpha_cap``), folded into its weights and bias, where μ^d, σ^d are the dense
    model's statistics of the same channel: ``kept_channels`` maps a conv to the dense
    output-channel index of each channel it still has (absent: unchanged width).
    Everything happens in topological order, each measurement with the upstream
    repairs in place (one forward pass in segments). The first ``n_images`` samples (all
    when None) are held in memory. ``head``: the head node (never re-standardised; default
    the detected one). ``dense_moments``: :func:`conv_output_moments` of the dense model on
    the same samples, when already computed (e.g. once for many pruned variants).
    Returns a checked copy (``model`` is never modified) and a :class:`RepairRecord`
    (method "bn", recalibrate "all").
    """
    editor = ModelEditor(model)
    batches = collect_batches(calib_source, n_images)
    n = sum(_batch_len(b) for b in batches)
    index = editor.index
    bns = [node for node in index.nodes if node.op_type == "BatchNormalization"]
    folded = _convs_without_bn(editor.model, head)
    notes = []
    if folded and dense_model is None:
        notes.append(f"{len(folded)} conv(s) without BatchNormalization left as they are "
                     "(give the dense model to re-standardise them)")
        folded = []
    if not bns and not folded:
        notes.append("no BatchNormalization node (BN folded into the convs?): nothing to "
                     "recalibrate")
        return editor.finish(), RepairRecord("bn", alpha_cap, "all", n, {}, {},
                                             {"dense": 0, "sequential": 0, "segments": 0},
                                             tuple(notes))
    dense = {}
    if folded:
        full = dense_moments if dense_moments is not None else conv_output_moments(
            dense_model, batches, head=head, providers=providers, threads=threads)
        missing = [la.node_name for la in folded if la.node_name not in full]
        if missing:
            raise OnnxDiagError(f"Conv {missing[0]!r} is not a conv without BN in the dense "
                                "model; pass the model this one was pruned from.")
        kept_channels = kept_channels or {}
        for la in folded:
            keep = kept_channels.get(la.node_name, range(la.n_out))
            if len(keep) != la.n_out:
                raise OnnxDiagError(f"Conv {la.node_name!r} has {la.n_out} output channels "
                                    f"but {len(keep)} kept channels were given.")
            dense[la.node_name] = full[la.node_name].select(keep)
    done_layers, done_bns, segments = _sequential(editor, index, batches, folded, dense, bns,
                                                  None, True, alpha_cap, providers, threads)
    return editor.finish(), RepairRecord("bn", alpha_cap, "all", n, done_layers, done_bns,
                             {"dense": int(bool(folded)), "sequential": 1,
                              "segments": segments}, tuple(notes))


def conv_output_moments(model: onnx.ModelProto, batches: list[dict], *, head: str | None = None,
                        providers=None, threads: int | None = None) -> dict[str, Moments]:
    """Per-channel output moments of every non-head Conv without a BatchNormalization of
    ``model`` over ``batches`` (feed dicts), by node name: the dense statistics that
    :func:`recalibrate_batchnorm` re-standardises pruned convs to."""
    return _dense_moments(model, _convs_without_bn(model, head), batches, providers, threads)


def _convs_without_bn(model: onnx.ModelProto, head: str | None) -> list:
    from ..graph import analyze_structure

    structure = analyze_structure(model, head=head, require_head=head is not None)
    return [la for la in structure.layers
            if la.op_type == "Conv" and not la.is_head and la.bn_node is None]


def collect_batches(source, n_images: int | None) -> list[dict]:
    feeds_iter = (b.feeds for b in source.batches()) if hasattr(source, "batches") else source
    batches, seen = [], 0
    for feeds in feeds_iter:
        take = _batch_len(feeds) if n_images is None else min(n_images - seen, _batch_len(feeds))
        if take <= 0:
            break
        batches.append({k: np.asarray(v)[:take] for k, v in feeds.items()})
        seen += take
    if seen < 2:
        raise DataError(f"Repair needs at least 2 calibration samples, got {seen}; pass more "
                        "calibration data.")
    return batches


def _batch_len(feeds: dict) -> int:
    return int(np.shape(next(iter(feeds.values())))[0])


def _affected(index: GraphIndex, pruned_layers: list[str]) -> set[str]:
    """Tensors downstream of (and including) the outputs of the pruned layers."""
    todo = [t for name in pruned_layers for t in index.get_node(name).output]
    seen = set(todo)
    while todo:
        for node, _ in index.consumers_of(todo.pop()):
            for t in node.output:
                if t and t not in seen:
                    seen.add(t)
                    todo.append(t)
    return seen


def channel_rows(x: np.ndarray) -> np.ndarray:
    """(n, C, *spatial) or (n, C) → (n·Π spatial, C) float64 (channel axis 1)."""
    x = np.asarray(x, dtype=np.float64)
    return np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])


def _moments(arrays: list[np.ndarray]) -> Moments:
    acc = None
    for a in arrays:
        rows = channel_rows(a)
        if acc is None:
            acc = Moments(rows.shape[1], full=False)
        acc.update(rows)
    return acc


def _dense_moments(model, layers, batches, providers, threads) -> dict[str, Moments]:
    if not layers:
        return {}
    names = [la.output for la in layers]
    runner = OrtRunner(expose_tensors(model, names), providers=providers, threads=threads)
    outs = [runner.run(b, names) for b in batches]
    return {la.node_name: _moments([o[la.output] for o in outs]) for la in layers}


def _repair_conv(seg: SegmentedPass, editor: ModelEditor, index: GraphIndex, layer,
                 dense: Moments, cr_kind, with_bn: bool, cap: float) -> LayerRepair:
    node = index.get_node(layer.node_name)
    pruned = _moments(seg.frontier[layer.output])
    vd, vp = dense.var(), pruned.var()
    affine = with_bn and layer.bn_node is None
    alpha = cr_alpha(cr_kind or "channel", vd, vp, cap)
    w = _value(editor, node.input[1])
    editor.set_input(node.name, 1, (w * alpha.reshape(-1, *[1] * (w.ndim - 1))).astype(w.dtype))
    add_node, bias_pos = _bias_holder(index, layer, node)
    holder = add_node or node
    b = _value(editor, holder.input[bias_pos]) if bias_pos is not None else None
    b_flat = np.zeros(alpha.shape) if b is None else b.astype(np.float64).reshape(-1)
    shift = np.zeros(alpha.shape)
    if affine:  # y_full' = α (y_full − μ^p_full) + μ^d_full, μ_full = μ(y) + Add bias
        extra = b_flat if add_node is not None else 0.0
        shift = (dense.mean + extra) - alpha * (pruned.mean + extra)
    if b is not None or affine:
        new_b = alpha * b_flat + shift
        dtype = w.dtype if b is None else b.dtype
        shape = (-1,) if b is None else b.shape
        editor.set_input(holder.name, 2 if bias_pos is None else bias_pos,
                         new_b.reshape(shape).astype(dtype))
    in_conv = shift if add_node is None else np.zeros(alpha.shape)
    scale = alpha.reshape(1, -1, *[1] * (w.ndim - 2)).astype(np.float32)
    offset = in_conv.reshape(1, -1, *[1] * (w.ndim - 2)).astype(np.float32)
    seg.frontier[layer.output] = [(y * scale + offset).astype(y.dtype)
                                  for y in seg.frontier[layer.output]]
    return LayerRepair(layer.node_name, "affine" if affine else "scale", alpha, shift,
                       np.sqrt(vd), np.sqrt(vp), int(np.sum(alpha >= cap)))


def _bias_holder(index: GraphIndex, layer, node) -> tuple:
    """(Add node or None, input position of the bias in it / in the conv, or None)."""
    if len(node.input) > 2 and node.input[2]:
        return None, 2
    if layer.bias_node:
        add = index.get_node(layer.bias_node)
        return add, list(add.input).index(layer.bias)
    return None, None


def _value(editor: ModelEditor, name: str) -> np.ndarray:
    value = editor.value(name)  # initializers, Identity / Constant sources
    if value is None:
        raise OnnxDiagError(f"Tensor {name!r} is not a constant; cannot fold a repair into it.")
    return value


def _recalibrate_bn(seg: SegmentedPass, editor: ModelEditor, bn) -> BNRepair:
    acc = _moments(seg.frontier[bn.input[0]])
    mean, var = acc.mean, acc.var()
    for pos, value in ((3, mean), (4, var)):
        old = _value(editor, bn.input[pos])
        editor.set_input(bn.name, pos, value.reshape(old.shape).astype(old.dtype))
    return BNRepair(bn.name, mean, var, acc.n)
