"""Label-free repair of a pruned model: CR, BN recalibration, folded-BN affine (METHODS §C1).

Methods (``METHODS``): ``none``; ``bn`` (BN recalibration); ``cr`` / ``layer-cr`` /
``shrunk-cr`` (channel-wise, one-scalar-per-layer and shrunk variance matching) and
each of them ``+bn``; ``ls`` / ``ls+bn`` (the least-squares reconstruction of
METHODS §E1, :mod:`.ls_repair`, then BN recalibration).  Per repaired layer ℓ — a
Conv, or a Gemm / MatMul (METHODS §D:
channels = output features, positions = every leading axis) — with pre-BN output y and
σ / μ over samples × positions (unbiased):

- channel CR: α_c = min(cap, σ^d_c / (σ^p_c + 1e-8)); layer CR: one α = σ^d / (σ^p + 1e-8)
  with σ² the mean of the channel variances; shrunk CR: λ_c = r_c / (r_c + median r),
  r_c = σ^p²/σ^d², log α_c ← λ_c log α_c.  α scales the layer's output channels (a conv's
  output-channel weights, a linear layer's weight columns / rows) and its bias (the
  node's bias input or the constant of its bias Add); :mod:`.fold` does the writing.
- BN recalibration: each BatchNormalization's mean / variance ← the batch statistics of
  its input (unbiased variance) in the pruned, upstream-repaired model.
- A layer without BN (folded by the exporter, or absent) with a ``bn`` part: the affine
  y' = (y − μ^p)·α + μ^d (α from the CR variant; for ``bn`` the channel α) folded into
  its weights and bias (a bias is added when there is none) — for a linear layer only in
  a model without LayerNorm: under LayerNorm there is nothing to re-standardise, so a BN
  part acts on no linear layer and the record's ``notes`` say so (METHODS §D).

Only what pruning changed is touched (**our default**, ``recalibrate="affected"``): layers
and BNs downstream of a pruned weight; ``recalibrate="all"`` recalibrates every BN.
The head is pruned but never rescaled (**our default**, METHODS §C1).

Cost: one dense pass (dense σ, μ of the repaired layers) plus one sequential pass run in
segments (:class:`~onnxdiag.sparsity.segments.SegmentedPass`): every node once per
calibration image, one ONNX Runtime session per measurement point.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from ..model.edit import ModelEditor
from ..stats import Moments
from .fold import (  # noqa: F401 - LayerRepair, cr_alpha, channel_rows re-exported
    CR_EPS,
    LayerRepair,
    add_missing_bias,
    channel_rows,
    cr_alpha,
    dense_moments,
    has_layer_norm,
    uses_affine,
)
from .ls_dense import ls_dense
from .ls_repair import LSSettings, ls_sequential
from .masks import PRUNABLE_OPS, write_masks
from .recal import (  # noqa: F401 - BNRepair, bn_channels re-exported
    BNRepair,
    affected_tensors,
    bn_channels,
)
from .segments import batch_len, collect_batches, split_batches
from .sequential import sequential_repair

METHODS = ("none", "bn", "cr", "cr+bn", "layer-cr", "layer-cr+bn", "shrunk-cr", "shrunk-cr+bn",
           "ls", "ls+bn")
RECALIBRATE = ("affected", "all")


@dataclass(frozen=True, eq=False)
class RepairRecord:
    """The result of :func:`repair_model` (for the sidecar JSON, METHODS §C5).

    ``passes``: {"dense": dense passes run (0 when a shared cache had the moments),
    "sequential": 1 when anything was repaired,
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
    ls: dict | None = None  # the LS settings (METHODS §E1) of an ls repair
    #: {tensor: per-batch arrays} of ``repair_model``'s ``outputs`` as the sequential pass
    #: computed them in the repaired model (not in ``to_dict``); empty without that pass
    outputs: dict = field(default_factory=dict, repr=False)

    def to_dict(self, *, arrays: bool = False) -> dict:
        return {"method": self.method, "alpha_cap": self.alpha_cap, "ls": self.ls,
                "recalibrate": self.recalibrate, "n_images": self.n_images,
                "layers": {k: v.to_dict(arrays=arrays) for k, v in self.layers.items()},
                "bns": {k: v.to_dict(arrays=arrays) for k, v in self.bns.items()},
                "passes": dict(self.passes), "notes": list(self.notes)}


def parse_method(method: str) -> tuple[str | None, bool]:
    """``(cr_kind, with_bn)``: cr_kind in {None, "channel", "layer", "shrunk", "ls"}."""
    if method not in METHODS:
        raise OnnxDiagError(f"Unknown repair method {method!r}; choose one of "
                            f"{', '.join(METHODS)}.")
    with_bn = method == "bn" or method.endswith("+bn")
    base = method.removesuffix("+bn")
    kind = {"cr": "channel", "layer-cr": "layer", "shrunk-cr": "shrunk", "ls": "ls"}.get(base)
    return kind, with_bn


def repair_model(model: onnx.ModelProto, structure, masks: dict, calib_source, *,
                 method: str = "cr+bn", alpha_cap: float = 100.0, n_images: int | None = None,
                 recalibrate: str = "affected", providers=None, threads: int | None = None,
                 ls: LSSettings | None = None, label: str | None = None,
                 dense: dict | None = None, outputs: tuple[str, ...] = ()
                 ) -> tuple[onnx.ModelProto, RepairRecord]:
    """Prune ``model`` with ``masks`` and repair it on calibration data (METHODS §C1).

    Args:
        structure: :func:`~onnxdiag.graph.analyze_structure` of ``model``.
        masks: {layer node name: bool mask (True = kept)} (see :func:`make_masks`).
        calib_source: a DataSource or an iterable of feed dicts; the first ``n_images``
            samples (all when None) are held in memory for the sequential pass.
        method: one of ``METHODS``; alpha_cap: CR's cap on α (**our default** 100).
        ls: the :class:`~onnxdiag.sparsity.ls_repair.LSSettings` of ``ls`` / ``ls+bn``
            (default ``LSSettings()``).
        label: a progress bar with an ETA (stderr, a terminal only) over the sequential
            pass's layers and BNs; None: silent.
        dense: a cache {layer node name: Moments of its dense output on the same
            calibration samples}: when it lacks a layer the repair needs, every
            non-head layer of ``masks`` it lacks is measured (one dense pass) and added,
            so many repairs of one model (a sweep's cells) share one dense pass and get
            the same moments whatever their order.
        outputs: tensors (e.g. the head's logits) the cr / bn family's sequential pass
            runs on to after its last repair (``RepairRecord.outputs``: a fresh run of the
            returned model to float32 rounding; the pass caches α·y, the model uses α·W).

    Returns the repaired copy (``model`` is never modified; masks and repairs are one
    edit, checked once by ``ModelEditor.finish``) and its :class:`RepairRecord`, whose
    ``notes`` say when a BN part had nothing to act on (linear layers of a LayerNorm model).
    """
    cr_kind, with_bn = parse_method(method)
    if recalibrate not in RECALIBRATE:
        raise OnnxDiagError(f"recalibrate must be one of {', '.join(RECALIBRATE)}.")
    editor = ModelEditor(model)
    write_masks(editor, masks)
    batches = split_batches(collect_batches(calib_source, n_images))
    if cr_kind == "ls":
        return _repair_ls(model, editor, structure, masks, batches, method, alpha_cap,
                          recalibrate, ls or LSSettings(), providers, threads, label)
    plan = _plan(editor, structure, masks, method, recalibrate)
    n = sum(batch_len(b) for b in batches)
    passes = {"dense": 0, "sequential": int(bool(plan.layers or plan.bns)), "segments": 0}
    if not (plan.layers or plan.bns):
        return editor.finish(), RepairRecord(method, alpha_cap, recalibrate, n, {}, {}, passes,
                                             plan.notes)
    dense = {} if dense is None else dense
    if any(la.node_name not in dense for la in plan.dense_layers):
        # every layer a repair may need, in one session whatever this mask needs: the
        # moments (ORT fuses what is not exposed) are then the same for every repair
        todo = [la for la in structure.layers if not la.is_head and la.node_name in masks
                and la.op_type in PRUNABLE_OPS and la.node_name not in dense]
        dense.update(dense_moments(model, todo, batches, providers, threads))
        passes["dense"] = 1
    done_layers, done_bns, passes["segments"], values = sequential_repair(
        editor, batches, plan.layers, dense, plan.bns, cr_kind, plan.affine, alpha_cap,
        providers, threads, label, tuple(outputs))
    return editor.finish(), RepairRecord(method, alpha_cap, recalibrate, n, done_layers,
                                         done_bns, passes, plan.notes, outputs=values)


def _repair_ls(model, editor, structure, masks, batches, method, alpha_cap, recalibrate,
               settings, providers, threads, label=None) -> tuple[onnx.ModelProto,
                                                                  RepairRecord]:
    """``ls`` / ``ls+bn``: every masked layer pruning reached is refitted (METHODS §E1; a
    MatMul without a bias Add gets one for the bias correction), then with ``+bn`` the BNs
    of :func:`_plan` are recalibrated, all in one sequential pass. With dense inputs
    (``settings.inputs``) only the pruned layers are refitted, from one dense pass, and a
    sequential pass runs only for the BNs."""
    settings.check()
    index = editor.index
    affected = affected_tensors(index, [n for n, m in masks.items() if not np.all(m)])
    dense = settings.inputs == "dense"
    layers = [add_missing_bias(editor, la) for la in structure.layers
              if la.node_name in masks and la.op_type in PRUNABLE_OPS
              and (not np.all(masks[la.node_name]) or (la.input in affected and not dense))]
    _, with_bn = parse_method(method)
    bns = [node for node in editor.index.nodes if with_bn
           and node.op_type == "BatchNormalization"
           and (recalibrate == "all" or node.input[0] in affected)]
    n = sum(batch_len(b) for b in batches)
    if dense:
        done_layers, dense_runs = ls_dense(editor, model, batches, layers, masks, settings,
                                           providers, threads, label)
        _, done_bns, segments = ls_sequential(editor, model, batches, [], masks, bns,
                                              affected, settings, providers, threads,
                                              label) if bns else ({}, {}, 0)
        passes = {"dense": dense_runs, "sequential": int(bool(bns)), "segments": segments}
    else:
        done_layers, done_bns, segments = ls_sequential(
            editor, model, batches, layers, masks, bns, affected, settings, providers,
            threads, label)
        passes = {"dense": int(bool(layers)), "sequential": int(bool(layers or bns)),
                  "segments": segments}
    notes = _ls_notes(index, method, with_bn, layers, done_layers, settings)
    return editor.finish(), RepairRecord(method, alpha_cap, recalibrate, n, done_layers,
                                         done_bns, passes, notes, settings.to_dict())


def _ls_notes(index, method, with_bn, layers, done_layers, settings) -> tuple[str, ...]:
    """The notes of an LS repair: no BN for ``+bn``, BN parts on linear layers, SparseGPT."""
    approx = [k for k, v in done_layers.items() if "sparsegpt" in v.solver]
    no_bn = with_bn and not any(n.op_type == "BatchNormalization" for n in index.nodes)
    linear = linear_bn_note(method, layers, has_layer_norm(index))
    return (("ls+bn: the model has no BatchNormalization, so ls+bn equals ls",) if no_bn
            else ()) + (() if linear is None else (linear,)) + (() if not approx else (
        f"LS: {len(approx)} layer(s) ({', '.join(approx[:3])}{', ...' if len(approx) > 3 else ''}"
        f") used the SparseGPT one-sweep approximation (exact row solves would exceed "
        f"ls_exact_max = {settings.exact_max:g}, docs/METHODS.md §E1)",))


@dataclass(frozen=True)
class _Plan:
    """What one repair touches: ``layers`` as the sequential pass measures them (a MatMul
    given a bias Add reads its ``<output>_prebias``), ``dense_layers`` the same layers'
    records in the dense model, ``affine`` {layer: folded-BN affine?}, ``bns`` the
    BatchNormalization nodes to recalibrate, ``notes``."""

    layers: list
    dense_layers: list
    affine: dict
    bns: list
    notes: tuple


def _plan(editor: ModelEditor, structure, masks, method, recalibrate) -> _Plan:
    """The layers and BNs downstream of a pruned weight (or every BN with
    ``recalibrate="all"``); MatMuls that need a shift get their bias Add here."""
    cr_kind, with_bn = parse_method(method)
    index = editor.index
    affected = affected_tensors(index, [n for n, m in masks.items() if not np.all(m)])
    pruned = [la for la in structure.layers if la.node_name in masks and not la.is_head
              and la.op_type in PRUNABLE_OPS and la.output in affected]
    layer_norm = has_layer_norm(index)
    affine = {la.node_name: uses_affine(la, with_bn, layer_norm) for la in pruned}
    repaired = [la for la in pruned if cr_kind or affine[la.node_name]]
    staged = [add_missing_bias(editor, la) if affine[la.node_name] else la for la in repaired]
    bns = [node for node in editor.index.nodes if with_bn
           and node.op_type == "BatchNormalization"
           and (recalibrate == "all" or node.input[0] in affected)]
    note = linear_bn_note(method, pruned, layer_norm)
    return _Plan(staged, repaired, affine, bns, () if note is None else (note,))


def linear_bn_note(method: str, layers, layer_norm: bool) -> str | None:
    """Why the BN part of ``method`` leaves ``layers``' linear layers alone, or None: in a
    LayerNorm model there is no BatchNormalization to recalibrate after them and nothing
    to re-standardise (METHODS §D); only a CR part acts there."""
    cr_kind, with_bn = parse_method(method)
    idle = [la for la in layers if la.op_type != "Conv" and la.bn_node is None
            and not la.is_head]
    if not (with_bn and layer_norm and idle):
        return None
    part = "LS" if cr_kind == "ls" else "CR"
    then = (f"only its {part} part acts on them" if cr_kind else
            "they stay unrepaired; --repair cr or ls is the label-free repair there")
    return (f"repair {method!r}: BN recalibration has nothing to act on in {len(idle)} "
            "linear layer(s): no BatchNormalization follows them and LayerNorm has no "
            f"statistics to recalibrate (docs/METHODS.md §D); {then}")


def repair_notes(model: onnx.ModelProto, layers, methods) -> list[str]:
    """:func:`linear_bn_note` of each of ``methods`` for the prunable ``layers`` of
    ``model`` (what a sweep's repairs will not do), without repeats."""
    layer_norm = has_layer_norm(GraphIndex(model))
    notes = (linear_bn_note(m, layers, layer_norm) for m in methods)
    return list(dict.fromkeys(n for n in notes if n))


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
    batches = split_batches(collect_batches(calib_source, n_images))
    n = sum(batch_len(b) for b in batches)
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
        dense = _kept_moments(folded, full, kept_channels or {})
    done_layers, done_bns, segments, _ = sequential_repair(
        editor, batches, folded, dense, bns, None, {la.node_name: True for la in folded},
        alpha_cap, providers, threads)
    return editor.finish(), RepairRecord("bn", alpha_cap, "all", n, done_layers, done_bns,
                             {"dense": int(bool(folded)), "sequential": 1,
                              "segments": segments}, tuple(notes))


def _kept_moments(folded, full: dict, kept_channels: dict) -> dict:
    """The dense moments of the channels each conv in ``folded`` still has."""
    missing = [la.node_name for la in folded if la.node_name not in full]
    if missing:
        raise OnnxDiagError(f"Conv {missing[0]!r} is not a conv without BN in the dense "
                            "model; pass the model this one was pruned from.")
    dense = {}
    for la in folded:
        keep = kept_channels.get(la.node_name, range(la.n_out))
        if len(keep) != la.n_out:
            raise OnnxDiagError(f"Conv {la.node_name!r} has {la.n_out} output channels "
                                f"but {len(keep)} kept channels were given.")
        dense[la.node_name] = full[la.node_name].select(keep)
    return dense


def conv_output_moments(model: onnx.ModelProto, batches: list[dict], *, head: str | None = None,
                        providers=None, threads: int | None = None) -> dict[str, Moments]:
    """Per-channel output moments of every non-head Conv without a BatchNormalization of
    ``model`` over ``batches`` (feed dicts), by node name: the dense statistics that
    :func:`recalibrate_batchnorm` re-standardises pruned convs to."""
    return dense_moments(model, _convs_without_bn(model, head), batches, providers, threads)


def _convs_without_bn(model: onnx.ModelProto, head: str | None) -> list:
    from ..graph import analyze_structure

    structure = analyze_structure(model, head=head, require_head=head is not None)
    return [la for la in structure.layers
            if la.op_type == "Conv" and not la.is_head and la.bn_node is None]
