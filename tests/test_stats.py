"""Streaming accumulators (oracle: NumPy on the concatenated data) and spatial sampling."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiag.errors import DataError
from onnxdiag.stats import JointMoments, Moments, draw_positions, sample_positions, spatial_mean

N, D = 301, 6


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    """(N, D) correlated samples with |mean| >> std."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, D)) @ rng.normal(size=(D, D)) + 1e6 * np.arange(1, D + 1)


def splits(n: int) -> dict[str, list[int]]:
    """Batch boundaries: batch size 1, a regular size and uneven random sizes."""
    rng = np.random.default_rng(1)
    uneven = np.sort(rng.choice(np.arange(1, n), size=17, replace=False)).tolist()
    return {"ones": list(range(1, n)), "sevens": list(range(7, n, 7)), "uneven": uneven}


def stream(x: np.ndarray, cuts: list[int], **kwargs) -> Moments:
    moments = Moments(x.shape[1], **kwargs)
    for part in np.split(x, cuts):
        moments.update(part)
    return moments


def relative(a, b) -> float:
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", ["ones", "sevens", "uneven"])
def test_streamed_moments_equal_numpy(data, name):
    moments = stream(data, splits(N)[name])
    assert moments.n == N
    assert relative(moments.mean, data.mean(axis=0)) < 1e-14
    assert relative(moments.cov(), np.cov(data, rowvar=False)) < 1e-11
    assert relative(moments.var(), data.var(axis=0, ddof=1)) < 1e-11


def test_batch_splits_agree_to_rounding(data):
    covs = [stream(data, cuts).cov() for cuts in splits(N).values()]
    for cov in covs[1:]:
        assert relative(cov, covs[0]) < 1e-12


def test_diagonal_only_moments(data):
    moments = stream(data, splits(N)["uneven"], full=False)
    assert moments._m2.shape == (D,)
    assert relative(moments.var(), data.var(axis=0, ddof=1)) < 1e-11
    with pytest.raises(ValueError, match="full=True"):
        moments.cov()


def test_merge_equals_single_stream(data):
    whole = stream(data, [])
    shards = [stream(part, [5]) for part in np.split(data, [100, 101, 250])]
    merged = Moments(D)
    for shard in shards:
        merged.merge(shard)
    assert merged.n == N
    assert relative(merged.cov(), whole.cov()) < 1e-12
    assert relative(merged.mean, whole.mean) < 1e-15
    diagonal = Moments(D, full=False).merge(shards[0]).merge(shards[1])
    np.testing.assert_allclose(diagonal.var(), np.diag(Moments(D).merge(shards[0])
                                                       .merge(shards[1]).cov()), rtol=1e-12)
    with pytest.raises(ValueError):
        Moments(D).merge(Moments(D, full=False))


def test_empty_batch_and_too_few_samples():
    moments = Moments(3).update(np.zeros((0, 3))).update(np.ones((1, 3)))
    assert moments.n == 1
    with pytest.raises(DataError, match="at least 2 samples, but only 1"):
        moments.cov()
    with pytest.raises(ValueError):
        moments.update(np.ones((2, 4)))


def test_joint_moments_match_stacked_cov(data):
    y, t = data[:, :4], data[:, 4] * 1e-6 + data[:, 0]
    joint = JointMoments(4)
    for cut in np.split(np.arange(N), [3, 40, 41, 200]):
        joint.update(y[cut], t[cut])
    full = np.cov(np.column_stack([y, t]), rowvar=False)
    assert joint.n == N
    assert relative(joint.cov_yy, full[:4, :4]) < 1e-11
    assert relative(joint.cov_yt, full[:4, 4]) < 1e-11
    assert abs(joint.var_t - full[4, 4]) / full[4, 4] < 1e-11
    assert abs(joint.mean_t - t.mean()) < 1e-9


@pytest.fixture(scope="module")
def maps() -> np.ndarray:
    return np.random.default_rng(2).normal(size=(10, 3, 5, 6)).astype(np.float32)


