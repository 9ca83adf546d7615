"""Higher-order structure (docs/METHODS.md §B4) and the information gradients.

Oracles: triplet information from correlations against the Gaussian formula of an explicit
4×4 covariance (and Gaussian entropies); R²_1 / R²_k and triplet synergy against brute
force; the closed-form gradients of Σ I_X and Σ I(T;Y) against central differences of the
same totals; the totals against the §B2–B3 channel scores; the input-moment pass against
the channels pass of the same layers.
"""

from __future__ import annotations

import itertools
import math

import corpus
import numpy as np
import pytest

from onnxdiag.channels.gradients import cosine, input_capture_total, task_info_total
from onnxdiag.channels.higher import (
    depth_trends,
    gaussian_triplet_information,
    higher_order_layer,
    triplet_task_information,
)
from onnxdiag.channels.scores import correlation_matrix, pair_task_information, score_layer
from onnxdiag.data.request import DataRequest
from onnxdiag.graph import analyze_structure
from onnxdiag.model.io import get_input_specs, load_model


def _spd(n, seed=0, scale=None):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n + 3))
    cov = a @ a.T / (n + 3)
    if scale is not None:
        s = np.asarray(scale)
        cov = cov * np.outer(s, s)
    return cov


def _entropy(cov):
    cov = np.atleast_2d(cov)
    return 0.5 * math.log((2 * math.pi * math.e) ** cov.shape[0] * np.linalg.det(cov))


def test_triplet_information_equals_the_gaussian_formula_of_a_4x4_covariance():
    cov = _spd(4, seed=1, scale=[3.0, 0.5, 2.0, 7.0])  # ordered T, Y_i, Y_j, Y_k
    by_formula = gaussian_triplet_information(cov)
    by_entropy = _entropy(cov[0, 0]) + _entropy(cov[1:, 1:]) - _entropy(cov)
    assert by_formula == pytest.approx(by_entropy, rel=1e-12)
    r = correlation_matrix(cov)
    rho_t, pairs = r[0, 1:], [r[1, 2], r[1, 3], r[2, 3]]
    assert triplet_task_information(rho_t, pairs, ridge=0.0) == pytest.approx(by_formula,
                                                                              rel=1e-12)
    assert triplet_task_information(rho_t, pairs) == pytest.approx(by_formula, rel=1e-8)
    pair = pair_task_information(r[0, 1], r[0, 2], r[1, 2], ridge=0.0)
    assert by_formula >= pair  # more variables never carry less information


def test_single_and_multi_peer_r2_against_brute_force():
    cov = _spd(7, seed=2)
    h = higher_order_layer(cov, k_peers=3, ridge=0.0)
    corr = correlation_matrix(cov)
    for i in range(7):
        others = [j for j in range(7) if j != i]
        best = max(others, key=lambda j: abs(corr[i, j]))
        assert h.channels["r2_single"][i] == pytest.approx(corr[i, best] ** 2, rel=1e-9)
        peers = sorted(others, key=lambda j: -abs(corr[i, j]))[:3]
        g = np.linalg.solve(corr[np.ix_(peers, peers)], corr[peers, i])
        assert h.channels["r2_multi"][i] == pytest.approx(g @ corr[peers, i], rel=1e-9)
    scored = score_layer(cov, k_peers=3, ridge=1e-3)
    np.testing.assert_allclose(higher_order_layer(cov, k_peers=3).channels["r2_multi"],
                               scored.scores["peer_r2"], rtol=1e-12)


def test_triplet_synergy_against_brute_force():
    full = _spd(7, seed=3)  # T first, then 6 channels
    cov, cov_yt, var_t = full[1:, 1:], full[1:, 0], full[0, 0]
    h = higher_order_layer(cov, cov, cov_yt, var_t, triplet_partners=4, triplet_top=3)
    corr = correlation_matrix(cov)

    def info(idx):
        sub = full[np.ix_([0, *[1 + i for i in idx]], [0, *[1 + i for i in idx]])]
        return _entropy(sub[0, 0]) + _entropy(sub[1:, 1:]) - _entropy(sub)

    for i in range(6):
        partners = sorted((j for j in range(6) if j != i), key=lambda j: -abs(corr[i, j]))[:4]
        syn = sorted((info([i, j, k]) - max(info([i, j]), info([i, k]), info([j, k]))
                      for j, k in itertools.combinations(partners, 2)), reverse=True)
        assert h.channels["triplet_synergy"][i] == pytest.approx(np.mean(syn[:3]), abs=1e-7)
    assert set(h.summary) >= {"single_share", "triplet_synergy", "triplet_excess"}


