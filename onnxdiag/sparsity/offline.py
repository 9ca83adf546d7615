"""Evaluate one Conv / Gemm / MatMul offline in NumPy (METHODS §C2: never a network pass per s).

The layer's input is turned into columns once (im2col for a conv, honouring
stride, pads / auto_pad, dilation and groups); any weight — dense, masked, or the
pruned-away part — is then one (batched) matrix product with those columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import OnnxDiagError
from ..graph import GraphIndex
from ..graph.index import get_attr
from ..stats import draw_positions


@dataclass(frozen=True)
class LayerOp:
    """How a layer maps its input to its output (the ONNX attributes that matter).

    ``kind``: "conv" or "linear"; conv: ``stride``, ``pads`` (begins then ends),
    ``dilation``, ``groups``, ``auto_pad``; linear: ``layout`` ("oi": y = x·Wᵀ, "io":
    y = x·W), ``alpha`` / ``beta`` (Gemm's scales of x·W and of the bias).
    """

    name: str
    kind: str
    stride: tuple[int, ...] = ()
    pads: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    groups: int = 1
    auto_pad: str = "NOTSET"
    layout: str = "oi"
    alpha: float = 1.0
    beta: float = 1.0


def layer_op(model_or_index, layer) -> LayerOp:
    """The :class:`LayerOp` of ``layer`` (a :class:`~onnxdiag.graph.Layer`) in its model."""
    index = model_or_index if isinstance(model_or_index, GraphIndex) else GraphIndex(model_or_index)
    node = index.get_node(layer.node_name)
    if layer.op_type == "Conv":
        if len(layer.kernel) not in (1, 2):
            raise OnnxDiagError(f"Layer {layer.node_name!r} is a {len(layer.kernel)}-D conv; "
                                "offline evaluation supports 1-D and 2-D convs only.")
        pad = get_attr(node, "auto_pad", b"NOTSET")
        return LayerOp(layer.node_name, "conv", tuple(layer.stride), tuple(layer.pads),
                       tuple(layer.dilation), layer.groups,
                       pad.decode() if isinstance(pad, bytes) else str(pad))
    return LayerOp(layer.node_name, "linear", layout=layer.weight_layout,
                   alpha=float(get_attr(node, "alpha", 1.0)),
                   beta=float(get_attr(node, "beta", 1.0)))


def layer_columns(op: LayerOp, x: np.ndarray, kernel: tuple[int, ...] = ()):
    """Columns of input ``x`` and the output's leading shape, ``(cols, lead)``.

    Conv: ``x`` (n, C_in, *spatial) → cols (n·Π out_spatial, groups, C_in/groups·Π kernel),
    lead ``(n, *out_spatial)``.  Linear: ``x`` (..., n_in) → (Π leading, 1, n_in), lead the
    leading shape.  Outputs are ``apply_columns(cols, matrix)`` (P, C_out), samples first.
    """
    if op.kind == "conv":
        return conv_columns(op, x, kernel)
    x = np.asarray(x, dtype=np.float32)
    return x.reshape(-1, 1, x.shape[-1]), tuple(x.shape[:-1])


def conv_columns(op: LayerOp, x: np.ndarray, kernel: tuple[int, ...]):
    """im2col of ``x`` (n, C, *spatial) for a 1-D / 2-D conv (see :func:`layer_columns`)."""
    x = np.asarray(x, dtype=np.float32)
    if len(kernel) == 1:
        op2 = LayerOp(op.name, "conv", (1, *op.stride), (0, op.pads[0], 0, op.pads[1]),
                      (1, *op.dilation), op.groups, op.auto_pad)
        cols, lead = conv_columns(op2, x[:, :, None, :], (1, *kernel))
        return cols, (lead[0], lead[2])
    n, c = x.shape[:2]
    pads = resolve_pads(op, x.shape[2:], kernel)
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    span = [d * (k - 1) + 1 for d, k in zip(op.dilation, kernel)]
    win = sliding_window_view(xp, span, axis=(2, 3))
    win = win[:, :, ::op.stride[0], ::op.stride[1], ::op.dilation[0], ::op.dilation[1]]
    ho, wo = win.shape[2:4]
    cols = win.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, op.groups, -1)
    return np.ascontiguousarray(cols), (n, ho, wo)


def resolve_pads(op: LayerOp, spatial, kernel) -> tuple[int, ...]:
    """A 2-D conv's pads (begins then ends) for input ``spatial``, ``auto_pad`` resolved."""
    if op.auto_pad in ("NOTSET", ""):
        return tuple(op.pads) if op.pads else (0,) * 4
    if op.auto_pad == "VALID":
        return (0,) * 4
    begins, ends = [], []
    for size, k, s, d in zip(spatial, kernel, op.stride, op.dilation):
        out = -(-size // s)
        total = max(0, (out - 1) * s + d * (k - 1) + 1 - size)
        small, big = total // 2, total - total // 2
        begins.append(small if op.auto_pad == "SAME_UPPER" else big)
        ends.append(big if op.auto_pad == "SAME_UPPER" else small)
    return (*begins, *ends)


def weight_matrix(op: LayerOp, weight: np.ndarray) -> np.ndarray:
    """``weight`` as (groups, K, n_out / groups) so that y = cols @ matrix per group."""
    w = np.asarray(weight, dtype=np.float32)
    if op.kind == "linear":
        return (w.T if op.layout == "oi" else w)[None]
    g = op.groups
    return w.reshape(g, w.shape[0] // g, -1).transpose(0, 2, 1)


def apply_columns(cols: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """(P, g, K) columns × (g, K, O) weights → (P, g·O) outputs, channel c = group·O + o."""
    if cols.shape[1] == 1:
        return cols[:, 0, :] @ matrix[0]
    return np.matmul(cols.transpose(1, 0, 2), matrix).transpose(1, 0, 2).reshape(cols.shape[0], -1)


def sampled_columns(op, x: np.ndarray, kernel: tuple[int, ...], positions: int | None, *,
                    seed: int, sample_indices, x_last: np.ndarray | None = None,
                    transform=None) -> np.ndarray:
    """Columns ``(n·k, groups, K)`` of a conv at k sampled output positions per image.

    Rows are image-major; image i's positions are ``draw_positions(Π out_spatial, positions,
    seed=seed, sample_indices=[sample_indices[i]])`` (flat, row-major over the output).
    When ``positions`` is None or the output has at most ``positions`` positions, this is
    exactly :func:`~onnxdiag.sparsity.offline.conv_columns` (every position, in order).
    Linear layers: up to ``positions`` tokens per input (:func:`sampled_rows`).
    ``x_last``: the same input channels-last ``(n, *spatial, C)`` if at hand (ONNX Runtime
    transposes it during the capture pass, far faster than NumPy on a busy machine); each
    patch is then kh·kw gathered C-vectors, zero where it reaches into the padding.
    ``transform``: an elementwise map of the input's values (float32 arrays with the
    channels last, each a fresh copy it may overwrite and return), applied before the
    padding: the columns are those of ``transform(x)``, computed on the gathered values
    only (2-D convs with sampled positions).
    """
    if positions is None:
        return layer_columns(op, x, kernel)[0]
    if op.kind != "conv":
        return sampled_rows(x, positions, seed=seed, sample_indices=sample_indices)
    x = np.asarray(x, dtype=np.float32)
    if len(kernel) == 1:
        op = type(op)(op.name, "conv", (1, *op.stride), (0, op.pads[0], 0, op.pads[1]),
                      (1, *op.dilation), op.groups, op.auto_pad)
        x, kernel = x[:, :, None, :], (1, *kernel)
        x_last = None if x_last is None else x_last[:, None]
    patches = sampled_patches(op, x, kernel, positions, seed=seed, sample_indices=sample_indices,
                              x_last=x_last, transform=transform)
    if patches is None:  # every position: the full im2col
        if transform is not None:
            x = np.moveaxis(transform(np.moveaxis(x, 1, -1).copy()), -1, 1)
        return conv_columns(op, x, kernel)[0]
    m, c = patches.shape[0], patches.shape[-1]
    patches = patches.reshape(m, kernel[0], kernel[1], op.groups, c // op.groups)
    return patches.transpose(0, 3, 4, 1, 2).reshape(m, op.groups, -1)


def sampled_patches(op, x: np.ndarray, kernel: tuple[int, int], positions: int, *, seed: int,
                    sample_indices, x_last: np.ndarray | None = None,
                    transform=None) -> np.ndarray | None:
    """A 2-D conv's input patches at k sampled output positions per image, channels last:
    ``(n·k, kh·kw, C)`` float32, image-major, zero where a patch reaches into the padding
    (after ``transform``), in the order of :func:`sampled_columns`; None when the output has
    at most ``positions`` positions (every position is taken: :func:`conv_columns`).
    ``x``: the input ``(n, C, h, w)``; ``x_last``, ``transform``: as
    :func:`sampled_columns`."""
    pads = resolve_pads(op, x.shape[2:], kernel)
    span = [d * (k - 1) + 1 for d, k in zip(op.dilation, kernel)]
    h, w = x.shape[2:]
    ho, wo = (((size + p0 + p1 - sp) // st) + 1 for size, p0, p1, sp, st in zip(
        (h, w), pads[:2], pads[2:], span, op.stride))
    if ho * wo <= positions:
        return None
    n, c = x.shape[:2]
    if x_last is None:
        x_last = x.transpose(0, 2, 3, 1)
    x_last = np.ascontiguousarray(x_last, dtype=np.float32).reshape(-1, c)
    flat = draw_positions(ho * wo, positions, seed=seed, sample_indices=sample_indices)
    geometry = ((h, w), tuple(kernel), tuple(op.stride), pads, tuple(op.dilation), (ho, wo))
    taps = kernel[0] * kernel[1]
    if ho * wo * taps <= PATCH_TABLE_ENTRIES:  # the geometry's table, made once
        table, inside, edge = _patch_table(*geometry)
        offsets, outside = table[flat], (~inside[flat] if edge else None)
    else:  # a large map: the drawn positions' entries only
        offsets, inside = _patch_offsets(flat.reshape(-1), *geometry)
        outside = None if inside.all() else ~inside
    rows = ((np.arange(n) * (h * w))[:, None, None] + offsets.reshape(n, -1, taps)).reshape(
        -1, taps)
    patches = np.take(x_last, rows, axis=0)  # (m, kh·kw, C)
    if transform is not None:
        patches = transform(patches)
    if outside is not None:  # the padded elements only (a broadcast product: 30× slower)
        patches[outside.reshape(-1, taps)] = 0
    return patches


#: Largest patch table (output positions × kernel taps) :func:`sampled_patches` keeps per
#: conv geometry (**our default**: 2^20 entries, 9 MiB; a 224×224 net's 7×7 stem at 112×112
#: needs 0.6 M); above it, each batch computes its drawn positions' entries only.
PATCH_TABLE_ENTRIES = 1 << 20


def _patch_offsets(flat, spatial, kernel, stride, pads, dilation, out) -> tuple:
    """For the output positions ``flat`` (row-major over ``out``) of a 2-D conv: each
    patch element's flat index within the input image (clipped into it), ``(len(flat),
    kh·kw)``, and whether it lies inside the input (else padding: 0)."""
    (h, w), wo = spatial, out[1]
    r = ((flat // wo) * stride[0] - pads[0]).reshape(-1, 1, 1) + (
        np.arange(kernel[0]) * dilation[0])[None, :, None]
    q = ((flat % wo) * stride[1] - pads[1]).reshape(-1, 1, 1) + (
        np.arange(kernel[1]) * dilation[1])[None, None, :]
    inside = ((r >= 0) & (r < h) & (q >= 0) & (q < w)).reshape(len(flat), -1)
    offsets = (np.clip(r, 0, h - 1) * w + np.clip(q, 0, w - 1)).reshape(len(flat), -1)
    return offsets, inside


@functools.lru_cache(maxsize=16)
def _patch_table(spatial, kernel, stride, pads, dilation, out) -> tuple:
    """:func:`_patch_offsets` of every output position of one conv geometry, read-only,
    and whether any patch element lies in the padding: shared by every batch."""
    offsets, inside = _patch_offsets(np.arange(out[0] * out[1]), spatial, kernel, stride,
                                     pads, dilation, out)
    offsets.flags.writeable = inside.flags.writeable = False
    return offsets, inside, not inside.all()


def sampled_rows(x: np.ndarray, positions: int, *, seed: int, sample_indices) -> np.ndarray:
    """Rows ``(n·k, 1, n_in)`` of a linear layer's input at k sampled tokens per input.

    METHODS §D: a linear layer's positions are the leading axes of its input. ``x`` is
    ``(n, *tokens, n_in)`` with the batch first, or ``(n·T, n_in)`` with the batch
    flattened batch-major (GPT-2's ``view(-1, n_embd)``); input i's tokens are
    ``draw_positions(T, positions, seed=seed, sample_indices=[sample_indices[i]])``, all of
    them in order when T ≤ ``positions`` (an MLP's (n, n_in) input: one row per input).
    Rows are input-major. When the rows do not split evenly over the n inputs, every row.
    """
    x = np.asarray(x, dtype=np.float32)
    n = len(sample_indices)
    rows = int(np.prod(x.shape[:-1]))
    if n == 0 or rows % n:
        return x.reshape(-1, 1, x.shape[-1])
    per_input = x.reshape(n, rows // n, x.shape[-1])
    if rows // n <= positions:
        return per_input.reshape(-1, 1, x.shape[-1])
    tokens = draw_positions(rows // n, positions, seed=seed, sample_indices=sample_indices)
    picked = per_input[np.arange(n)[:, None], tokens]  # (n, k, n_in)
    return picked.reshape(-1, 1, x.shape[-1])


def evaluate_layer(op: LayerOp, x: np.ndarray, weight: np.ndarray,
                   bias: np.ndarray | None = None) -> np.ndarray:
    """The layer's output (its ``Layer.output`` tensor) for input ``x`` and ``weight``.

    Conv: (n, C_out, *out_spatial); linear: (..., n_out) with Gemm's alpha / beta.
    ``bias`` is the node's own bias input (not a separate Add).  Computed in float32.
    """
    kernel = tuple(np.asarray(weight).shape[2:])
    cols, lead = layer_columns(op, x, kernel)
    if op.kind == "linear":
        y = apply_columns(cols, weight_matrix(op, weight)) * np.float32(op.alpha)
        if bias is not None:
            y = y + np.float32(op.beta) * np.asarray(bias, np.float32).reshape(1, -1)
        return y.reshape(*lead, -1)
    y = apply_columns(cols, weight_matrix(op, weight))
    if bias is not None:
        y = y + np.asarray(bias, np.float32).reshape(1, -1)
    return np.moveaxis(y.reshape(*lead, -1), -1, 1)