def test_sample_positions_is_independent_of_batching(maps):
    whole = sample_positions(maps, 16, seed=7, sample_indices=np.arange(10) + 100)
    parts = [sample_positions(maps[a:b], 16, seed=7, sample_indices=np.arange(a, b) + 100)
             for a, b in [(0, 1), (1, 4), (4, 10)]]
    assert whole.shape == (10 * 16, 3) and whole.dtype == np.float32
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    again = sample_positions(maps, 16, seed=7, sample_indices=np.arange(10) + 100)
    np.testing.assert_array_equal(whole, again)
    other = sample_positions(maps, 16, seed=8, sample_indices=np.arange(10) + 100)
    assert not np.array_equal(whole, other)


def test_sampled_rows_are_positions_of_their_image(maps):
    rows = sample_positions(maps, 16, seed=0, sample_indices=np.arange(10))
    for i in range(10):
        columns = maps[i].reshape(3, -1).T  # (H*W, C)
        for row in rows[i * 16:(i + 1) * 16]:
            assert (columns == row).all(axis=1).any()


def test_small_maps_take_every_position_and_2d_passes_through(maps):
    small = maps[:, :, :2, :3]  # H*W = 6 <= 16
    rows = sample_positions(small, 16, seed=0, sample_indices=np.arange(10))
    np.testing.assert_array_equal(rows, small.reshape(10, 3, 6).transpose(0, 2, 1).reshape(60, 3))
    flat = maps[:, :, 0, 0]
    assert sample_positions(flat, 16, seed=0, sample_indices=np.arange(10)) is flat
    with pytest.raises(ValueError):
        sample_positions(maps, 16, seed=0, sample_indices=np.arange(9))


def test_spatial_mean(maps):
    np.testing.assert_allclose(spatial_mean(maps), maps.astype(np.float64).mean(axis=(2, 3)))
    assert spatial_mean(maps).dtype == np.float64
    assert spatial_mean(maps[:, :, 0, 0]).shape == (10, 3)


@pytest.mark.parametrize("name", ["ones", "sevens", "uneven"])
def test_update_sums_equals_update(data, name):
    """The syrk fast path (sums and Gram around the running mean) equals update()."""
    fast = Moments(D)
    for part in np.split(data, splits(N)[name]):
        centre = fast.mean if fast.n else part[0]
        dev = np.column_stack([part - centre, np.ones(len(part))])
        gram = dev.T @ dev
        fast.update_sums(len(part), centre, gram[D, :D], gram[:D, :D])
    assert fast.n == N
    assert relative(fast.mean, data.mean(axis=0)) < 1e-14
    assert relative(fast.cov(), np.cov(data, rowvar=False)) < 1e-11
    diag = Moments(D, full=False).update_sums(N, data[0], (data - data[0]).sum(axis=0),
                                              (data - data[0]).T @ (data - data[0]))
    assert relative(diag.var(), data.var(axis=0, ddof=1)) < 1e-9


def test_draw_positions_counter_based_and_uniform():
    """Image i's draw depends only on (seed, index): any subset / order gives the same rows;
    positions cover [0, n) uniformly (chi-square) and differ across images and seeds."""
    idx = np.arange(20000) * 3 + 11
    pos = draw_positions(49, 16, seed=4, sample_indices=idx)
    assert pos.shape == (20000, 16) and pos.min() >= 0 and pos.max() < 49
    perm = np.random.default_rng(0).permutation(idx.size)[:500]
    np.testing.assert_array_equal(draw_positions(49, 16, seed=4, sample_indices=idx[perm]),
                                  pos[perm])
    counts = np.bincount(pos.ravel(), minlength=49)
    expected = pos.size / 49
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 100  # 48 degrees of freedom: P(chi2 > 100) ~ 2e-5
    assert (pos[1:] != pos[:-1]).any(axis=1).all()
    other = draw_positions(49, 16, seed=5, sample_indices=idx)
    assert (pos != other).mean() > 0.9
    small = draw_positions(9, 16, seed=4, sample_indices=np.arange(3))
    np.testing.assert_array_equal(small, np.tile(np.arange(9), (3, 1)))