def test_depth_trends():
    rows = [{"single_share": 0.9 - 0.1 * d, "triplet_synergy": d ** 2} for d in range(5)]
    trends = depth_trends(rows, keys=("single_share", "triplet_synergy"))
    assert trends == {"single_share": pytest.approx(-1.0), "triplet_synergy": pytest.approx(1.0)}
    assert depth_trends(rows[:2], keys=("single_share",)) == {"single_share": None}


def _layer_problem(seed=0, n_out=6, n_in=5):
    rng = np.random.default_rng(seed)
    full = _spd(n_in + 1, seed=seed)
    return rng.standard_normal((n_out, n_in)), full[:n_in, :n_in], full[:n_in, n_in], \
        full[n_in, n_in]


def _central(f, W, h=1e-6):
    grad = np.zeros_like(W)
    for idx in np.ndindex(W.shape):
        e = np.zeros_like(W)
        e[idx] = h
        grad[idx] = (f(W + e) - f(W - e)) / (2 * h)
    return grad


@pytest.mark.parametrize("n_out", [6, 7])  # even and odd channel counts (the median)
def test_information_gradients_equal_central_differences(n_out):
    W, cov_x, cov_xt, var_t = _layer_problem(n_out=n_out)
    fx, gx = input_capture_total(W, cov_x)
    np.testing.assert_allclose(gx, _central(lambda w: input_capture_total(w, cov_x)[0], W),
                               rtol=1e-6, atol=1e-8)
    ft, gt = task_info_total(W, cov_x, cov_xt, var_t)
    np.testing.assert_allclose(
        gt, _central(lambda w: task_info_total(w, cov_x, cov_xt, var_t)[0], W),
        rtol=1e-6, atol=1e-8)
    scores = score_layer(W @ cov_x @ W.T, W @ cov_xt, var_t)
    assert fx == pytest.approx(scores.scores["input_capture"].sum(), rel=1e-12)
    assert ft == pytest.approx(scores.scores["task_info"].sum(), rel=1e-12)
    # task information does not change when one channel is rescaled: the gradient is
    # orthogonal to every row of W
    np.testing.assert_allclose(np.einsum("ij,ij->i", gt, W), 0.0, atol=1e-10)
    assert cosine(gt, gt) == pytest.approx(1.0) and cosine(gt, 0 * gt) is None


def test_input_moments_match_the_channels_pass(tmp_path):
    """Cov y = W Σ_X Wᵀ from the input pass equals the channels pass's output covariance
    of the same convs at the same sampled positions."""
    from onnxdiag.channels.collect import collect_channel_moments
    from onnxdiag.channels.inputs import collect_input_moments, find_input_layers

    model = load_model(corpus.residual_block())
    structure = analyze_structure(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 3, 8, 8)).astype(np.float32)
    source = DataRequest({"x": x, "labels": np.arange(20) % 5}, batch_size=7).open(
        get_input_specs(model))
    layers = find_input_layers(model, structure, ["c1", "c3", "proj"])
    moments = collect_input_moments(model, structure, source, layers, targets="labels",
                                    n_positions=5, seed=3)
    stats = collect_channel_moments(model, structure, source, layers=("c1", "c3", "proj"),
                                    n_positions=5, seed=3, targets="labels", tap="output")
    for name, m in moments.items():
        cov_yy, cov_yt, var_t = m.output_moments()
        ref_yy, ref_yt, ref_t = stats.layers[name].target_moments()
        np.testing.assert_allclose(cov_yy, ref_yy, rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(cov_yt, ref_yt, rtol=2e-4, atol=1e-6)
        assert var_t == pytest.approx(ref_t, rel=1e-5) and m.n_images == 20
