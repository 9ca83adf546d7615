"""The sampled rows of a conv consumer's input, gathered inside the graph
(docs/METHODS.md §E2's moments pass).

The reconstruction's moments take ``positions`` seeded positions per image of each conv
consumer's input (the draw of docs/METHODS.md §B1, :func:`~onnxdiag.stats.draw_positions`).
Exposing the whole input and sampling it in NumPy copies every position out of ONNX
Runtime and then fancy-indexes it; here the graph gathers the sampled C-vectors itself
(Transpose to channels-last → Reshape (N, H·W, C) → GatherND with ``batch_dims=1``), and
only the (N, k, C) rows leave the session. The positions are a graph input of shape
(N, k, 1) per distinct spatial size, drawn per batch from the images' global indices, so
the rows equal the NumPy-sampled ones exactly and a batch split in pieces (a graph with a
fixed batch size) still pairs each image with its own positions. Needs the tensor's
spatial size statically (shape inference); others keep the channels-last exposure.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def gatherable(index, tensor: str, n_channels: int, positions: int | None) -> int | None:
    """The static spatial size H·W… of the NC… ``tensor`` (a GraphIndex's shape) when its
    rows are worth gathering in the graph (more than ``positions`` positions, ``n_channels``
    channels); else None (every position is taken then, or the size is not known)."""
    shape = index.shape(tensor)
    if positions is None or not shape or len(shape) < 3 or shape[1] != n_channels:
        return None
    spatial = shape[2:]
    if not all(isinstance(d, int) and d > 0 for d in spatial):
        return None
    size = int(np.prod(spatial))
    return size if size > positions else None


def expose_sampled_rows(model: onnx.ModelProto, tensors: dict[str, tuple[int, int, int]], *,
                        tag: str = "rows") -> tuple[onnx.ModelProto, dict[str, str],
                                                    dict[str, int]]:
    """A copy of ``model`` with an output of sampled rows (N, k, C) for each tensor of
    ``tensors`` ({name: (rank, spatial size, channels)}, NC… layout) and one positions input
    (N, k, 1) int64 per distinct spatial size. Returns (model, {tensor: output name},
    {positions input: spatial size}); fill the inputs with :func:`position_feeds`. Never
    modifies ``model``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*graph.input, *graph.output, *graph.value_info)}
    inputs: dict[str, int] = {}
    names: dict[str, str] = {}
    for i, (name, (rank, size, channels)) in enumerate(tensors.items()):
        pos = f"onnxdiag_{tag}_positions_{size}"
        if pos not in inputs:
            inputs[pos] = size
            graph.input.append(helper.make_tensor_value_info(
                pos, onnx.TensorProto.INT64, ["N", "k", 1]))
        base = f"onnxdiag_{tag}_{i}"
        shape = f"{base}_shape"
        graph.initializer.append(numpy_helper.from_array(
            np.array([0, -1, channels], dtype=np.int64), shape))
        names[name] = f"{name}__onnxdiag_{tag}"
        graph.node.extend([
            helper.make_node("Transpose", [name], [f"{base}_last"], name=f"{base}_transpose",
                             perm=[0, *range(2, rank), 1]),
            helper.make_node("Reshape", [f"{base}_last", shape], [f"{base}_flat"],
                             name=f"{base}_reshape"),
            helper.make_node("GatherND", [f"{base}_flat", pos], [names[name]],
                             name=f"{base}_gather", batch_dims=1)])
        graph.output.append(helper.make_tensor_value_info(
            names[name], types.get(name) or onnx.TensorProto.FLOAT, [None, None, channels]))
    return out, names, inputs


def position_feeds(inputs: dict[str, int], positions: int, seed: int, indices) -> dict:
    """{positions input: (N, k, 1) int64}: the draw of :func:`~onnxdiag.stats.draw_positions`
    for the batch's global sample ``indices``, per spatial size of ``inputs``."""
    from ..stats import draw_positions

    return {name: draw_positions(size, positions, seed=seed, sample_indices=indices)
            .astype(np.int64)[:, :, None] for name, size in inputs.items()}
