"""The RR capture pass (METHODS §C2): one ONNX Runtime pass over the calibration images
that gives every prunable layer's columns, batch by batch, to fold into its plan
(:mod:`onnxdiag.sparsity.rr_layer`), and optionally the dense output moments of the
layers the repairs need.

A sampled 2-D conv's patches are cut inside the graph
(:mod:`onnxdiag.sparsity.ls_columns`): only its k patches per image leave the session.
Other sampled convs' inputs come out channels-last, other layers' inputs whole. Folded in
this process, a batch runs in pieces whose outputs ONNX Runtime writes into buffers reused
from piece to piece (:class:`~onnxdiag.runtime.bound.BoundRunner`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import DataError
from ..graph import GraphIndex
from ..model.expose import bn_as_depthwise_conv, expose_channels_last, expose_tensors
from ..runtime.batching import batch_len
from ..runtime.bound import BOUND_ROWS, BoundRunner
from ..runtime.progress import progress
from ..runtime.runner import OrtRunner, cpu_only
from .fold import output_moments
from .ls_columns import channel_major_columns, conv_geometry, expose_columns, index_feeds
from .offline import sampled_columns
from .rr_layer import fold_columns
from .rr_strategy import fold_cost
from .segments import feed_dicts

#: Whether a sampled 2-D conv's patches are cut inside the capture graph (**our default**;
#: the same columns as cutting them in NumPy from its exposed input, tested): on a
#: 224×224 net the exposed inputs are GBs per batch.
GRAPH_COLUMNS = True
#: Output bytes per run of a piece of a batch (**our default**): small nets run a batch
#: at once, a 224×224 net's batch in pieces of BOUND_ROWS images.
PIECE_BYTES = 256 * 2 ** 20


def capture_session(model, index: GraphIndex, layers, plans, positions, seed: int,
                     providers, threads, outputs=()) -> Capture:
    """The pass that gives every layer's columns (and exposes the tensors ``outputs``).

    A sampled 2-D conv whose input has a static C, H, W and whose k patches per image
    hold at most half its input's values gets them cut inside the graph
    (:func:`~onnxdiag.sparsity.ls_columns.expose_columns`: only its k patches per image
    leave the session; layers with the same input and geometry share them). Any
    other sampled conv's input is fetched channels-last (one copy out of ONNX Runtime's
    blocked layout; its NCHW layout is then a view of that copy), and every other layer's
    input whole."""
    convs, key_of = {}, {}
    if positions is not None and GRAPH_COLUMNS:
        keys: dict = {}
        for la, plan in zip(layers, plans):
            geo = conv_geometry(index, la, plan["op"]) if plan["op"].kind == "conv" else None
            # only where the patches are smaller than the input (a 7×7 map's 16 3×3
            # patches are three times its size: NumPy cuts those from the input)
            if geo is not None and 2 * positions * geo.taps <= geo.spatial[0] * geo.spatial[1]:
                key = keys.setdefault((la.input, geo), f"rrcols{len(keys)}")
                convs[key], key_of[la.node_name] = (la.input, geo), key
    rest = [la for la in layers if la.node_name not in key_of]
    last_of = {} if positions is None else {
        la.input: len(la.kernel) + 2 for la in rest if la.op_type == "Conv"}
    nchw = {la.input for la in rest if la.input not in last_of}
    whole = [t for t in dict.fromkeys(la.input for la in rest)
             if t not in index.inputs and (t in nchw or t not in last_of)]
    whole += [t for t in dict.fromkeys(outputs)
              if t not in whole and t not in last_of and t not in index.inputs]
    graph, names = expose_columns(model, convs, whole) if convs else (
        expose_tensors(model, whole) if whole else model, {t: t for t in whole})
    last = {}
    if last_of:  # sampled convs gather C-vectors from a channels-last copy
        graph, last = expose_channels_last(graph, last_of, tag="rr_channels_last")
    if cpu_only(providers):  # an exposed conv's BN before a ReLU6: keep the Clip fused
        graph, _ = bn_as_depthwise_conv(graph, {t: len(index.shape(t) or ()) for t in outputs})
    # threads sleep between batches: each batch's folding (NumPy, BLAS) needs the cores
    runner = OrtRunner(graph, providers=providers, threads=threads, spinning=False)
    fetch = list(dict.fromkeys([*names.values(), *last.values()]))
    size = _image_bytes(index, convs, positions, [*whole, *last_of])
    piece = BOUND_ROWS if size is None else max(BOUND_ROWS, PIECE_BYTES // max(size, 1))
    return Capture(runner, fetch, convs, key_of, names, last, positions, int(seed), piece)


def _image_bytes(index: GraphIndex, convs: dict, positions, tensors) -> int | None:
    """Bytes the capture fetches per image (float32), or None where a shape is unknown."""
    total = sum(positions * geo.taps * geo.channels for _, geo in convs.values())
    for t in tensors:
        shape = index.shape(t)
        if not shape or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
            return None
        total += int(np.prod(shape[1:]))
    return 4 * total


@dataclass
class Capture:
    """The capture pass's session, what it fetches and how each layer's columns are cut."""

    runner: OrtRunner
    fetch: list
    convs: dict  # {key: (input tensor, ConvGeometry)} cut inside the graph
    key_of: dict  # {layer node name: key} for those layers
    names: dict  # {key or tensor: output name}
    last: dict  # {tensor: its channels-last output}
    positions: int | None
    seed: int
    piece: int  # images per run of a batch folded here (outputs of about PIECE_BYTES)

    def extra_feeds(self, images) -> dict:
        """The in-graph gathers' index inputs for a batch of global ``images``."""
        return index_feeds(self.convs, self.positions, self.seed, images) if self.convs else {}

    def run_piece(self, bound, part: dict, extra: dict, images, items, fold) -> tuple:
        """(each layer's columns, the outputs) of one run on the feeds ``part`` (``extra``:
        their index inputs; ``images``: their global indices); ``bound``: a BoundRunner
        or None; ``fold``: a thread map to cut the layers' columns on, or None."""
        run = {**part, **extra}
        outs = dict((bound.run(run) if bound else self.runner.run(run, self.fetch))
                    if self.fetch else {})
        outs.update(part)
        cut = [(la, plan, outs, images) for la, plan in items]
        if fold is None:
            return [self.columns(*item) for item in cut], outs
        return fold(lambda item: self.columns(*item), cut), outs

    def columns(self, layer, plan: dict, outs: dict, images) -> np.ndarray:
        """The layer's columns of one run (a fresh array: ``outs`` may be reused buffers),
        or for a plan its unit cuts (``unit_cuts``) the run's input itself."""
        if plan.get("unit_cuts"):  # kept for a unit: no reused buffers (bound is None)
            return outs[layer.input]
        key = self.key_of.get(layer.node_name)
        if key is not None:  # a permuting copy of the gathered rows
            return channel_major_columns(outs[self.names[key]], self.convs[key][1],
                                         plan["op"].groups)
        copy = self.last.get(layer.input)
        x_last = outs[copy] if copy else None
        x = outs[layer.input] if layer.input in outs else np.moveaxis(x_last, -1, 1)
        cols = sampled_columns(plan["op"], x, plan["kernel"], plan["positions"],
                               seed=plan["seed"], sample_indices=images, x_last=x_last)
        shared = np.may_share_memory(cols, x) or (
            x_last is not None and np.may_share_memory(cols, x_last))
        return np.array(cols) if shared or not cols.flags.writeable else cols


