"""A layer's LS columns taken inside the graph (docs/METHODS.md §E1, ``--ls-inputs dense``).

The one-pass LS mode needs, for every pruned layer, the columns of its input in the dense
model: a conv's im2col patches at the sampled output positions, a linear layer's
(sampled) input rows. Copying a conv's whole input out of ONNX Runtime and cutting the
patches in NumPy is most of the cost; here the graph cuts them itself:

    x (N, C, H, W) → Transpose channels-last → Reshape (N, H·W, C)
      [→ Concat a zero row (N, H·W + 1, C) when the conv pads]
      → Gather(axis 0) of the (N·(H·W [+ 1]), C) rows at indices (N, k·kh·kw) plus each
        image's row offset → (N, k·kh·kw, C) = (N·k, kh·kw·C)

so only the k patches per image leave the session. Their columns are tap-major (kernel
row, kernel column, channel); :func:`channel_major` is the permutation to the order of
:func:`~onnxdiag.sparsity.offline.conv_columns` (group, channel, kernel row, kernel
column). Permuting the Gram once, rather than every batch's columns, leaves the
arithmetic as it is (a transpose inside the graph cost more than the conv itself; so did
a Pad, hence the zero row that patch elements in the padding read). The
indices are a graph input per conv geometry, computed from the positions
:func:`~onnxdiag.stats.draw_positions` draws for the batch's global image indices, so the
permuted columns equal :func:`~onnxdiag.sparsity.offline.sampled_columns` (tested) in any
batch split. Needs a 2-D conv whose input has a static spatial size (shape inference); other
convs, and linear layers, expose their input whole and are sampled in NumPy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph import GraphIndex
from ..stats import draw_positions
from .offline import LayerOp, resolve_pads, sampled_columns


@dataclass(frozen=True)
class ConvGeometry:
    """Where the patches of a 2-D conv lie in its padded, channels-last input."""

    channels: int
    spatial: tuple[int, int]
    pads: tuple[int, int, int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]

    @property
    def out(self) -> tuple[int, int]:
        return tuple(((s + p0 + p1 - d * (k - 1) - 1) // st) + 1 for s, p0, p1, k, st, d in zip(
            self.spatial, self.pads[:2], self.pads[2:], self.kernel, self.stride,
            self.dilation))

    def indices(self, positions: int | None, seed: int, images) -> np.ndarray:
        """(N, k·kh·kw) int64 rows of the (N, H·W + 1, C) channels-last input whose last
        row is zero: image i's patch elements at the positions ``draw_positions`` gives it
        (all when None); an element in the padding reads the zero row."""
        ho, wo = self.out
        (h, w), pads = self.spatial, self.pads
        flat = draw_positions(ho * wo, ho * wo if positions is None else positions,
                              seed=seed, sample_indices=images)
        r = ((flat // wo) * self.stride[0] - pads[0])[..., None, None] + (
            np.arange(self.kernel[0]) * self.dilation[0])[:, None]
        q = ((flat % wo) * self.stride[1] - pads[1])[..., None, None] + (
            np.arange(self.kernel[1]) * self.dilation[1])[None, :]
        rows = np.where((r >= 0) & (r < h) & (q >= 0) & (q < w), r * w + q, h * w)
        return rows.reshape(rows.shape[0], -1).astype(np.int64)

    @property
    def taps(self) -> int:
        return self.kernel[0] * self.kernel[1]

    @property
    def padded(self) -> bool:
        return any(self.pads)


#: The oldest default-domain opset whose Range the gather chain uses.
MIN_OPSET = 11


def conv_geometry(index: GraphIndex, layer, op: LayerOp) -> ConvGeometry | None:
    """The :class:`ConvGeometry` of a 2-D conv ``layer`` whose input's C, H, W are static
    (in a model of opset ≥ :data:`MIN_OPSET`); None otherwise (the NumPy path then cuts
    its columns)."""
    opset = next((o.version for o in index.model.opset_import if o.domain in ("", "ai.onnx")),
                 0)
    if opset < MIN_OPSET:
        return None
    kernel = tuple(layer.kernel)
    shape = index.shape(layer.input)
    if op.kind != "conv" or len(kernel) != 2 or not shape or len(shape) != 4:
        return None
    if not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        return None
    pads = resolve_pads(op, shape[2:], kernel)
    if min(pads) < 0:
        return None
    return ConvGeometry(int(shape[1]), (int(shape[2]), int(shape[3])), tuple(pads), kernel,
                        tuple(op.stride), tuple(op.dilation))


def expose_columns(model: onnx.ModelProto, convs: dict[str, tuple[str, ConvGeometry]],
                   tensors: list[str], grams=()) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of ``model`` with an output of gathered rows (N, k·kh·kw, C) per entry of
    ``convs`` ({key: (input tensor, geometry)}; its indices input is named after the key,
    see :func:`index_feeds`) and the ``tensors`` exposed whole (graph inputs are not: read
    them from the feeds). For a key in ``grams`` the graph instead outputs the batch's
    tap-major Gram XᵀX (K, K) and column sums (K,) of X = the rows as (N·k, kh·kw·C):
    ONNX Runtime's own threads compute them, so they scale with the pass on an idle
    machine. Returns (model, {key or tensor: output name}, with ``key/gram`` and
    ``key/sum`` for those). Never modifies ``model``."""
    inputs = {i.name for i in model.graph.input}
    out = _copy(model)
    # the tensors appended as outputs directly (typed where shape inference typed them):
    # a graphsurgeon round trip cost more than the pass on the ViT sample
    types = {v.name: v for v in (*out.graph.value_info, *out.graph.output)}
    present = {o.name for o in out.graph.output}
    for t in dict.fromkeys(tensors):
        if t not in inputs and t not in present:
            out.graph.output.append(types.get(t) or helper.make_empty_tensor_value_info(t))
    names = {t: t for t in tensors}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    for i, (key, (tensor, geo)) in enumerate(convs.items()):
        base = f"onnxdiag_lscols_{i}"
        rows = _gather_nodes(out.graph, base, tensor, geo, index_name(key))
        if key in grams:
            names[f"{key}/gram"], names[f"{key}/sum"] = _gram_nodes(
                out.graph, base, rows, geo.kernel[0] * geo.kernel[1] * geo.channels, opset)
        else:
            names[key] = rows
            out.graph.output.append(helper.make_tensor_value_info(
                rows, onnx.TensorProto.FLOAT, [None, None, geo.channels]))
    return out, names


