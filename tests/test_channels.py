"""METHODS §B2-B5 channel scores: oracles on Gaussians with a known covariance, invariances,
k-means, ARI, the permutation floor and the damage test."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from onnxdiag.channels.clustering import (
    adjusted_rand_index,
    axis_alignment,
    cluster_axes,
    damage_test,
    fit_kmeans,
    summarize_layers,
)
from onnxdiag.channels.scores import (
    ChannelScores,
    pair_task_information,
    peer_regression,
    permutation_floor,
    score_layer,
    score_moments,
)
from onnxdiag.errors import DataError
from onnxdiag.stats import JointMoments

C = 16


def random_gaussian(seed: int = 0, n_channels: int = C):
    """Known (Σ_y, cov(y,T), Var T) with T = aᵀy + noise and unequal channel scales."""
    rng = np.random.default_rng(seed)
    a_mat = rng.normal(size=(n_channels, n_channels + 4))
    scale = rng.uniform(0.3, 4.0, size=n_channels)
    sigma = scale[:, None] * (a_mat @ a_mat.T / (n_channels + 4) + 0.3 * np.eye(n_channels))
    sigma = sigma * scale[None, :]
    a = rng.normal(size=n_channels) / scale
    cov_yt = sigma @ a
    var_t = float(a @ sigma @ a + 2.0)
    return sigma, cov_yt, var_t


def corr_of(sigma):
    s = np.sqrt(np.diag(sigma))
    return sigma / np.outer(s, s)


def brute_ranking(sigma, i):
    """j != i by |rho_ij| descending, ties by index: the oracle peer/partner order."""
    rho = corr_of(sigma)
    others = [j for j in range(len(sigma)) if j != i]
    return sorted(others, key=lambda j: (-abs(rho[i, j]), j))


@pytest.mark.parametrize("ties", ["none", "rounded", "dead", "halves"])
def test_rank_peers_is_the_stable_order_of_every_row(ties):
    """The selection route (n peers picked, then sorted) gives each row's j != i by |rho|
    descending, ties by the lower index, as sorting every row: on random correlations and
    on tie-heavy ones (rounded values, dead channels uncorrelated with all, values in
    {0, ±0.5, ±1}), for every n including 0 and more than C − 1."""
    from onnxdiag.channels.scores import rank_peers

    rng = np.random.default_rng(["none", "rounded", "dead", "halves"].index(ties))
    for _ in range(40):
        c = int(rng.integers(2, 60))
        a = rng.standard_normal((c, c))
        corr = (a + a.T) / 4
        if ties == "rounded":
            corr = np.round(corr, 1)
        elif ties == "dead":
            dead = rng.random(c) < 0.3
            corr[dead], corr[:, dead] = 0.0, 0.0
        elif ties == "halves":
            h = rng.integers(-2, 3, (c, c)) / 2.0
            corr = np.triu(h) + np.triu(h, 1).T
        np.fill_diagonal(corr, 1.0)
        for n in {0, 1, 2, 3, c // 5, c // 4, c - 1, c + 1}:
            got = rank_peers(corr, n)
            oracle = [[j for j in sorted((j for j in range(c) if j != i),
                                         key=lambda j: (-abs(corr[i, j]), j))][:n]
                      for i in range(c)]
            assert got.dtype == np.int64 or got.dtype == np.intp
            assert got.shape == (c, min(n, c - 1)) and got.tolist() == oracle, (c, n)


def mi_single(sigma, cov_yt, var_t, i):
    """Gaussian I(T;Y_i) = 1/2 ln(Var T / Var(T | Y_i))."""
    return 0.5 * math.log(var_t / (var_t - cov_yt[i] ** 2 / sigma[i, i]))


def mi_pair(sigma, cov_yt, var_t, i, j):
    """Gaussian I(T;Y_i,Y_j) through the Schur complement (not the determinant form)."""
    p = [i, j]
    c = cov_yt[p]
    return 0.5 * math.log(var_t / (var_t - c @ np.linalg.solve(sigma[np.ix_(p, p)], c)))


def exact_samples(sigma, n, seed=0):
    """(n, C) samples whose ddof=1 sample covariance is exactly sigma (whitened, recoloured)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, len(sigma)))
    z -= z.mean(axis=0)
    z = z @ np.linalg.inv(np.linalg.cholesky(np.cov(z, rowvar=False)).T)
    return z @ np.linalg.cholesky(sigma).T


