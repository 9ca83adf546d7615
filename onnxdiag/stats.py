"""Streaming float64 accumulators and spatial sampling (METHODS §B1, ARCHITECTURE invariant 5).

Every statistic is folded in batch by batch and the batch is dropped: memory grows
with the number of features (channels), never with the number of samples.  The
result does not depend on how the data were split into batches beyond floating
point rounding (~1e-12 relative): each batch is centred on its own mean and
combined with the running state by the pairwise update of Chan, Golub & LeVeque
(1979), after subtracting a fixed shift (the first sample seen) so that a large
common offset (|mean| >> std) cancels exactly instead of eating the precision.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import DataError

__all__ = [
    "JointMoments",
    "Moments",
    "draw_positions",
    "sample_positions",
    "spatial_mean",
]


#: float32 values per scratch chunk of :meth:`Moments.update_channels` (1 MiB: stays in cache).
CHUNK_VALUES = 1 << 18


class Moments:
    """Streaming count, mean, variance and (unbiased, ddof=1) covariance.

    Args:
        n_features: d, the width of every ``(n_samples, d)`` batch.
        full: keep the full ``(d, d)`` covariance (O(d²) memory); with ``False``
            only per-feature moments are kept (O(d)) and :meth:`cov` raises.

    Accumulated state (never the samples): ``n``, the shift ``(d,)``, the shifted
    mean ``(d,)`` and the centred sum of squares ``(d, d)`` or ``(d,)``.
    """

    def __init__(self, n_features: int, *, full: bool = True) -> None:
        if n_features < 1:
            raise ValueError(f"n_features must be >= 1, got {n_features}")
        self.n_features = int(n_features)
        self.full = bool(full)
        self.n = 0
        self._shift = np.zeros(self.n_features)
        self._mean = np.zeros(self.n_features)  # mean of (x - shift)
        shape = (self.n_features,) * (2 if self.full else 1)
        self._m2 = np.zeros(shape)  # sum of centred squares / cross-products

    def update(self, x: np.ndarray) -> Moments:
        """Fold in a batch ``x`` of shape ``(n_samples, n_features)``; returns self.

        An empty batch is a no-op.  ``x`` is read, never modified.
        """
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise ValueError(f"expected shape (n, {self.n_features}), got {x.shape}")
        if x.shape[0] == 0:
            return self
        if self.n == 0:
            self._shift = x[0].copy()
        xs = x - self._shift
        batch_mean = xs.mean(axis=0)
        centred = xs - batch_mean
        if self.full:
            batch_m2 = centred.T @ centred
        else:
            batch_m2 = np.einsum("ij,ij->j", centred, centred)
        self._combine(x.shape[0], batch_mean, batch_m2)
        return self

    def update_sums(self, n_b: int, centre: np.ndarray, sums: np.ndarray,
                    gram: np.ndarray) -> Moments:
        """Fold in a batch given only its sums around a centre; returns self.

        ``sums`` = Σ (x − centre) ``(d,)`` and ``gram`` = Σ (x − centre)(x − centre)ᵀ
        ``(d, d)`` over the batch's ``n_b`` rows (e.g. one BLAS ``syrk`` of a centred
        buffer with a column of ones appended).  With ``centre`` near the batch mean
        (the running mean is a good choice) nothing cancels; the result equals
        :meth:`update` on the rows to float64 rounding.  ``full=False`` takes the
        diagonal of ``gram``.
        """
        if n_b <= 0:
            return self
        centre = np.asarray(centre, dtype=np.float64)
        if self.n == 0:
            self._shift = centre.copy()
        offset = sums / n_b
        m2 = gram - np.outer(sums, offset)
        if not self.full:
            m2 = np.diag(m2).copy()
        self._combine(int(n_b), (centre - self._shift) + offset, m2)
        return self

    def update_axis(self, x: np.ndarray, axis: int = 1) -> Moments:
        """Fold in every value of ``x`` as samples of the features along ``axis`` (e.g. the
        channels of an (n, C, H, W) tensor) without a transposed copy; returns self.

        The same moments as :meth:`update` on ``moveaxis(x, axis, -1).reshape(-1, d)``
        to float64 rounding: float64 per-feature mean, then centred sums of squares
        (one contiguous float64 copy of ``x``, shifted and squared in place).
        """
        x = np.asarray(x)
        axis = axis % x.ndim
        if x.shape[axis] != self.n_features:
            raise ValueError(f"expected {self.n_features} features on axis {axis}, got "
                             f"{x.shape}")
        n_b = x.size // max(self.n_features, 1)
        if n_b == 0:
            return self
        others = tuple(i for i in range(x.ndim) if i != axis)
        shape = [1] * x.ndim
        shape[axis] = -1
        work = np.array(x, dtype=np.float64)  # contiguous, writable
        if self.n == 0:
            self._shift = work.mean(axis=others)
        work -= self._shift.reshape(shape)
        batch_mean = work.mean(axis=others)
        work -= batch_mean.reshape(shape)
        if self.full:
            rows = np.moveaxis(work, axis, -1).reshape(-1, self.n_features)
            batch_m2 = rows.T @ rows
        else:
            np.square(work, out=work)
            batch_m2 = work.sum(axis=others)
        self._combine(n_b, batch_mean, batch_m2)
        return self

    def update_channels(self, x: np.ndarray) -> Moments:
        """Fold in a float32 ``(n, C, *spatial)`` tensor as samples of its C channels (axis
        1): :meth:`update_axis` at a quarter of its memory traffic, for the repairs' large
        conv outputs; returns self.

        Per image and channel the Σ (x − s) and Σ (x − s)² over the spatial positions are
        float32 pairwise sums (NumPy's contiguous reduction: error ≲ (log₂ P + 16)·2⁻²⁴ of
        the sum of the magnitudes) of one float32 copy, with s ≈ the mean (the running
        mean; on the first batch the mean of every 7th position), merged over images and
        batches in float64. So the mean is exact to ~1e-7 σ and the variance to ~1e-6
        relative (tests/test_stats.py against float64): the float32 rounding of the
        parameters the repairs write. Other dtypes, layouts or full covariances:
        :meth:`update_axis`.
        """
        x = np.asarray(x)
        if (self.full or x.dtype != np.float32 or x.ndim < 3 or not x.flags.c_contiguous
                or x.shape[1] != self.n_features):
            return self.update_axis(x, 1)
        if x.size == 0:
            return self
        n, c = x.shape[:2]
        v = x.reshape(n, c, -1)
        p = v.shape[2]
        if self.n == 0:
            sub = v[:, :, ::7]
            centre = sub.sum(axis=2, dtype=np.float32).sum(axis=0, dtype=np.float64) / (
                n * sub.shape[2])
        else:
            centre = self.mean
        c32 = centre.astype(np.float32)
        s1, s2 = np.zeros(c), np.zeros(c)
        step = max(1, CHUNK_VALUES // (c * p))  # images per chunk: a cache-sized scratch
        buf = np.empty((min(step, n), c, p), np.float32)
        for i in range(0, n, step):
            d = buf[:min(step, n - i)]
            np.subtract(v[i:i + step], c32[:, None], out=d)
            s1 += d.sum(axis=2).sum(axis=0, dtype=np.float64)
            np.square(d, out=d)
            s2 += d.sum(axis=2).sum(axis=0, dtype=np.float64)
        n_b = n * p
        centre = c32.astype(np.float64)
        if self.n == 0:
            self._shift = centre.copy()
        self._combine(n_b, (centre - self._shift) + s1 / n_b, s2 - s1 * (s1 / n_b))
        return self

    def select(self, features) -> Moments:
        """A new accumulator of the chosen ``features`` only (indices into 0..d−1, in the
        order given): the same samples' moments of those columns."""
        idx = np.asarray(features, dtype=np.intp).reshape(-1)
        out = Moments(max(len(idx), 1), full=self.full)
        out.n_features = len(idx)
        out.n = self.n
        out._shift, out._mean = self._shift[idx].copy(), self._mean[idx].copy()
        out._m2 = self._m2[np.ix_(idx, idx)].copy() if self.full else self._m2[idx].copy()
        return out

    def merge(self, other: Moments) -> Moments:
        """Fold in another accumulator (e.g. from a data shard); returns self.

        ``other`` is not modified.  Both must have the same ``n_features``; a
        ``full`` accumulator can only absorb another ``full`` one.
        """
        if other.n_features != self.n_features:
            raise ValueError(f"n_features differ: {self.n_features} vs {other.n_features}")
        if self.full and not other.full:
            raise ValueError("cannot merge a diagonal-only Moments into a full one")
        if other.n == 0:
            return self
        if self.n == 0:
            self._shift = other._shift.copy()
        # Express other's mean in our shift frame: the two shifts are close, so
        # their difference is (nearly) exact.
        other_mean = (other._shift - self._shift) + other._mean
        other_m2 = other._m2 if self.full or not other.full else np.diag(other._m2).copy()
        self._combine(other.n, other_mean, other_m2)
        return self

    def _combine(self, n_b: int, mean_b: np.ndarray, m2_b: np.ndarray) -> None:
        """Chan et al. pairwise combination of (n, mean, M2) with a batch's."""
        n_a = self.n
        n = n_a + n_b
        delta = mean_b - self._mean
        weight = n_a * n_b / n
        if self.full:
            self._m2 += m2_b + np.outer(delta, delta) * weight
        else:
            self._m2 += m2_b + delta * delta * weight
        self._mean += delta * (n_b / n)
        self.n = n

    @property
    def mean(self) -> np.ndarray:
        """``(n_features,)`` float64 mean (zeros before any update)."""
        return self._shift + self._mean

    def var(self) -> np.ndarray:
        """``(n_features,)`` unbiased variance (ddof=1); DataError if n < 2."""
        self._require_two()
        diag = np.diag(self._m2) if self.full else self._m2
        return diag / (self.n - 1)

    def cov(self) -> np.ndarray:
        """``(n_features, n_features)`` unbiased covariance (ddof=1), a new array."""
        if not self.full:
            raise ValueError("cov() needs Moments(..., full=True)")
        self._require_two()
        return self._m2 / (self.n - 1)

    def _require_two(self) -> None:
        if self.n < 2:
            raise DataError(
                f"A variance needs at least 2 samples, but only {self.n} were seen; "
                "pass more data (check --limit)."
            )