def _gram_nodes(graph, base: str, rows: str, width: int, opset: int) -> tuple[str, str]:
    """Append X = Reshape(rows, (-1, width)), Gemm(X, X, transA) and ReduceSum(X, axis 0)
    as float32 outputs; returns their names."""
    graph.initializer.extend([
        numpy_helper.from_array(np.array([-1, width], np.int64), f"{base}_width"),
        numpy_helper.from_array(np.array([0], np.int64), f"{base}_axis0")])
    x, gram, total = f"{base}_x", f"{base}_gram", f"{base}_sum"
    reduce = (helper.make_node("ReduceSum", [x, f"{base}_axis0"], [total], name=total,
                               keepdims=0) if opset >= 13 else
              helper.make_node("ReduceSum", [x], [total], name=total, axes=[0], keepdims=0))
    graph.node.extend([
        helper.make_node("Reshape", [rows, f"{base}_width"], [x], name=x),
        helper.make_node("Gemm", [x, x], [gram], name=gram, transA=1), reduce])
    graph.output.extend([
        helper.make_tensor_value_info(gram, onnx.TensorProto.FLOAT, [width, width]),
        helper.make_tensor_value_info(total, onnx.TensorProto.FLOAT, [width])])
    return gram, total


def channel_major(geo: ConvGeometry) -> np.ndarray:
    """``perm`` with ``cols[:, perm]`` the channel-major columns of tap-major ``cols``."""
    taps = geo.kernel[0] * geo.kernel[1]
    j = np.arange(taps * geo.channels)
    return (j % taps) * geo.channels + j // taps