def capture(model, index, layers, plans, source, n_images, positions, seed, *, fold,
            providers, threads, label=None, moment_layers=()) -> tuple[list[list], int, dict]:
    """One pass over the first ``n_images`` samples: each batch's layer columns folded into
    the plans (``fold``: the :func:`~onnxdiag.runtime.pool.thread_map` to fold them with)
    or, with None, kept per layer for the units; the outputs of ``moment_layers`` folded
    into their moments (with ``fold`` only). Returns (kept columns per layer, samples
    seen, {layer: output Moments}).

    Folded here, a batch runs in pieces of images whose outputs (about
    :data:`PIECE_BYTES`, at least :data:`~onnxdiag.runtime.bound.BOUND_ROWS` images) ONNX
    Runtime writes into buffers reused from piece to piece (a 224×224 net's exposed
    outputs are GBs for a batch of 32; fresh pages cost system time of the order of the
    pass); each piece's columns are cut from them, and the batch's
    columns are folded together. With every position (``positions=None``) the columns
    are the size of the inputs: they are folded, or kept for the units, piece by piece
    (the same pieces either way, so the units fold what this process would)."""
    if fold is None and positions is None:
        _mark_unit_cuts(plans)
    cap = capture_session(model, index, layers, plans, positions, seed, providers, threads,
                          [la.output for la in moment_layers])
    bound = BoundRunner(cap.runner, cap.fetch) if fold is not None and cap.fetch else None
    # every position: columns the size of the inputs, folded (or kept) piece by piece
    per_piece = positions is None
    piece = cap.piece if bound is not None or per_piece else None
    captured: list[list] = [[] for _ in layers]
    moments: dict = {}
    seen = 0
    batches = feed_dicts(source)
    if label:  # advances by images, so the bar's ETA holds for any batch size
        batches = progress(batches, n_images, f"{label}: capture",
                           step=lambda f: min(batch_len(f), n_images))
    items = list(zip(layers, plans))
    for feeds in batches:
        take = min(n_images - seen, batch_len(feeds))
        if take <= 0:
            break
        feeds = {k: v[:take] for k, v in feeds.items()}
        images = np.arange(seen, seen + take)
        extra = cap.extra_feeds(images)
        parts: list[list] = [[] for _ in layers]
        for start in range(0, take, piece or take):
            cut = slice(start, start + (piece or take))
            cols, outs = cap.run_piece(bound, {k: v[cut] for k, v in feeds.items()},
                                       {k: v[cut] for k, v in extra.items()}, images[cut],
                                       items, fold)
            if per_piece:
                _fold_or_keep(fold, plans, cols, captured)
            else:
                for i, c in enumerate(cols):
                    parts[i].append(c)
            if moment_layers and fold is not None:
                _fold_moments(fold, moment_layers, outs, moments)
        if not per_piece:
            _fold_or_keep(fold, plans, [c[0] if len(c) == 1 else np.concatenate(c)
                                        for c in parts], captured)
        seen += take
    if seen == 0:
        raise DataError("The calibration data is empty; give at least one sample.")
    return captured, seen, moments