# ---------------------------------------------------------------- oracles, target axis (B3)

def test_task_information_matches_gaussian_mi():
    sigma, cov_yt, var_t = random_gaussian()
    scores = score_layer(sigma, cov_yt, var_t)
    expected = [mi_single(sigma, cov_yt, var_t, i) for i in range(C)]
    np.testing.assert_allclose(scores.scores["task_info"], expected, rtol=1e-10)


def test_pair_information_matches_schur_complement():
    sigma, cov_yt, var_t = random_gaussian(1)
    rho = corr_of(sigma)
    rho_t = cov_yt / np.sqrt(np.diag(sigma) * var_t)
    for i, j in [(0, 1), (2, 7), (5, 15), (9, 3)]:
        got = pair_task_information(rho_t[i], rho_t[j], rho[i, j])
        assert got == pytest.approx(mi_pair(sigma, cov_yt, var_t, i, j), rel=1e-8)
    assert pair_task_information(0.9, 0.9, -0.9) == 0.0  # not PSD: det <= 0 gives 0


@pytest.mark.parametrize("partners,top", [(50, 10), (6, 3)])
def test_synergy_and_redundancy_against_brute_force(partners, top):
    sigma, cov_yt, var_t = random_gaussian(2)
    scores = score_layer(sigma, cov_yt, var_t, syn_partners=partners, syn_top=top)
    info = [mi_single(sigma, cov_yt, var_t, i) for i in range(C)]
    for i in range(C):
        mates = brute_ranking(sigma, i)[:partners]
        syn = [mi_pair(sigma, cov_yt, var_t, i, j) - max(info[i], info[j]) for j in mates]
        red = [min(info[i], info[j]) for j in mates]
        assert scores.scores["synergy"][i] == pytest.approx(
            np.mean(sorted(syn, reverse=True)[:top]), rel=1e-7, abs=1e-12)
        assert scores.scores["redundancy"][i] == pytest.approx(np.mean(red), rel=1e-10)


# ---------------------------------------------------------------- oracles, local axis (B2)

def test_peer_overlap_closed_form():
    sigma, _, _ = random_gaussian(3)
    rho = corr_of(sigma)
    expected = [sum(-0.5 * math.log(1 - rho[i, j] ** 2) for j in range(C) if j != i) / C
                for i in range(C)]
    np.testing.assert_allclose(score_layer(sigma).scores["peer_overlap"], expected, rtol=1e-10)


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
def test_equicorrelated_closed_forms(ridge):
    n, r, k = 12, 0.4, 10
    scale = np.linspace(0.5, 3.0, n)
    sigma = np.outer(scale, scale) * ((1 - r) * np.eye(n) + r)
    scores = score_layer(sigma, ridge=ridge).scores
    np.testing.assert_allclose(scores["peer_overlap"], (n - 1) / n * -0.5 * math.log(1 - r * r))
    np.testing.assert_allclose(scores["peer_r2"], k * r * r / (1 - r + ridge + k * r))


def test_peer_r2_against_least_squares_on_data():
    sigma, _, _ = random_gaussian(4)
    n = 200
    x = exact_samples(sigma, n)
    xs = (x - x.mean(axis=0)) / x.std(axis=0, ddof=1)
    for ridge in (0.0, 1e-3):
        scores = score_layer(sigma, ridge=ridge, k_peers=5)
        for i in range(C):
            peers = brute_ranking(sigma, i)[:5]
            assert list(scores.peers[i]) == peers
            design = np.vstack([xs[:, peers], math.sqrt(ridge * (n - 1)) * np.eye(5)])
            target = np.concatenate([xs[:, i], np.zeros(5)])
            gamma = np.linalg.lstsq(design, target, rcond=None)[0]
            rho_ip = xs[:, peers].T @ xs[:, i] / (n - 1)
            assert scores.scores["peer_r2"][i] == pytest.approx(rho_ip @ gamma, rel=1e-9)
            if ridge == 0:  # plain regression: R² = 1 - SS_res / SS_tot
                resid = xs[:, i] - xs[:, peers] @ gamma
                r2 = 1 - resid @ resid / (xs[:, i] @ xs[:, i])
                assert scores.scores["peer_r2"][i] == pytest.approx(r2, rel=1e-9)