def channel_major_columns(rows: np.ndarray, geo: ConvGeometry, groups: int) -> np.ndarray:
    """The gathered (N, k·kh·kw, C) ``rows`` as columns (N·k, groups, C/groups·kh·kw) in the
    order of :func:`~onnxdiag.sparsity.offline.sampled_columns` (a permuting copy)."""
    perm = channel_major(geo)
    flat = rows.reshape(-1, perm.size)
    return flat[:, perm].reshape(len(flat), groups, -1)


def index_name(key: str) -> str:
    return f"{key}__onnxdiag_lscols_indices"


def index_feeds(convs: dict[str, tuple[str, ConvGeometry]], positions: int | None, seed: int,
                images) -> dict[str, np.ndarray]:
    """The indices inputs of :func:`expose_columns` for a batch of global ``images``."""
    feeds = {}
    for key, (_, geo) in convs.items():
        feeds[index_name(key)] = geo.indices(positions, seed, images)
        if geo.padded:
            feeds[zeros_name(index_name(key))] = np.zeros((len(images), 1, geo.channels),
                                                          np.float32)
    return feeds


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _gather_nodes(graph, base: str, tensor: str, geo: ConvGeometry, indices: str) -> str:
    """Append the Transpose … Gather chain of the module docstring (with a padded conv,
    a zero row per image, fed as :func:`zeros_name`, is appended before the gather: cheaper
    than a Pad); returns its output name, the gathered (N, k·kh·kw, C) rows."""
    c = geo.channels
    per_image = geo.spatial[0] * geo.spatial[1] + int(geo.padded)
    for name, value in {"flat": [0, -1, c], "rows2d": [-1, c], "zero": 0, "one": 1,
                        "per_image": per_image, "column": [-1, 1]}.items():
        graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64),
                                                         f"{base}_{name}"))
    output = f"{base}_columns"
    rows = f"{base}_rows"
    nodes = [helper.make_node("Transpose", [tensor], [f"{base}_last"], name=f"{base}_last",
                              perm=[0, 2, 3, 1]),
             helper.make_node("Reshape", [f"{base}_last", f"{base}_flat"], [rows],
                              name=f"{base}_rows")]
    if geo.padded:
        zeros = zeros_name(indices)
        graph.input.append(helper.make_tensor_value_info(zeros, onnx.TensorProto.FLOAT,
                                                         [None, 1, c]))
        nodes.append(helper.make_node("Concat", [rows, zeros], [f"{base}_zrows"],
                                      name=f"{base}_zrows", axis=1))
        rows = f"{base}_zrows"
    # the images' row offsets from the batch itself: a batch run in pieces stays right
    nodes += [
        helper.make_node("Shape", [tensor], [f"{base}_shape"], name=f"{base}_shape"),
        helper.make_node("Gather", [f"{base}_shape", f"{base}_zero"], [f"{base}_n"],
                         name=f"{base}_n", axis=0),
        helper.make_node("Range", [f"{base}_zero", f"{base}_n", f"{base}_one"],
                         [f"{base}_images"], name=f"{base}_images"),
        helper.make_node("Mul", [f"{base}_images", f"{base}_per_image"], [f"{base}_start"],
                         name=f"{base}_start"),
        helper.make_node("Reshape", [f"{base}_start", f"{base}_column"], [f"{base}_start2"],
                         name=f"{base}_start2"),
        helper.make_node("Add", [indices, f"{base}_start2"], [f"{base}_global"],
                         name=f"{base}_global"),
        helper.make_node("Reshape", [rows, f"{base}_rows2d"], [f"{base}_all"],
                         name=f"{base}_all"),
        helper.make_node("Gather", [f"{base}_all", f"{base}_global"], [output],
                         name=f"{base}_gather", axis=0)]
    graph.node.extend(nodes)
    graph.input.append(helper.make_tensor_value_info(indices, onnx.TensorProto.INT64,
                                                     [None, None]))
    return output


def zeros_name(indices: str) -> str:
    return f"{indices}_zeros"


def numpy_columns(op: LayerOp, x: np.ndarray, kernel, positions: int | None, seed: int,
                  images) -> np.ndarray:
    """The same columns cut in NumPy (:func:`~onnxdiag.sparsity.offline.sampled_columns`),
    for the layers :func:`conv_geometry` leaves out."""
    return sampled_columns(op, x, kernel, positions, seed=seed, sample_indices=images)