def _mark_unit_cuts(plans) -> None:
    """Units with every position: a k×k conv's columns are its input × k² / stride², so
    its unit gets the input and cuts them (:func:`~onnxdiag.sparsity.rr_layer.layer_unit`)."""
    for plan in plans:
        if plan["op"].kind == "conv" and int(np.prod(plan["kernel"])) > 1:
            plan["unit_cuts"] = True


def _fold_moments(fold, layers, outs: dict, moments: dict) -> None:
    """Each of ``layers``' outputs in ``outs`` folded into its output moments."""
    items = [(la, outs[la.output], moments.get(la.node_name)) for la in layers]
    done = fold(lambda item: output_moments(item[0], [item[1]], item[2]), items)
    moments.update((la.node_name, m) for la, m in zip(layers, done))


def _fold_or_keep(fold, plans, cols: list, captured: list[list]) -> None:
    """Each layer's columns folded into its plan (with ``fold``; the largest folds handed
    out first, so that no large layer taken last leaves the other threads idle), or kept
    for its unit."""
    if fold is not None:
        order = sorted(range(len(plans)), key=lambda i: -fold_cost(plans[i]))
        fold(lambda item: fold_columns(*item, own=True), [(plans[i], cols[i]) for i in order])
    else:
        for i, c in enumerate(cols):
            captured[i].append(c)
