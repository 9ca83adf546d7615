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
from ..runtime.pool import thread_map
from ..stats import Moments, draw_positions
from .taps import InputTap, token_rows


def target_margin(U: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    """Per-image logit margin T = U_y − max_{k≠y} U_k; y = labels, or the argmax (pseudo)."""
    y = U.argmax(axis=1) if labels is None else np.asarray(labels, dtype=np.int64)
    rows = np.arange(U.shape[0])
    others = U.copy()
    others[rows, y] = -np.inf
    return U[rows, y] - others.max(axis=1)


class GramMoments(Moments):
    """:class:`~onnxdiag.stats.Moments` that take a batch's Gram in place (the fold's hot path).

    :meth:`fold_sums` folds a batch's count and sums around a centre and returns the float64
    (d, d) accumulator into which the caller then adds the batch's Gram
    Σ (x − centre)(x − centre)ᵀ. The batch's two rank-one terms of
    :meth:`~onnxdiag.stats.Moments.update_sums` (its own centring, −u uᵀ / n_b with
    u = Σ (x − centre), and Chan's n_a n_b / n · δ δᵀ) are kept aside as vectors and added
    by one BLAS product before anything reads the moments (or once ``PENDING`` are
    waiting). The same moments as ``update_sums`` to float64 rounding, without a batch's
    four (d, d) float64 temporaries: at d = 2,050 (ResNet-50's widest layers) those cost
    twice the batch's own float32 Gram.
    """

    #: Rank-one terms kept aside before they are added (two per batch).
    PENDING = 64

    def __init__(self, n_features: int, *, full: bool = True) -> None:
        super().__init__(n_features, full=full)
        self._pending: list = []

    def fold_sums(self, n_b: int, centre: np.ndarray, sums: np.ndarray) -> np.ndarray:
        """Fold in a batch's ``n_b`` rows by their ``sums`` around ``centre``; returns the
        (d, d) float64 accumulator to which the caller must add the batch's Gram around
        ``centre`` before the next call (a full accumulator only)."""
        if not self.full:
            raise ValueError("fold_sums needs GramMoments(..., full=True)")
        if n_b <= 0:  # an empty batch adds nothing (its Gram is zero)
            return self._m2
        centre = np.asarray(centre, dtype=np.float64)
        sums = np.asarray(sums, dtype=np.float64)
        if self.n == 0:
            self._shift = centre.copy()
        n = self.n + n_b
        delta = (centre - self._shift) + sums / n_b - self._mean
        self._pending += [(-1.0 / n_b, sums), (self.n * n_b / n, delta)]
        self._mean += delta * (n_b / n)
        self.n = n
        if len(self._pending) >= self.PENDING:
            self.settle()
        return self._m2

    def settle(self) -> GramMoments:
        """Add the rank-one terms kept aside (one (d, k) × (k, d) product); returns self."""
        if self._pending:
            coef = np.array([c for c, _ in self._pending])
            v = np.stack([x for _, x in self._pending])
            self._m2 += (v.T * coef) @ v
            self._pending = []
        return self

    def select(self, features) -> Moments:
        return super(GramMoments, self.settle()).select(features)

    def merge(self, other: Moments) -> Moments:
        if isinstance(other, GramMoments):
            other.settle()  # the same moments, their terms added
        return super(GramMoments, self.settle()).merge(other)

    def _combine(self, n_b: int, mean_b: np.ndarray, m2_b: np.ndarray) -> None:
        super(GramMoments, self.settle())._combine(n_b, mean_b, m2_b)

    def var(self) -> np.ndarray:
        return super(GramMoments, self.settle()).var()

    def cov(self) -> np.ndarray:
        return super(GramMoments, self.settle()).cov()


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
        return cls(layer.node_name, layer.n_out, GramMoments(layer.n_out + 2),
                   GramMoments(layer.n_out) if task_samples == "gap" else None)

    def settle(self) -> LayerMoments:
        """Every batch's deferred terms added (:meth:`GramMoments.settle`); returns self."""
        for m in (self.task, self.local):
            if isinstance(m, GramMoments):
                m.settle()
        return self

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
        # reused float32 work buffers per (rows, columns), one set per folding thread
        self.buffers: list[dict] = [{}]
        self.groups: dict[int, list] = {}  # workers → the layers each folds

    def fold(self, batch, out, workers: int = 1) -> int:
        """Fold ``out`` (the pass's outputs for ``batch``); the number of images.
        ``workers`` > 1: the layers split over that many threads (:func:`split_layers`);
        each layer's moments are those of one thread, bit for bit."""
        s = self.settings
        _, U = head_arrays(out, self.head)
        if self.targets == "labels":
            check_batch_labels(batch.labels, batch.indices, U.shape[1], "the --data labels")
        t = target_margin(U, batch.labels if self.targets == "labels" else None)
        t_null = _shuffle(t, s.seed, batch.indices)
        if workers <= 1:
            self._fold_layers(self.chosen, batch, out, t, t_null, self.buffers[0])
            return len(t)
        if workers not in self.groups:
            self.groups[workers] = split_layers(self.chosen, workers)
            self.buffers += [{} for _ in range(workers - len(self.buffers))]
        groups = self.groups[workers]
        with thread_map(len(groups), workers) as pool:
            pool(lambda j: self._fold_layers(groups[j], batch, out, t, t_null,
                                             self.buffers[j]), range(len(groups)))
        return len(t)

    def _fold_layers(self, layers, batch, out, t, t_null, buffers: dict) -> None:
        s = self.settings
        both = np.column_stack([t, t_null])
        positions: dict[int, tuple] = {}
        for la in layers:
            tap, acc = self.taps[la.node_name], self.acc[la.node_name]
            if isinstance(tap, InputTap):
                samples = tap.samples(out[self.names[tap.reads(la)]], batch.indices,
                                      s.n_positions, s.seed)
                _fold_rows(acc.task, samples, both, samples.shape[0] // len(t), buffers)
                acc.n_images += len(t)
            else:
                x = out[self.names[la.output]]
                if not la.op_type.startswith("Conv"):  # (…, C) rows: inputs × tokens
                    x = token_rows(x, len(t))
                _fold(acc, x, t, t_null, batch.indices, positions,
                      s.n_positions, s.seed, s.task_samples, buffers)


def split_layers(layers, workers: int) -> list[list]:
    """``layers`` in ``workers`` groups of about equal fold work ((C + 3)² each, the
    Gram's), largest first onto the least loaded group; each group in the pass's order."""
    loads, groups = [0] * workers, [[] for _ in range(workers)]
    order = sorted(range(len(layers)), key=lambda i: -(layers[i].n_out + 3) ** 2)
    for i in order:
        j = loads.index(min(loads))
        groups[j].append(i)
        loads[j] += (layers[i].n_out + 3) ** 2
    return [[layers[i] for i in sorted(g)] for g in groups if g]


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
#: Extra float32 columns of a Gram scratch's rows: a (d, d) product written with a row
#: stride of d + 16 avoids the cache-set conflicts of power-of-two strides (one syrk of
#: 512 rows at d = 1,024: 9.9 -> 6.1 ms, 2,048: 52 -> 30 ms; benchmarks/RESULTS.md).
SCRATCH_PAD = 16


def gram_scratch(d: int) -> np.ndarray:
    """A float32 (d, d) scratch for :func:`blocked_gram`, rows ``SCRATCH_PAD`` apart."""
    return np.empty((d, d + SCRATCH_PAD), np.float32)[:, :d]


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


def blocked_gram(z32: np.ndarray, block: int = GRAM_BLOCK, *, out: np.ndarray | None = None,
                 work: np.ndarray | None = None) -> np.ndarray:
    """zᵀz (float64, (d, d)) of float32 rows ``z32`` (rows, d): one float32 symmetric
    rank-k update (syrk: exactly symmetric) per block of ``block`` rows, summed in float64
    (error: :func:`gram_error_bound`). ``out``: a float64 (d, d) array (or view) the
    products are added to, in place, and returned (default: zeros); ``work``: a float32
    (d, d) scratch for each block's product (default: :func:`gram_scratch`)."""
    rows, d = z32.shape
    gram = np.zeros((d, d)) if out is None else out
    if work is None:
        work = gram_scratch(d)
    for a in range(0, rows, block):
        part = z32[a:a + block]
        np.matmul(part.T, part, out=work)  # NumPy calls syrk for Aᵀ A
        gram += work
    return gram


def _fold_rows(moments: GramMoments, samples: np.ndarray, targets: np.ndarray | None, k: int,
               buffers: dict) -> None:
    """``moments`` of the columns [samples, targets repeated k times per image].

    The samples are centred on the batch's own mean rounded to float32, in one float32
    buffer ``z`` reused across batches (any centre is exact for the moments' sums; the
    batch's mean leaves nothing to cancel, and, unlike the running mean, depends on the
    batch alone, so a batch folds to the same float64 numbers in a single pass and in any
    shard: the split-exactness of ``docs/ARCHITECTURE.md`` invariant 5). Their Gram is
    :func:`blocked_gram` (float32 blocks merged in float64; error bound
    :func:`gram_error_bound`, tested), added in place to the float64 accumulator that
    :meth:`GramMoments.fold_sums` returns. Everything else is float64 and small: the
    per-image sums of z over its k positions (float32 sums of k terms, n × C; their total
    is the sums around the centre), their products with the per-image targets (the C × 2
    cross block) and the targets' own block (the target and its permutation control stay
    float64-exact).
    """
    rows, c = samples.shape
    if rows == 0:
        return
    # the batch's own mean (see the docstring), by one BLAS product
    centre = np.ones(rows, samples.dtype) @ samples / rows
    if targets is not None:
        centre = np.concatenate([centre, targets.mean(axis=0)])
    centre32 = centre.astype(np.float32)
    z = buffers.get((rows, c))
    if z is None:
        z = buffers[(rows, c)] = np.empty((rows, c), np.float32)
    work = buffers.get(("work", c))
    if work is None:
        work = buffers[("work", c)] = gram_scratch(c)
    np.subtract(samples, centre32[:c], out=z, casting="unsafe")
    # float32 sums of an image's k rows (one batched BLAS product), merged in float64; one
    # row an image (a 1×1 map): the row itself (the product's 256 tiny calls cost 95 µs)
    per_image = (z if k == 1 else np.ones(k, np.float32) @ z.reshape(rows // k, k, c)
                 ).astype(np.float64)
    sums = per_image.sum(axis=0)
    if targets is not None:
        t = np.asarray(targets, np.float64) - centre32[c:]
        sums = np.concatenate([sums, k * t.sum(axis=0)])
    m2 = moments.fold_sums(rows, centre32.astype(np.float64), sums)
    blocked_gram(z, out=m2[:c, :c], work=work)
    if targets is not None:
        cross = per_image.T @ t  # Σ z T over the rows: T is constant over an image's rows
        m2[:c, c:] += cross
        m2[c:, :c] += cross.T
        m2[c:, c:] += k * (t.T @ t)
