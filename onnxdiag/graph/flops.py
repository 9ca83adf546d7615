"""FLOPs of Conv / ConvTranspose / Gemm / MatMul at the model's input size.

Definition (ours): FLOPs = 2 × multiply-accumulates of the weight product; bias adds,
BN and activations are not counted.  A dynamic batch dimension counts as 1; any
other dynamic dimension makes the count unknown (None, with a note saying which).
"""

from __future__ import annotations

import math


def _batch(shape: tuple) -> int:
    """Static batch size, 1 when the batch dimension is dynamic."""
    return shape[0] if shape and isinstance(shape[0], int) and shape[0] > 0 else 1


def _static(dims) -> bool:
    return all(isinstance(d, int) and d >= 0 for d in dims)


def conv_output_spatial(in_spatial: tuple, kernel: tuple, stride: tuple, dilation: tuple,
                        pads: tuple) -> tuple | None:
    """Output spatial size of a Conv with explicit pads (begin..., end...); None if unknown."""
    if not _static(in_spatial) or len(pads) != 2 * len(in_spatial):
        return None
    rank = len(in_spatial)
    return tuple(
        (in_spatial[i] + pads[i] + pads[i + rank] - dilation[i] * (kernel[i] - 1) - 1)
        // stride[i] + 1 for i in range(rank))


def conv_flops(n_out: int, n_in_per_group: int, kernel: tuple,
               output_shape: tuple | None) -> tuple[int | None, str]:
    """``(flops, note)``: 2 · N · prod(out spatial) · n_out · n_in_per_group · prod(kernel)."""
    if output_shape is None:
        return None, "output shape unknown: FLOPs not computed"
    spatial = output_shape[2:]
    if not _static(spatial):
        return None, f"dynamic spatial size {tuple(spatial)}: FLOPs not computed"
    macs = _batch(output_shape) * math.prod(spatial) * n_out * n_in_per_group * math.prod(kernel)
    return 2 * macs, ""


def conv_transpose_flops(n_in: int, n_out_per_group: int, kernel: tuple,
                         input_shape: tuple | None) -> tuple[int | None, str]:
    """``(flops, note)``: each input position scatters n_out_per_group · prod(kernel) MACs."""
    if input_shape is None or not _static(input_shape[2:]):
        return None, "input spatial size unknown or dynamic: FLOPs not computed"
    macs = (_batch(input_shape) * math.prod(input_shape[2:]) * n_in * n_out_per_group
            * math.prod(kernel))
    return 2 * macs, ""


def linear_flops(n_in: int, n_out: int, output_shape: tuple | None) -> tuple[int | None, str]:
    """``(flops, note)``: 2 · rows · n_in · n_out, rows = product of all but the last dim."""
    if output_shape is None:
        return 2 * n_in * n_out, "output shape unknown: counted for one row"
    rows = output_shape[:-1]
    if not _static(rows[1:]):
        return None, f"dynamic dimensions {tuple(rows)}: FLOPs not computed"
    batch = _batch(rows) if rows else 1
    return 2 * batch * math.prod(rows[1:]) * n_in * n_out, ""


def layer_flops_per_sample(layer, input_shape: tuple, output_shape: tuple,
                           batch: int) -> int | None:
    """FLOPs of one sample of ``layer`` (a graph Layer) from the shapes of a batch of
    ``batch`` samples (measured: every dimension an int)."""
    if layer.op_type in ("Gemm", "MatMul"):
        rows = math.prod(output_shape[:-1]) if len(output_shape) > 1 else 1
        if batch <= 0 or rows % batch:
            return None
        return 2 * (rows // batch) * layer.n_in * layer.n_out
    if layer.op_type == "ConvTranspose":
        flops, _ = conv_transpose_flops(layer.n_in, layer.n_out // layer.groups, layer.kernel,
                                        (1, *input_shape[1:]))
        return flops
    flops, _ = conv_flops(layer.n_out, layer.n_in // layer.groups, layer.kernel,
                          (1, *output_shape[1:]))
    return flops