@pytest.mark.parametrize("full", [True, False])
def test_select_equals_the_moments_of_the_chosen_columns(full):
    from onnxdiag.stats import Moments

    rng = np.random.default_rng(3)
    x = rng.normal(size=(50, 6)) * 4 + 10
    acc = Moments(6, full=full)
    for part in np.split(x, [7, 30]):
        acc.update(part)
    idx = [4, 0, 5]
    sub, ref = acc.select(idx), Moments(3, full=full).update(x[:, idx])
    assert sub.n == 50 and sub.n_features == 3
    np.testing.assert_allclose(sub.mean, ref.mean, rtol=1e-13)
    np.testing.assert_allclose(sub.var(), ref.var(), rtol=1e-12)
    if full:
        np.testing.assert_allclose(sub.cov(), ref.cov(), rtol=1e-12, atol=1e-12)
    sub.update(x[:3, idx])  # an independent accumulator
    assert acc.n == 50


@pytest.mark.parametrize("full", [False, True])
def test_update_axis_equals_update_on_the_transposed_rows(full):
    """Moments.update_axis (features on an axis of an NCHW tensor, no transposed copy) equals
    Moments.update on the explicit (n·H·W, C) rows, for any batch split, to float64 rounding."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(7, 5, 4, 3)) * 3 + 50).astype(np.float32)
    a, b = Moments(5, full=full), Moments(5, full=full)
    for part in np.split(np.arange(7), [2, 3]):
        a.update_axis(x[part], 1)
        b.update(np.moveaxis(x[part], 1, -1).reshape(-1, 5))
    assert a.n == b.n == 7 * 12
    np.testing.assert_allclose(a.mean, b.mean, rtol=1e-13)
    np.testing.assert_allclose(a.var(), b.var(), rtol=1e-11)
    ref = np.moveaxis(x, 1, -1).reshape(-1, 5).astype(np.float64)
    np.testing.assert_allclose(a.var(), ref.var(axis=0, ddof=1), rtol=1e-11)
    if full:
        np.testing.assert_allclose(a.cov(), np.cov(ref, rowvar=False), rtol=1e-11)


@pytest.mark.parametrize("shape", [(6, 5, 40, 40), (6, 5, 1, 1), (3, 4, 3, 7, 2), (4, 3, 112)])
def test_update_channels_equals_float64_moments(shape):
    """Moments.update_channels (float32 pairwise sums, float64 merge) equals the float64
    moments of the channels to float32 rounding, whatever the batch split, with a large
    common offset; float64 input takes the exact update_axis."""
    rng = np.random.default_rng(3)
    x = (rng.normal(size=shape) * rng.uniform(0.1, 3, size=(1, shape[1]) + (1,) * (
        len(shape) - 2)) + 40).astype(np.float32)
    a = Moments(shape[1], full=False)
    for part in np.split(np.arange(shape[0]), [1, 3]):
        a.update_channels(np.ascontiguousarray(x[part]))
    ref = np.moveaxis(x, 1, -1).reshape(-1, shape[1]).astype(np.float64)
    assert a.n == ref.shape[0]
    sd = ref.std(axis=0, ddof=1)
    assert np.abs(a.mean - ref.mean(axis=0)).max() <= 1e-6 * sd.min()
    np.testing.assert_allclose(a.var(), ref.var(axis=0, ddof=1), rtol=2e-6)
    b = Moments(shape[1], full=False).update_channels(x.astype(np.float64))
    c = Moments(shape[1], full=False).update_axis(x.astype(np.float64), 1)
    np.testing.assert_array_equal(b.var(), c.var())