class JointMoments:
    """Moments of features ``y`` ``(n_samples, n_features)`` and a per-sample target ``t``.

    The target is kept as an extra last column of one :class:`Moments`, so all
    cross-moments (METHODS §B1: n, Σy, Σyyᵀ, Σt, Σt², Σt·y) come from one accumulator.
    """

    def __init__(self, n_features: int) -> None:
        self.n_features = int(n_features)
        self.moments = Moments(self.n_features + 1, full=True)

    def update(self, y: np.ndarray, t: np.ndarray) -> JointMoments:
        """Fold in ``y`` ``(m, n_features)`` with targets ``t`` ``(m,)``; returns self."""
        t = np.asarray(t, dtype=np.float64).reshape(-1, 1)
        y = np.asarray(y, dtype=np.float64)
        if y.ndim != 2 or y.shape[0] != t.shape[0]:
            raise ValueError(f"y {y.shape} and t {t.shape[:1]} disagree on n_samples")
        self.moments.update(np.hstack([y, t]))
        return self

    def merge(self, other: JointMoments) -> JointMoments:
        """Fold in another accumulator; ``other`` is not modified; returns self."""
        self.moments.merge(other.moments)
        return self

    @property
    def n(self) -> int:
        return self.moments.n

    @property
    def mean_y(self) -> np.ndarray:
        """``(n_features,)`` mean of y."""
        return self.moments.mean[:-1]

    @property
    def mean_t(self) -> float:
        return float(self.moments.mean[-1])

    @property
    def cov_yy(self) -> np.ndarray:
        """``(n_features, n_features)`` unbiased covariance of y."""
        return self.moments.cov()[:-1, :-1]

    @property
    def cov_yt(self) -> np.ndarray:
        """``(n_features,)`` unbiased covariance of each y_i with t."""
        return self.moments.cov()[:-1, -1]

    @property
    def var_t(self) -> float:
        """Unbiased variance of t."""
        return float(self.moments.cov()[-1, -1])


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_DRAW_STEP = np.uint64(0xD1B54A32D192ED03)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic): a counter-based hash."""
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draw_positions(
    n_spatial: int, n_positions: int, *, seed: int, sample_indices: Sequence[int]
) -> np.ndarray:
    """Flat spatial positions ``(n_images, k)`` to sample, k = min(n_positions, n_spatial).

    Position j of image i is a counter-based hash of ``(seed, sample_indices[i], j)``
    (SplitMix64) mapped uniformly onto ``[0, n_spatial)`` with replacement, so an
    image gets the same positions whatever batch it arrives in, and the draw is
    vectorised over the batch.  When ``n_spatial <= n_positions`` every position is
    taken once, in order (METHODS §B1).
    """
    indices = np.asarray(sample_indices, dtype=np.int64).reshape(-1)
    if n_spatial <= n_positions:
        return np.broadcast_to(np.arange(n_spatial), (indices.size, n_spatial))
    key = _splitmix64(np.array([int(seed) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    per_image = _splitmix64(key ^ indices.astype(np.uint64))[:, None]
    with np.errstate(over="ignore"):
        counters = per_image + np.arange(n_positions, dtype=np.uint64) * _DRAW_STEP
    bits = _splitmix64(counters) >> np.uint64(32)  # 32 uniform bits
    return ((bits * np.uint64(n_spatial)) >> np.uint64(32)).astype(np.intp)


def sample_positions(
    x: np.ndarray,
    n_positions: int = 16,
    *,
    seed: int,
    sample_indices: Sequence[int],
) -> np.ndarray:
    """Spatial samples of a feature map: ``(n_images * k, n_channels)``.

    Args:
        x: ``(n_images, n_channels, *spatial)`` (e.g. NCHW) or ``(n_images, n_channels)``.
        n_positions: positions per image, drawn as in :func:`draw_positions`;
            k = min(n_positions, H·W) rows per image.
        seed: base seed of the draw.
        sample_indices: ``(n_images,)`` global index of each image in the data source.

    Rows are image-major (image 0's k rows first), so per-image targets repeat as
    ``np.repeat(t, k)``.  A 2-D ``x`` is returned as is (one sample per image).
    Output keeps ``x``'s dtype; ``x`` is not modified.
    """
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"expected (n_images, n_channels, ...), got shape {x.shape}")
    n_images, n_channels = x.shape[:2]
    if len(sample_indices) != n_images:
        raise ValueError(f"{len(sample_indices)} sample_indices for {n_images} images")
    if x.ndim == 2:
        return x
    flat = x.reshape(n_images, n_channels, -1)
    positions = draw_positions(
        flat.shape[2], n_positions, seed=seed, sample_indices=sample_indices
    )
    # (n_images, 1) and (n_images, k) around a slice: result is (n_images, k, C).
    picked = flat[np.arange(n_images)[:, None], :, positions]
    return picked.reshape(-1, n_channels)


def spatial_mean(x: np.ndarray) -> np.ndarray:
    """Per-image spatial mean in float64: ``(n_images, n_channels, *spatial)`` → ``(n, C)``.

    A 2-D ``x`` is returned as float64 unchanged (``--task-samples gap``, METHODS §B3).
    """
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"expected (n_images, n_channels, ...), got shape {x.shape}")
    if x.ndim == 2:
        return x.astype(np.float64, copy=False)
    return x.reshape(x.shape[0], x.shape[1], -1).mean(axis=2, dtype=np.float64)
