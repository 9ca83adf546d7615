"""The accumulators of the statistics pass and the per-batch fold (its hot loop).

Per analysed layer, float64 :class:`~onnxdiag.stats.Moments` of the sampled channel
vectors y together with the per-image target T (the logit margin,
``docs/METHODS.md §B3``) and its permutation control (T shuffled across the images of
each batch, seeded): memory O(C²) per layer, whatever the number of images. Mergeable
across shards, exact for any batch split to float64 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..data.labels import check_batch_labels
from ..evaluate import head_arrays
from ..stats import Moments, draw_positions
from .taps import InputTap, token_rows


def target_margin(U: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    """Per-image logit margin T = U_y − max_{k≠y} U_k; y = labels, or the argmax (pseudo)."""
    y = U.argmax(axis=1) if labels is None else np.asarray(labels, dtype=np.int64)
    rows = np.arange(U.shape[0])
    others = U.copy()
    others[rows, y] = -np.inf
    return U[rows, y] - others.max(axis=1)


@dataclass
class LayerMoments:
    """Accumulated statistics of one layer (mergeable across shards).

    ``task``: Moments of the columns [y (C), T, T_null] where y are the spatial
    samples with T repeated per position ("match") or the per-image spatial means
    ("gap"), and T_null is T permuted across images (the permutation control).
    ``local``: Moments of the spatial samples (C) — only kept for "gap"; for "match"
    the local statistics are the first C columns of ``task`` (one Gram update).
    """

    layer: str
    n_channels: int
    task: Moments
    local: Moments | None = None
    n_images: int = 0

    @classmethod
    def empty(cls, layer, task_samples: str) -> LayerMoments:
        """Fresh accumulators for an analysed ``layer`` (a graph Layer)."""
        return cls(layer.node_name, layer.n_out, Moments(layer.n_out + 2),
                   Moments(layer.n_out) if task_samples == "gap" else None)

    def merge(self, other: LayerMoments) -> LayerMoments:
        self.task.merge(other.task)
        if self.local is not None:
            self.local.merge(other.local)
        self.n_images += other.n_images
        return self

    def local_moments(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean (C,), cov (C, C)) of the spatial samples: the local axis (§B2)."""
        if self.local is not None:
            return self.local.mean, self.local.cov()
        c = self.n_channels
        return self.task.mean[:c], self.task.cov()[:c, :c]

    def target_moments(self, *, null: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
        """(cov_yy, cov_yt, var_t) for the target axis (§B3); ``null``: permuted T."""
        c = self.n_channels
        cov = self.task.cov()
        j = c + (1 if null else 0)
        return cov[:c, :c], cov[:c, j], float(cov[j, j])


@dataclass(frozen=True)
class ChannelStats:
    """The result of a statistics pass
    (:func:`~onnxdiag.channels.collect.collect_channel_moments`): per-layer moments and
    the settings they were collected with."""

    layers: dict[str, LayerMoments]
    targets: str
    task_samples: str
    n_positions: int
    seed: int
    n_images: int
    data: dict = field(default_factory=dict)
    taps: dict = field(default_factory=dict)
    kinds: dict = field(default_factory=dict)


class BatchFolder:
    """Folds one batch's head outputs and layer tensors into every layer's moments.

    ``chosen``: the analysed Layers; ``taps``: layer → "output" or an InputTap;
    ``names``: layer tensor → its exposed channels-last output; ``head``: the Head;
    ``settings``: the pass's StatsSettings; ``targets``: "labels" or "pseudo".
    """

    def __init__(self, chosen, taps: dict, names: dict, head, settings, targets: str):
        self.chosen, self.taps, self.names, self.head = chosen, taps, names, head
        self.settings, self.targets = settings, targets
        self.acc = {la.node_name: LayerMoments.empty(la, settings.task_samples)
                    for la in chosen}
        self.buffers: dict = {}  # reused float32 work buffers, one per (rows, columns)

    def fold(self, batch, out) -> int:
        """Fold ``out`` (the pass's outputs for ``batch``); the number of images."""
        s = self.settings
        _, U = head_arrays(out, self.head)
        if self.targets == "labels":
            check_batch_labels(batch.labels, batch.indices, U.shape[1], "the --data labels")
        t = target_margin(U, batch.labels if self.targets == "labels" else None)
        t_null = _shuffle(t, s.seed, batch.indices)
        both = np.column_stack([t, t_null])
        positions: dict[int, tuple] = {}
        for la in self.chosen:
            tap, acc = self.taps[la.node_name], self.acc[la.node_name]
            if isinstance(tap, InputTap):
                samples = tap.samples(out[self.names[la.input]], batch.indices,
                                      s.n_positions, s.seed)
                _fold_rows(acc.task, samples, both, samples.shape[0] // len(t), self.buffers)
                acc.n_images += len(t)
            else:
                x = out[self.names[la.output]]
                if not la.op_type.startswith("Conv"):  # (…, C) rows: inputs × tokens
                    x = token_rows(x, len(t))
                _fold(acc, x, t, t_null, batch.indices, positions,
                      s.n_positions, s.seed, s.task_samples, self.buffers)
        return len(t)


def _shuffle(t: np.ndarray, seed: int, indices: np.ndarray) -> np.ndarray:
    """T permuted across the images of one batch (seeded by the batch's first index).

    A within-batch permutation is a valid null as long as batches are not sorted by
    class; it keeps memory O(batch) instead of storing every image's statistics.
    """
    first = int(indices[0]) if len(indices) else 0
    return t[np.random.default_rng([seed, 7919, first]).permutation(len(t))]


def _fold(acc: LayerMoments, x: np.ndarray, t, t_null, indices, positions, n_positions, seed,
          task_samples, buffers: dict) -> None:
    """Fold one layer's batch output into its moments (the hot loop of the pass).

    ``x`` is channels-last, ``(n, *spatial, C)`` (a linear layer's ``(n, tokens, C)``),
    so the sampled positions are whole rows of ``x`` viewed as (n·HW, C): one ``take``
    gathers them. ``positions`` caches the
    batch's rows per spatial size (layers of one size share their draw).
    """
    n, c = x.shape[0], x.shape[-1]
    hw = int(np.prod(x.shape[1:-1]))
    if hw not in positions:
        pos = draw_positions(hw, n_positions, seed=seed, sample_indices=indices)
        positions[hw] = ((pos + np.arange(n)[:, None] * hw).reshape(-1), pos.shape[1])
    rows, k = positions[hw]
    samples = np.take(x.reshape(n * hw, c), rows, axis=0)  # (n·k, C), image-major
    if task_samples == "match":
        _fold_rows(acc.task, samples, np.column_stack([t, t_null]), k, buffers)
    else:
        _fold_rows(acc.local, samples, None, k, buffers)
        means = x.reshape(n, hw, c).mean(axis=1, dtype=np.float64)
        acc.task.update(np.column_stack([means, t, t_null]))
    acc.n_images += n


#: Rows per float32 Gram block: each block's products are one float32 BLAS product
#: (syrk), merged into the float64 accumulators (``docs/METHODS.md §B1``).
GRAM_BLOCK = 1024
#: The unit roundoff of float32.
U32 = 2.0 ** -24


def gram_error_bound(abs_gram: np.ndarray, block: int = GRAM_BLOCK) -> np.ndarray:
    """Bound on |:func:`blocked_gram` − the exact Gram of z = x − centre|, entrywise,
    given ``abs_gram`` = Σ|z_i||z_j| over the rows (which Cauchy–Schwarz bounds by
    √(G_ii G_jj): the bound is a relative error of the products).

    Per entry: the float32 centring ẑ = z(1 + δ), |δ| ≤ u, changes a product by at most
    (2u + u²)|z_i z_j|; a float32 dot product of m ≤ ``block`` terms errs by at most
    γ_m Σ|ẑ_i ẑ_j| (any summation order, FMA or not), γ_m = m u / (1 − m u); the
    float64 sums of the blocks add ~2⁻⁵³ per block (taken as u). With m = 1024,
    ≈ 6.1e-5 of Σ|z_i||z_j|; typical errors are ~√m u ≈ 2e-6 of it.
    """
    m = block
    gamma = m * U32 / (1 - m * U32)
    return ((gamma + 2 * U32 + U32 ** 2) * (1 + 2 * U32 + U32 ** 2) + U32) * abs_gram


def blocked_gram(z32: np.ndarray, block: int = GRAM_BLOCK) -> np.ndarray:
    """zᵀz (float64, (d, d)) of float32 rows ``z32`` (rows, d): float32 products over
    blocks of ``block`` rows, summed in float64 (error: :func:`gram_error_bound`)."""
    rows, d = z32.shape
    gram = np.zeros((d, d))
    for a in range(0, rows, block):
        part = z32[a:a + block]
        gram += part.T @ part  # one float32 syrk per block
    return gram


def _fold_rows(moments: Moments, samples: np.ndarray, targets: np.ndarray | None, k: int,
               buffers: dict) -> None:
    """``moments`` of the columns [samples, targets repeated k times per image].

    One float32 buffer ``z = [samples − centre | targets − centre | 1]`` (reused across
    batches; the targets repeated for each of the image's k positions), centred on the
    batch's own mean rounded to float32 (any centre is exact for
    :meth:`Moments.update_sums`; the batch's mean leaves nothing to cancel, and, unlike
    the running mean, depends on the batch alone, so a batch folds to the same float64
    numbers in a single pass and in any shard: the split-exactness of
    ``docs/ARCHITECTURE.md`` invariant 5), and its Gram :func:`blocked_gram` (float32
    blocks merged in float64; error bound :func:`gram_error_bound`, tested), whose block
    of the per-image columns alone is recomputed in float64 (n × 3 values: the targets'
    own moments, and the permutation control's, stay float64-exact). Its ones column
    gives the sums around the centre, so :meth:`Moments.update_sums` needs no second
    pass over the samples.
    """
    rows, c = samples.shape
    if rows == 0:
        return
    n_t = 0 if targets is None else targets.shape[1]
    d = c + n_t
    # the batch's own mean (see the docstring), by one BLAS product: any centre is exact
    # for update_sums, and a float32-accurate one leaves nothing to cancel
    centre = np.ones(rows, samples.dtype) @ samples / rows
    if targets is not None:
        centre = np.concatenate([centre, targets.mean(axis=0)])
    centre32 = centre.astype(np.float32)
    z = buffers.get((rows, d))
    if z is None:
        z = buffers[(rows, d)] = np.empty((rows, d + 1), np.float32)
        z[:, d] = 1.0
    np.subtract(samples, centre32[:c], out=z[:, :c], casting="unsafe")
    per_image = np.ones((rows // k, n_t + 1))
    if targets is not None:
        np.subtract(targets, centre32[c:], out=per_image[:, :n_t])
        z[:, c:d] = np.repeat(per_image[:, :n_t], k, axis=0)
    gram = blocked_gram(z)
    gram[c:, c:] = k * (per_image.T @ per_image)  # the per-image columns' block: float64
    moments.update_sums(rows, centre32.astype(np.float64), gram[d, :d], gram[:d, :d])
