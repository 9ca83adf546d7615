"""The one-pass LS reconstruction on the dense model's inputs (docs/METHODS.md §E1,
``--ls-inputs dense``).

Every pruned layer is fitted on its input in the *dense* model: x_p = x_d, so
H_pp = H_pd = H_dd and the row solves of :mod:`.lsq` need only the dense moments. All
layers' moments come from ONE pass of the dense model, a copy that outputs each pruned
layer's columns (a conv's sampled im2col patches gathered in the graph,
:mod:`.ls_columns`; a linear layer's input rows, sampled in NumPy); layers that read the
same columns share one Gram. No sequential pass: a layer is not refitted to the drift of
its repaired upstream, and layers whose own weights are kept stay as they are (with
x_p = x_d their refit under the "weights" prior is the identity).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..graph import GraphIndex
from ..model.edit import ModelEditor
from ..runtime.batching import batch_len
from ..runtime.progress import progress
from ..runtime.runner import OrtRunner, single_threaded_blas
from .ls_columns import (
    ConvGeometry,
    channel_major,
    channel_major_columns,
    conv_geometry,
    expose_columns,
    index_feeds,
    index_name,
    numpy_columns,
)
from .ls_repair import LSSettings, fit_layer, weight_rows
from .lsq import TargetMoments
from .offline import LayerOp, layer_op


@dataclass
class ColumnSource:
    """One set of columns the pass collects: ``name`` (the key), the input ``tensor``, the
    ``op`` and ``kernel`` cutting it, the in-graph ``geometry`` (None: NumPy), ``acc``."""

    name: str
    tensor: str
    op: LayerOp
    kernel: tuple
    geometry: ConvGeometry | None
    acc: TargetMoments


def ls_dense(editor: ModelEditor, dense_model, batches: list[dict], layers, masks: dict,
             settings: LSSettings, providers=None, threads: int | None = None,
             label: str | None = None) -> tuple[dict, int]:
    """Refit the ``layers`` whose masks prune something from one dense pass; returns
    ({layer: LSRepair}, sessions run). BLAS stays on one thread between the ORT runs.
    ``label``: a progress bar with an ETA over the pass's batches (stderr, a terminal)."""
    index = GraphIndex(dense_model)
    pruned = [la for la in layers if not np.all(masks[la.node_name])]
    if not pruned:
        return {}, 0
    sources, of_layer = column_sources(index, pruned)
    with single_threaded_blas():
        collect_columns(dense_model, sources, batches, settings, providers, threads, label)
        done = {}
        for la in pruned:
            src = sources[of_layer[la.node_name]]
            w = np.asarray(index.get_constant(la.weight))
            done[la.node_name] = fit_layer(editor, la, src.op, w,
                                           np.asarray(masks[la.node_name], bool), src.acc,
                                           dense_output_sq(la, src, w), settings)
    return done, 1


def column_sources(index: GraphIndex, layers) -> tuple[dict[str, ColumnSource], dict[str, str]]:
    """({key: ColumnSource}, {layer: key}): layers with the same input and the same way of
    cutting it share a source."""
    sources, of_layer, keys = {}, {}, {}
    for la in layers:
        op = layer_op(index, la)
        kernel = tuple(la.kernel) if op.kind == "conv" else ()
        geo = conv_geometry(index, la, op) if op.kind == "conv" else None
        key = (la.input, op.kind, kernel, op.stride, op.pads, op.dilation, op.groups,
               op.auto_pad)
        if key not in keys:
            keys[key] = name = f"lscols{len(keys)}"
            g = op.groups if op.kind == "conv" else 1
            k = la.n_in // g * int(np.prod(kernel)) if op.kind == "conv" else la.n_in
            sources[name] = ColumnSource(name, la.input, op, kernel, geo,
                                         TargetMoments(g, k, 0))
        of_layer[la.node_name] = keys[key]
    return sources, of_layer


def collect_columns(model, sources: dict[str, ColumnSource], batches: list[dict],
                    settings: LSSettings, providers=None, threads=None, label=None, *,
                    graph_gram: bool = True) -> None:
    """One pass of ``model`` over ``batches``: every source's columns into its moments
    (image indices count up over the batches, as in the sequential pass). ``graph_gram``:
    one-group convs' Grams computed by ONNX Runtime (else by NumPy from the columns);
    ``label``: a progress bar over the batches."""
    convs = {s.name: (s.tensor, s.geometry) for s in sources.values() if s.geometry}
    whole = sorted({s.tensor for s in sources.values() if s.geometry is None})
    # one group: the graph computes the (tap-major) Gram; else the columns come out (and
    # always in a graph with a fixed batch size, which ONNX Runtime runs in pieces)
    graph_gram = graph_gram and not fixed_batch(model)
    grams = {s.name for s in sources.values()
             if graph_gram and s.geometry and s.acc.pp.shape[0] == 1}
    exposed, names = expose_columns(model, convs, whole, grams)
    inputs = {i.name for i in model.graph.input}
    wanted = sorted({v for v in names.values() if v not in inputs})
    # ORT threads sleep between runs: the Gram updates run between them on the same cores
    runner = OrtRunner(exposed, providers=providers, threads=threads, spinning=False)
    sizes = [batch_len(feeds) for feeds in batches]
    # every image's indices in one go (per-batch calls cost half a dense pass); image i's
    # depend on its global index alone, so slicing them per batch changes nothing
    extra = index_feeds(convs, settings.positions, settings.seed, np.arange(sum(sizes)))
    start = 0
    pairs = zip(batches, sizes)
    for feeds, n in progress(pairs, len(sizes), label) if label else pairs:
        images = np.arange(start, start + n)
        out = runner.run({**feeds, **{k: v[start:start + n] for k, v in extra.items()}},
                         wanted)
        start += n
        for src in sources.values():
            if src.name in grams:  # tap-major: permuted below
                rows = n * extra[index_name(src.name)].shape[1] // src.geometry.taps
                src.acc.update_gram(rows, out[names[f"{src.name}/sum"]],
                                    out[names[f"{src.name}/gram"]])
                continue
            if src.geometry is not None:
                cols = channel_major_columns(out[names[src.name]], src.geometry,
                                             src.acc.pp.shape[0])
            else:
                x = feeds[src.tensor] if src.tensor in inputs else out[names[src.tensor]]
                cols = numpy_columns(src.op, x, src.kernel, settings.positions,
                                     settings.seed, images)
            src.acc.update(cols, None)  # x_p = x_d
    for name in grams:
        permute_moments(sources[name].acc, channel_major(sources[name].geometry))


def fixed_batch(model) -> bool:
    """Whether a graph input has a fixed batch (axis-0) size."""
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if vi.name not in inits and dims and dims[0].HasField("dim_value") and \
                dims[0].dim_value > 0:
            return True
    return False


def permute_moments(acc: TargetMoments, perm: np.ndarray) -> None:
    """Reorder one-group moments of columns ``c`` to those of ``c[:, perm]`` (exact)."""
    acc.sum_p = acc.sum_p[:, perm]
    acc.pp = acc.pp[:, perm][:, :, perm]


def dense_output_sq(layer, src: ColumnSource, w: np.ndarray) -> np.ndarray:
    """E[(w_iᵀx_d)²] per output row, from the dense moments: w_iᵀ H_dd w_i."""
    rows = weight_rows(layer, src.op, w)
    g = src.acc.pp.shape[0]
    per = rows.shape[0] // g
    return np.concatenate([src.acc.output_sq(k, rows[k * per:(k + 1) * per])
                           for k in range(g)])