def test_signal_power_is_filter_quadratic_form_of_patch_covariance():
    """J_i = Var(y_i) = w_iᵀ Σ_X w_i with Σ_X from explicit im2col patches (METHODS §B2)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 3, 7, 7)) + rng.normal(size=(1, 3, 1, 1))
    w = rng.normal(size=(5, 3, 3, 3))
    bias = rng.normal(size=5)
    out = np.zeros((4, 5, 5, 5)) + bias[None, :, None, None]
    for kh in range(3):  # direct convolution, stride 1, padding 0
        for kw in range(3):
            out += np.einsum("oc,nchw->nohw", w[:, :, kh, kw], x[:, :, kh:kh + 5, kw:kw + 5])
    patches = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))
    patches = patches.transpose(0, 2, 3, 1, 4, 5).reshape(-1, 27)
    sigma_x = np.cov(patches, rowvar=False)
    y = out.transpose(0, 2, 3, 1).reshape(-1, 5)
    np.testing.assert_allclose(y, patches @ w.reshape(5, -1).T + bias, atol=1e-12)
    scores = score_layer(np.cov(y, rowvar=False), weight=w).scores
    quad = np.einsum("ci,ij,cj->c", w.reshape(5, -1), sigma_x, w.reshape(5, -1))
    np.testing.assert_allclose(scores["signal_power"], quad, rtol=1e-10)
    norms = (w.reshape(5, -1) ** 2).sum(axis=1)
    np.testing.assert_allclose(scores["rayleigh_quotient"], quad / (norms + 1e-10), rtol=1e-10)


def test_input_capture_uses_median_power():
    sigma, _, _ = random_gaussian(6)
    scores = score_layer(sigma)
    power = np.diag(sigma)
    np.testing.assert_allclose(scores.scores["input_capture"],
                               0.5 * np.log(1 + power / np.median(power)))
    assert scores.params["sigma0_sq"] == pytest.approx(np.median(power))


# ---------------------------------------------------------------- invariance

def test_rho_scores_invariant_input_capture_not_under_affine_maps():
    sigma, cov_yt, var_t = random_gaussian(7)
    rng = np.random.default_rng(7)
    a = rng.uniform(0.2, 5.0, size=C) * np.where(np.arange(C) % 3 == 0, -1, 1)
    b = rng.normal(size=C) * 10
    mean = rng.normal(size=C)
    base = score_layer(sigma, cov_yt, var_t, mean_y=mean)
    moved = score_layer(np.outer(a, a) * sigma, a * cov_yt, var_t, mean_y=a * mean + b)
    for name in ("peer_overlap", "peer_r2", "task_info", "synergy", "redundancy"):
        np.testing.assert_allclose(moved.scores[name], base.scores[name], rtol=1e-9,
                                   atol=1e-13, err_msg=name)
    np.testing.assert_array_equal(moved.peers, base.peers)
    np.testing.assert_allclose(moved.scores["task_corr"], np.sign(a) * base.scores["task_corr"])
    assert np.abs(moved.scores["input_capture"] - base.scores["input_capture"]).max() > 0.1
    np.testing.assert_allclose(moved.peer_beta, base.peer_beta * a[:, None] / a[base.peers])


# ---------------------------------------------------------------- substitution (B5)

def test_exact_duplicate_is_reconstructed_by_its_peers():
    rng = np.random.default_rng(8)
    y = rng.normal(size=(500, 6)) @ rng.normal(size=(6, 6)) + rng.normal(size=6)
    y = np.column_stack([y, 2.0 * y[:, 0] + 3.0])
    cov, mean = np.cov(y, rowvar=False), y.mean(axis=0)
    scores = score_layer(cov, mean_y=mean)
    assert scores.scores["peer_r2"][6] > 0.99 and scores.scores["peer_r2"][0] > 0.99
    peers, beta, intercept = peer_regression(cov, mean, 6, k=3, ridge=0.0)
    assert peers[0] == 0
    np.testing.assert_allclose(beta, [2.0, 0.0, 0.0], atol=1e-9)
    assert intercept == pytest.approx(3.0, abs=1e-8)
    np.testing.assert_allclose(intercept + y[:, peers] @ beta, y[:, 6], atol=1e-8)
    peers, beta, intercept = peer_regression(cov, mean, 6)  # default ridge 1e-3: close
    recon = intercept + y[:, peers] @ beta
    assert np.sqrt(np.mean((recon - y[:, 6]) ** 2)) < 0.01 * y[:, 6].std()
    np.testing.assert_array_equal(scores.peers[6], peers)
    np.testing.assert_allclose(scores.peer_beta[6], beta)
    assert scores.peer_intercept[6] == pytest.approx(intercept)


# ---------------------------------------------------------------- record, moments, errors

def test_record_serialises_and_tabulates():
    sigma, cov_yt, var_t = random_gaussian(9)
    scores = score_layer(sigma, cov_yt, var_t, layer="conv1", weight=np.ones((C, 2)),
                         n_images=100)
    data = json.loads(json.dumps(scores.to_dict()))
    assert data["layer"] == "conv1" and data["n_channels"] == C
    assert data["params"]["task_info_floor_analytic"] == pytest.approx(0.005)
    assert set(data["scores"]) == {"signal_power", "rayleigh_quotient", "input_capture",
                                   "peer_overlap", "peer_r2", "task_corr", "task_info",
                                   "synergy", "redundancy"}
    assert data["peer_intercept"] is None and np.shape(data["peers"]) == (C, 10)
    rows = scores.to_rows()
    assert len(rows) == C and rows[3]["channel"] == 3 and rows[3]["layer"] == "conv1"
    assert rows[3]["task_info"] == pytest.approx(scores.scores["task_info"][3])


def test_score_moments_from_streamed_joint_moments():
    rng = np.random.default_rng(10)
    y = rng.normal(size=(300, 5)) @ rng.normal(size=(5, 5))
    t = y @ rng.normal(size=5) + rng.normal(size=300)
    moments = JointMoments(5)
    for part_y, part_t in zip(np.array_split(y, 3), np.array_split(t, 3)):
        moments.update(part_y, part_t)
    full = np.cov(np.column_stack([y, t]), rowvar=False)
    got = score_moments(moments, layer="L")
    want = score_layer(full[:5, :5], full[:5, 5], full[5, 5], mean_y=y.mean(axis=0))
    for name, value in want.scores.items():
        np.testing.assert_allclose(got.scores[name], value, rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(got.peer_intercept, want.peer_intercept, rtol=1e-9)


def test_errors_and_dead_channel():
    sigma, cov_yt, _ = random_gaussian(11)
    with pytest.raises(ValueError):
        score_layer(sigma, cov_yt, None)
    with pytest.raises(ValueError):
        score_layer(np.ones((1, 1)))
    with pytest.raises(DataError, match="constant"):
        score_layer(sigma, cov_yt * 0, 0.0)
    sigma = sigma.copy()
    sigma[4, :] = sigma[:, 4] = 0.0  # a dead channel: uncorrelated, finite scores
    scores = score_layer(sigma, np.where(np.arange(C) == 4, 0.0, cov_yt), 5.0)
    assert all(np.isfinite(v).all() for v in scores.scores.values())
    assert scores.scores["peer_r2"][4] == 0 and scores.scores["task_info"][4] == 0


# ---------------------------------------------------------------- permutation floor (B3)

def test_permutation_floor_on_independent_target():
    rng = np.random.default_rng(12)
    n, n_channels = 4000, 200
    y = rng.normal(size=(n, n_channels))
    t = y[:, :5] @ np.ones(5) + rng.normal(size=n)
    t_null = rng.permutation(t)
    cov = np.cov(np.column_stack([y, t, t_null]), rowvar=False)
    cov_yy = cov[:n_channels, :n_channels]
    floor = permutation_floor(cov_yy, cov[:n_channels, -1], cov[-1, -1], n_images=n)
    assert floor.analytic_mean == pytest.approx(1 / (2 * n))
    assert 0.7 < floor.null_task_info.mean() / floor.analytic_mean < 1.3
    assert 0.6 < floor.floor / floor.analytic_floor < 1.6
    real = score_layer(cov_yy, cov[:n_channels, -2], cov[-2, -2]).scores["task_info"]
    assert floor.count_above(real[:5]) == 5 == floor.count_above(real[:5], analytic=True)
    assert floor.count_above(floor.null_task_info) == pytest.approx(0.05 * n_channels, abs=1)
    json.dumps(floor.to_dict())


def _exact_null_information(n: int):
    """The exact law of I = -1/2 ln(1 - r²) for the sample correlation r of n independent
    Gaussian pairs: r² ~ Beta(1/2, (n - 2)/2) (not the large-n chi² the code uses)."""
    from scipy import special, stats

    beta = stats.beta(0.5, (n - 2) / 2)
    mean = 0.5 * (special.digamma((n - 1) / 2) - special.digamma((n - 2) / 2))
    return beta, mean, lambda q: -0.5 * np.log1p(-beta.ppf(q))


@pytest.mark.parametrize("quantile", [0.9, 0.95, 0.99])
def test_analytic_floor_is_the_exact_null_quantile(quantile):
    """The analytic floor and mean against the exact finite-n law (1 % at n = 4000, where
    the large-n chi²_1 law is within 0.1 %): chi² with 2 degrees of freedom would be 56 %
    off at the 95 % quantile, 1/n instead of 1/(2n) 100 %."""
    n = 4000
    _, mean, ppf = _exact_null_information(n)
    floor = permutation_floor(np.eye(3), np.zeros(3), 1.0, n_images=n, quantile=quantile)
    assert floor.analytic_floor == pytest.approx(ppf(quantile), rel=1e-2)
    assert floor.analytic_mean == pytest.approx(mean, rel=1e-2)
    assert floor.quantile == quantile


def test_null_task_information_follows_the_exact_law():
    """20 000 null channels (10 shuffles of 2 000 independent channels, n = 400 images):
    the values permutation_floor computes follow the exact Beta law (Kolmogorov-Smirnov),
    and their 95 % quantile matches the analytic floor to 6 % (4 standard errors of a
    sample quantile of 20 000; chi²_2 would be 56 % off)."""
    from scipy import stats

    rng = np.random.default_rng(21)
    n, block = 400, 2000
    beta, _, ppf = _exact_null_information(n)
    null, floors = [], []
    for _ in range(10):
        y = rng.normal(size=(n, block)) * rng.uniform(0.5, 3.0, size=block)
        t = rng.permutation(rng.normal(size=n) * 2.0 + 1.0)
        yc, tc = y - y.mean(axis=0), t - t.mean()
        var_y, cov_yt, var_t = (yc ** 2).sum(0) / (n - 1), yc.T @ tc / (n - 1), tc @ tc / (n - 1)
        floor = permutation_floor(np.diag(var_y), cov_yt, var_t, n_images=n)
        null.append(floor.null_task_info)
        floors.append(floor.analytic_floor)
    null = np.concatenate(null)
    assert stats.kstest(-np.expm1(-2 * null), beta.cdf).pvalue > 1e-3
    assert np.quantile(null, 0.95) == pytest.approx(floors[0], rel=0.06)
    assert floors[0] == pytest.approx(ppf(0.95), rel=1e-2)


# ---------------------------------------------------------------- k-means and ARI (B4)

def test_kmeans_recovers_separated_clusters_deterministically():
    rng = np.random.default_rng(13)
    centers = np.array([[0, 0], [10, 0], [0, 10], [10, 10]], dtype=float)
    truth = np.repeat(np.arange(4), 40)
    x = centers[truth] + rng.normal(scale=0.5, size=(160, 2))
    order = rng.permutation(160)
    result = fit_kmeans(x[order], 4, seed=3)
    assert adjusted_rand_index(result.labels, truth[order]) == 1.0
    assert result.labels[0] == 0
    np.testing.assert_array_equal(fit_kmeans(x[order], 4, seed=3).labels, result.labels)
    with pytest.raises(DataError):
        fit_kmeans(x[:3], 4)


def test_adjusted_rand_index_matches_sklearn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(14)
    for n, ka, kb in [(50, 3, 4), (7, 2, 5), (200, 4, 4)]:
        a, b = rng.integers(ka, size=n), rng.integers(kb, size=n)
        assert adjusted_rand_index(a, b) == pytest.approx(metrics.adjusted_rand_score(a, b))
    a = rng.integers(4, size=60)
    assert adjusted_rand_index(a, np.array([7, 3, 9, 1])[a]) == pytest.approx(1.0)
    for a, b in [([0, 0, 0], [1, 1, 1]), ([0, 1, 2], [2, 0, 1]), ([0, 0, 1], [0, 1, 2])]:
        assert adjusted_rand_index(a, b) == pytest.approx(metrics.adjusted_rand_score(a, b))


def make_scores(layer, local, target, n=40):
    """A ChannelScores whose axes are given as (I_X, R̄_X) and (I(T;Y), Syn) columns."""
    scores = {"input_capture": local[0], "peer_overlap": local[1]}
    if target is not None:
        scores.update(task_info=target[0], synergy=target[1])
    return ChannelScores(layer=layer, n_channels=n, scores=scores,
                         peers=np.zeros((n, 0), int), peer_beta=np.zeros((n, 0)),
                         peer_intercept=None)


def test_alignment_clustering_and_summary():
    rng = np.random.default_rng(15)
    u = rng.normal(size=(4, 40))
    same = make_scores("same", (u[0], u[1]), (2 * u[0] + 1, 3 * u[1] - 2))
    indep = make_scores("indep", (u[0], u[1]), (u[2], np.zeros(40)))
    no_target = make_scores("none", (u[0], u[1]), None)
    align = axis_alignment(same)
    assert align["input_capture_vs_task_info"]["spearman"] == pytest.approx(1.0)
    assert align["peer_overlap_vs_synergy"]["spearman"] == pytest.approx(1.0)
    constant = axis_alignment(indep)["peer_overlap_vs_synergy"]
    assert math.isnan(constant["spearman"]) and "constant" in constant["reason"]
    local, target, ari = cluster_axes(same)
    assert local.shape == (40,) and ari == pytest.approx(1.0)
    with pytest.raises(DataError, match="target"):
        cluster_axes(no_target)
    summary = summarize_layers([same, indep, no_target])
    assert summary["n_layers"] == 3 and summary["layers"][2]["reason"] == "no target axis"
    assert summary["n_used"] == {"input_capture_vs_task_info": 2,
                                 "peer_overlap_vs_synergy": 1, "ari": 2}
    expected = np.median([1.0, summary["layers"][1]["input_capture_vs_task_info"]])
    assert summary["median"]["input_capture_vs_task_info"] == pytest.approx(expected)
    json.dumps(summary)


# ---------------------------------------------------------------- damage test (B5)

def test_damage_test_finds_peer_support_only():
    rng = np.random.default_rng(16)
    n = 400
    task, r2, i_x = rng.uniform(size=n), rng.uniform(size=n), rng.uniform(size=n)
    damage = 1.0 - r2 + 0.05 * rng.normal(size=n)
    result = damage_test(damage, task, r2, i_x, n_bins=4)
    assert result["n"] == n and [b["n"] for b in result["bins"]] == [100] * 4
    for row in result["bins"]:
        assert row["spearman"]["peer_r2"]["spearman"] < -0.9
        assert abs(row["spearman"]["task_info"]["spearman"]) < 0.3
        assert abs(row["spearman"]["input_capture"]["spearman"]) < 0.3
    assert result["pooled"]["peer_r2"]["spearman"] < -0.9
    gains = {k: result["explained_variance"][k]["gain"] for k in ("peer_r2", "task_info",
                                                                 "input_capture")}
    assert gains["peer_r2"] > 0.8 and gains["task_info"] < 0.05 and gains["input_capture"] < 0.05
    json.dumps(result)


def test_damage_test_ties_share_the_lowest_bin():
    rng = np.random.default_rng(17)
    task = np.where(np.arange(40) < 25, 0.0, rng.uniform(size=40))
    result = damage_test(rng.normal(size=40), task, rng.uniform(size=40), rng.uniform(size=40))
    assert [b["n"] for b in result["bins"]] == [25, 0, 5, 10]
    assert result["bins"][1]["spearman"]["peer_r2"]["reason"] == "fewer than 3 finite pairs"
    assert math.isfinite(result["explained_variance"]["peer_r2"]["gain"])
