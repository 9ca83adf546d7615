"""A 1×1 conv's pruned output moments derived from its input's (the sequential pass,
METHODS §C1): y = W x + b per position, so the per-channel mean and variance of y are
W μ_x + b and the diagonal of W Σ_x Wᵀ, read off the input's channel moments.

Where a conv widens its input (an inverted residual's expansion, a bottleneck's last
1×1), its output is the largest tensor around; measuring the repair on the input instead
keeps that output inside ONNX Runtime (no segment boundary there: no copy out of its
blocked layout and back) for a C_in × C_in Gram of the narrower input.
"""

from __future__ import annotations

import numpy as np

from ..runtime.pool import thread_map
from ..stats import Moments
from .fold import merged

#: Derive a 1×1 conv's output moments from its input when C_in² ≤ DERIVE_RATIO · C_out
#: (**our default**; 0: never): the input's Gram costs C_in² multiply-adds per position,
#: the output boundary it spares touches C_out values per position several times.
DERIVE_RATIO = 16
#: Input values per Gram of :func:`input_moments` (its float64 copy: 32 MiB).
CHUNK_VALUES = 1 << 22


def derivable(layer, ratio: float | None = None) -> bool:
    """Whether ``layer``'s output moments can be derived from its input's and the rule
    (:data:`DERIVE_RATIO`) says they should: a widening 1×1 Conv, one group, stride 1, no
    padding (every output position is one input position)."""
    ratio = DERIVE_RATIO if ratio is None else ratio
    return (layer.op_type == "Conv" and layer.groups == 1 and bool(layer.kernel)
            and all(k == 1 for k in layer.kernel) and all(s == 1 for s in layer.stride)
            and not any(layer.pads) and layer.n_out > layer.n_in
            and layer.n_in ** 2 <= ratio * layer.n_out)


def input_moments(batches) -> Moments:
    """Full channel moments (axis 1) of the ``(n, C, *spatial)`` ``batches``, every
    position a sample: the batches in chunks of about :data:`CHUNK_VALUES` values, per
    chunk (on threads) a float64 Gram around the chunk's mean (estimated from every 7th
    position), the chunks' moments merged in order."""
    batches = [np.asarray(x) for x in batches]
    if not batches:
        raise ValueError("no batches")
    chunks, size = [[]], 0
    for x in batches:
        if size and size + x.size > CHUNK_VALUES:
            chunks.append([])
            size = 0
        chunks[-1].append(x)
        size += x.size
    with thread_map(len(chunks)) as pool:
        return merged(pool(_chunk_moments, chunks))


def _chunk_moments(xs: list) -> Moments:
    """One chunk's full channel moments (:func:`input_moments`): one float64 copy of its
    batches as (C, positions) rows less the centre, and its symmetric product."""
    c = xs[0].shape[1]
    acc = Moments(c, full=True)
    parts = [x.reshape(len(x), c, -1).transpose(1, 0, 2).reshape(c, -1) for x in xs]
    n = sum(p.shape[1] for p in parts)
    if n == 0:
        return acc
    rows = np.empty((c, n))
    at = 0
    for p in parts:
        rows[:, at:at + p.shape[1]] = p
        at += p.shape[1]
    centre = rows[:, ::7].mean(axis=1)
    rows -= centre[:, None]
    return acc.update_sums(n, centre, rows.sum(axis=1), rows @ rows.T)


def derived_moments(weight: np.ndarray, bias: np.ndarray | None, inputs: Moments) -> Moments:
    """Per-channel moments of a 1×1 conv's output (``weight`` (C_out, C_in, 1, …),
    ``bias`` (C_out,) or None) from its input's full moments: mean W μ + b, centred sums
    of squares diag(W M₂ Wᵀ), in float64."""
    w = np.asarray(weight, np.float64).reshape(len(weight), -1)
    mean = w @ inputs.mean + (0.0 if bias is None else np.asarray(bias, np.float64))
    m2 = np.einsum("oi,oi->o", w @ inputs.cov(), w) * (inputs.n - 1)
    out = Moments(len(w), full=False)
    return out.update_sums(inputs.n, mean, np.zeros(len(w)), np.diag(m2))
