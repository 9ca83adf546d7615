"""Oracle tests for onnxdiag.readouts (METHODS §A1, A2): closed forms vs brute force."""

import json
import math

import numpy as np
import pytest

from onnxdiag.errors import DataError, HeadNotFoundError, OnnxDiagError
from onnxdiag.selection.readouts import (
    HEAD_GRAD_NAMES,
    READOUTS,
    TARGETS,
    DegenerateRule,
    ReadoutAccumulator,
    compute_readouts,
    get_readout,
    head_gradient,
    head_gradient_matrices,
    log_softmax,
    softmax,
    use_gram,
    verify_head,
)


def make_problem(seed=0, n=40, C=5, D=7, scale=1.0):
    rng = np.random.default_rng(seed)
    Z = rng.normal(size=(n, D)) + 0.5
    W = scale * rng.normal(size=(C, D))
    b = rng.normal(size=C)
    return Z, W, b, Z @ W.T + b, rng.integers(0, C, size=n)


def ce_loss(Z, W, b, y):
    """Mean cross-entropy with features held constant (float64)."""
    logp = log_softmax(Z @ W.T + b)
    return -logp[np.arange(len(y)), y].mean()


# --- A1: head gradient --------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["labels", "pseudo"])
@pytest.mark.parametrize("include_bias", [False, True])
def test_head_grad_matches_torch_autograd(targets, include_bias):
    torch = pytest.importorskip("torch")
    Z, W, b, U, y = make_problem(1)
    y_t = y if targets == "labels" else U.argmax(axis=1)
    Wt = torch.tensor(W, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    logits = torch.tensor(Z).detach() @ Wt.T + bt
    torch.nn.functional.cross_entropy(logits, torch.tensor(y_t)).backward()
    ref = Wt.grad.square().sum() + (bt.grad.square().sum() if include_bias else 0.0)
    got = head_gradient(Z, U, W, targets, labels=y, include_bias=include_bias)
    assert got["head_grad"] == pytest.approx(math.sqrt(float(ref)), rel=1e-10)


@pytest.mark.parametrize("targets", ["labels", "pseudo"])
def test_head_grad_matrices_match_central_differences(targets):
    Z, W, b, U, y = make_problem(2, n=12, C=4, D=5)
    y_t = y if targets == "labels" else U.argmax(axis=1)  # pseudo targets are held fixed
    G_W, G_b = head_gradient_matrices(Z, U, targets, labels=y)
    h = 1e-6
    fd_W = np.zeros_like(W)
    for k, d in np.ndindex(*W.shape):
        step = np.zeros_like(W)
        step[k, d] = h
        fd_W[k, d] = (ce_loss(Z, W + step, b, y_t) - ce_loss(Z, W - step, b, y_t)) / (2 * h)
    fd_b = np.array([(ce_loss(Z, W, b + h * e, y_t) - ce_loss(Z, W, b - h * e, y_t)) / (2 * h)
                     for e in np.eye(len(b))])
    assert np.linalg.norm(G_W - fd_W) / np.linalg.norm(fd_W) <= 1e-6
    assert np.linalg.norm(G_b - fd_b) / np.linalg.norm(fd_b) <= 1e-6
    norm = head_gradient(Z, U, W, targets, labels=y)["head_grad"]
    assert abs(norm - np.linalg.norm(fd_W)) / np.linalg.norm(fd_W) <= 1e-6


@pytest.mark.parametrize("targets", TARGETS)
@pytest.mark.parametrize("include_bias", [False, True])
def test_gram_form_equals_direct(targets, include_bias):
    Z, W, b, U, y = make_problem(3, n=9, C=30, D=40)
    kw = dict(labels=y, include_bias=include_bias)
    direct = head_gradient(Z, U, W, targets, gram=False, **kw)
    gram = head_gradient(Z, U, W, targets, gram=True, **kw)
    auto = head_gradient(Z, U, W, targets, **kw)
    for name in HEAD_GRAD_NAMES.values():
        assert gram[name] == pytest.approx(direct[name], rel=1e-12)
        assert auto[name] == pytest.approx(direct[name], rel=1e-12)


def test_gram_rule():
    assert use_gram(256, 1000, 2048)  # ImageNet head, small probe batch
    assert not use_gram(512, 10, 512)  # CIFAR-10 head
    assert not use_gram(100, 100, 100)


def test_normalised_forms():
    Z, W, b, U, y = make_problem(4)
    g = head_gradient(Z, U, W, "labels", labels=y)
    rms = math.sqrt(np.mean(np.sum(Z**2, axis=1)))
    assert g["head_grad_feature"] == pytest.approx(g["head_grad"] / rms, rel=1e-12)
    assert g["head_grad_head"] == pytest.approx(g["head_grad"] / np.linalg.norm(W), rel=1e-12)
    g2 = head_gradient(np.vstack([Z, Z]), np.vstack([U, U]), W, "labels", labels=np.r_[y, y])
    assert g2["head_grad_feature"] == pytest.approx(g["head_grad_feature"], rel=1e-12)


@pytest.mark.parametrize("include_bias", [False, True])
def test_expected_matches_monte_carlo(include_bias):
    Z, W, b, U, _ = make_problem(5, n=30, C=4, D=6, scale=0.4)
    P = softmax(U)
    rng = np.random.default_rng(123)
    n_draws = 4000
    cum = P.cumsum(axis=1)
    draws = (rng.random((n_draws, len(Z), 1)) > cum[None]).sum(axis=2)  # y ~ P_i
    onehot = np.eye(P.shape[1])[draws]  # (n_draws, n, C)
    sq = np.sum((P[None] - onehot) ** 2, axis=2) * (np.sum(Z**2, axis=1) + include_bias)
    per_draw = sq.mean(axis=1)  # mean_i |g_i|^2 for one joint draw
    est, se = per_draw.mean(), per_draw.std(ddof=1) / math.sqrt(n_draws)
    got = head_gradient(Z, U, W, "expected", include_bias=include_bias)["head_grad"]
    assert abs(got**2 - est) < 5 * se
    assert se / est < 0.02  # the check has teeth


def test_expected_squared_is_curvature():
    Z, W, b, U, _ = make_problem(6)
    r = compute_readouts(Z, U, W, b, targets="expected")
    assert r.values["head_grad"] ** 2 == pytest.approx(r.values["curvature"], rel=1e-12)


# --- A2: every readout vs a brute-force loop ---------------------------------------------


def brute_force(Z, U, W, y):
    n, C = U.shape
    out = dict.fromkeys(["loss", "confidence", "entropy", "prob_margin", "logit_margin",
                         "curvature"], 0.0)
    G = np.zeros_like(W)
    for i in range(n):
        m = max(U[i])
        ex = [math.exp(u - m) for u in U[i]]
        p = [e / sum(ex) for e in ex]
        srt = sorted(p, reverse=True)
        out["loss"] += -math.log(p[y[i]]) / n
        out["confidence"] += srt[0] / n
        out["entropy"] += -sum(q * math.log(q) for q in p if q > 0) / n
        out["prob_margin"] += (srt[0] - srt[1]) / n
        out["logit_margin"] += (U[i, y[i]] - max(U[i, k] for k in range(C) if k != y[i])) / n
        out["curvature"] += sum(z * z for z in Z[i]) * sum(q * (1 - q) for q in p) / n
        for k in range(C):
            for d in range(Z.shape[1]):
                G[k, d] += (p[k] - (k == y[i])) * Z[i, d] / n
    out["head_grad"] = math.sqrt(float(np.sum(G**2)))
    out["weight_norm"] = math.sqrt(sum(w * w for w in W.ravel()))
    return out


def test_every_readout_matches_brute_force():
    Z, W, b, U, y = make_problem(7, n=25, C=6, D=4, scale=2.0)
    got = compute_readouts(Z, U, W, b, targets="labels", labels=y, n_params=W.size + b.size)
    ref = brute_force(Z, U, W, y)
    for name, value in ref.items():
        assert got.values[name] == pytest.approx(value, rel=1e-10, abs=1e-13), name
    assert got.values["n_params"] == W.size + b.size
    assert set(got.values) <= set(READOUTS)


def test_labels_absent_drops_label_readouts():
    Z, W, b, U, _ = make_problem(8)
    r = compute_readouts(Z, U, W, b, targets="pseudo")
    assert "loss" not in r.values and "logit_margin" not in r.values
    assert "label_modal_fraction" not in r.diagnostics
    json.dumps(r.to_dict())


def test_softmax_is_stable_for_huge_logits():
    U = np.array([[1000.0, 0.0, -1000.0], [5e4, 5e4, 0.0]])
    assert np.isfinite(log_softmax(U)).all()
    assert np.allclose(softmax(U).sum(axis=1), 1.0)
    r = compute_readouts(np.ones((2, 3)), U, np.eye(3), targets="pseudo")
    assert all(math.isfinite(v) for v in r.values.values())


def test_direction_table():
    lower = {"head_grad", "head_grad_feature", "head_grad_head", "loss", "entropy", "curvature"}
    higher = {"confidence", "prob_margin", "logit_margin"}
    for name, spec in READOUTS.items():
        want = "lower" if name in lower else "higher" if name in higher else "context"
        assert spec.direction == want, name
        assert spec.needs_labels == (name in {"loss", "logit_margin"})
    assert get_readout("n_params").direction == "context"
    with pytest.raises(OnnxDiagError, match="known: head_grad"):
        get_readout("accuracy")


# --- streaming -----------------------------------------------------------------------------


@pytest.mark.parametrize("targets", TARGETS)
@pytest.mark.parametrize("include_bias", [False, True])
def test_accumulator_is_exact_for_any_split(targets, include_bias):
    Z, W, b, U, y = make_problem(9, n=37, C=5, D=6)
    one = compute_readouts(Z, U, W, b, targets=targets, labels=y, include_bias=include_bias)
    for cuts in ([1, 2, 30], [18], list(range(1, 37, 4))):
        acc = ReadoutAccumulator(W, b, targets=targets, include_bias=include_bias, n_classes=5)
        for part in np.split(np.arange(37), cuts):
            acc.update(Z[part], U[part], y[part])
        res = acc.result()
        assert res.n_samples == 37 and res.values.keys() == one.values.keys()
        for name, value in one.values.items():
            assert res.values[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
        for name, value in one.diagnostics.items():
            assert res.diagnostics[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    direct = head_gradient(Z, U, W, targets, labels=y, include_bias=include_bias)
    for name, value in direct.items():
        assert one.values[name] == pytest.approx(value, rel=1e-12)


def test_accumulator_flattens_conv_head_shapes():
    Z, W, b, U, y = make_problem(10)
    flat = compute_readouts(Z, U, W, b, targets="labels", labels=y)
    conv = compute_readouts(Z[:, :, None, None], U[:, :, None, None], W, b, targets="labels",
                            labels=y)
    assert conv.values == flat.values


def test_accumulator_user_errors_leave_state_unchanged():
    Z, W, b, U, y = make_problem(11)
    acc = ReadoutAccumulator(W, b, targets="labels")
    with pytest.raises(DataError, match="needs labels"):
        acc.update(Z, U)
    with pytest.raises(DataError, match=r"\[0, 5\)"):
        acc.update(Z, U, y + 5)
    assert acc.n_samples == 0
    acc.update(Z, U, y)
    assert acc.result().values == compute_readouts(Z, U, W, b, targets="labels", labels=y).values
    with pytest.raises(DataError, match="NaN"):
        acc.update(np.full_like(Z, np.nan), U, y)
    acc2 = ReadoutAccumulator(W, targets="pseudo")
    acc2.update(Z, U, y)
    with pytest.raises(DataError, match="every batch or for none"):
        acc2.update(Z, U)
    with pytest.raises(DataError, match="No samples"):
        ReadoutAccumulator(W, targets="pseudo").result()
    with pytest.raises(HeadNotFoundError, match="--head NODE"):
        ReadoutAccumulator(W, targets="pseudo", n_classes=7)
    with pytest.raises(OnnxDiagError, match="Unknown targets"):
        ReadoutAccumulator(W, targets="soft")


# --- head verification ----------------------------------------------------------------------


def test_verify_head():
    Z, W, b, U, _ = make_problem(12)
    assert verify_head(Z, U.astype(np.float32), W, b) < 1e-6
    assert verify_head(Z[:, :, None, None], U, W, b, node_name="fc") == 0.0
    with pytest.raises(HeadNotFoundError, match=r"'fc'.*--head NODE.*--features TENSOR"):
        verify_head(Z, U + 0.1, W, b, node_name="fc")
    with pytest.raises(HeadNotFoundError, match="does not fit"):
        verify_head(Z[:, :3], U, W, b, node_name="fc")


# --- degenerate checkpoints -------------------------------------------------------------------


def test_degenerate_rule_flags_input_independent_features():
    rng = np.random.default_rng(13)
    Z, W, b, U, y = make_problem(13, n=64, C=5, D=8, scale=3.0)
    trained = compute_readouts(Z, U, W, b, targets="labels", labels=y)
    assert not trained.degenerate and trained.degenerate_reasons == ()
    Z0 = 3.0 + 1e-3 * rng.normal(size=Z.shape)  # init trap: features ignore the input
    init = compute_readouts(Z0, Z0 @ W.T + b, W, b, targets="labels", labels=y)
    assert init.degenerate
    assert any(r.startswith("feature_spread") for r in init.degenerate_reasons)
    assert any(r.startswith("modal_fraction") for r in init.degenerate_reasons)
    assert init.diagnostics["feature_spread"] < 1e-5


@pytest.mark.parametrize("offset", [0.0, 2.0, 30.0])
def test_feature_spread_is_the_centred_variance_share_for_any_batch_split(offset):
    """feature_spread against a brute-force centre: the squared distances of the z_i to
    their mean (the per-feature mean of all samples), over the mean |z_i|², streamed in
    uneven batches.  Uncentred (1), centred on one batch's mean or with n - 1 it differs."""
    rng = np.random.default_rng(17)
    Z, W, b, _, _ = make_problem(17, n=50, C=4, D=6)
    Z = Z * rng.uniform(0.2, 3.0, size=6) + offset * rng.normal(size=6)
    centre = Z.sum(axis=0) / len(Z)
    want = np.sum((Z - centre) ** 2) / np.sum(Z ** 2)
    acc = ReadoutAccumulator(W, b, targets="pseudo")
    for part in np.split(np.arange(50), [7, 8, 31]):
        acc.update(Z[part], Z[part] @ W.T + b)
    got = acc.result().diagnostics["feature_spread"]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert abs(got - want * 50 / 49) > 1e-3 * want


def test_degenerate_rule_collapse_and_uniform():
    Z, W, b, U, y = make_problem(14, n=64, C=5, D=8, scale=3.0)
    U_one = U.copy()
    U_one[:, 2] += 1e3  # every prediction is class 2
    collapsed = compute_readouts(Z, U_one, W, b, targets="labels", labels=y)
    assert collapsed.degenerate_reasons == ("modal_fraction 1 >= 0.95",)
    same = compute_readouts(Z, U_one, W, b, targets="labels", labels=np.full(64, 2))
    assert not same.degenerate  # labels are that concentrated too: not a collapse
    few = compute_readouts(Z[:5], U_one[:5], W, b, targets="pseudo")
    assert not few.degenerate  # too few samples to call a collapse without labels
    uniform = compute_readouts(Z, 1e-6 * U, W, b, targets="pseudo")
    assert any(r.startswith("confidence_excess") for r in uniform.degenerate_reasons)
    lax = DegenerateRule(min_confidence_excess=0.0)
    assert not compute_readouts(Z, 1e-6 * U, W, b, targets="pseudo", rule=lax).degenerate
