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
        self.buffers: dict = {}  # reused float64 work buffers, one per (rows, columns)

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


def _fold_rows(moments: Moments, samples: np.ndarray, targets: np.ndarray | None, k: int,
               buffers: dict) -> None:
    """``moments`` of the columns [samples, targets repeated k times per image].

    Everything is float64 around the running mean (the first row on the first batch):
    the samples are copied into a contiguous float64 buffer ``y`` and shifted in place,
    the per-image columns ``e = [targets − centre | 1]`` hold for each of the image's k
    positions, and the Gram of ``[y | e]`` is assembled from ``yᵀy`` (one syrk, the bulk
    of the work), ``yᵀe`` = (y summed over each image's positions)ᵀ e and ``eᵀe`` = k eᵀe
    per image; its ones column gives the sums around the centre, so
    :meth:`Moments.update_sums` needs no second pass over the samples.
    """
    rows, c = samples.shape
    if rows == 0:
        return
    n_t = 0 if targets is None else targets.shape[1]
    d = c + n_t
    if moments.n:
        centre = moments.mean
    else:
        first = [samples[0]] if targets is None else [samples[0], targets[0]]
        centre = np.concatenate(first).astype(np.float64)
    y = buffers.get((rows, c))
    if y is None:
        y = buffers[(rows, c)] = np.empty((rows, c))
    np.copyto(y, samples)  # float32 → float64 (exact), contiguous
    y -= centre[:c]
    per_image = np.ones((rows // k, n_t + 1))
    if targets is not None:
        np.subtract(targets, centre[c:], out=per_image[:, :n_t])
    gram = np.empty((d + 1, d + 1))
    gram[:c, :c] = y.T @ y
    gram[:c, c:] = y.reshape(rows // k, k, c).sum(axis=1).T @ per_image
    gram[c:, :c] = gram[:c, c:].T
    gram[c:, c:] = k * (per_image.T @ per_image)
    moments.update_sums(rows, centre, gram[d, :d], gram[:d, :d])

