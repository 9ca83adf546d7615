"""Structured reconstruction repair and the repair-aware channel choice
(docs/METHODS.md §E2, §E3).

Oracles: an exactly duplicated channel removed and reconstructed leaves the outputs as
they were (float32 rounding); nothing removed = the identity; the fit A equals
numpy.linalg.lstsq on the exposed consumer inputs (the ridge as augmented rows); the
greedy elimination's predicted error equals the brute-force reconstruction error of the
set it removes, and its first choice is the brute-force best single removal; head
pruning + reconstruction on a real HF BERT export gives a checked model whose record
shows every reconstructed layer's error drop.
"""

from __future__ import annotations

import exports
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiag.graph import analyze_structure
from onnxdiag.model.expose import expose_tensors
from onnxdiag.model.io import load_model
from onnxdiag.runtime.runner import OrtRunner
from onnxdiag.stats import Moments
from onnxdiag.structured.recon_score import greedy_elimination, recon_scores, wanda_scores
from onnxdiag.structured.reconstruct import (
    channel_rows,
    collect_input_moments,
    consumer_sites,
    fit_reconstruction,
    prune_reconstructed,
    reconstruct_model,
    removed_inputs,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")


def _two_convs(seed=0, duplicate=(7, 2)):
    """x (N,3,8,8) → c1 (3→8, 3×3, pad 1, bias) → Relu → c2 (8→6, 3×3, pad 1, no bias)
    → Relu → GlobalAveragePool → Flatten → fc (Gemm 6→4).  c1's output channel
    ``duplicate[0]`` is an exact copy of channel ``duplicate[1]`` (weights and bias)."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32)
    b1 = rng.normal(0, 0.2, 8).astype(np.float32)
    if duplicate is not None:
        w1[duplicate[0]], b1[duplicate[0]] = w1[duplicate[1]], b1[duplicate[1]]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
             numpy_helper.from_array(rng.normal(0, 0.5, (6, 8, 3, 3)).astype(np.float32),
                                     "w2"),
             numpy_helper.from_array(rng.normal(0, 0.5, (4, 6)).astype(np.float32), "wf"),
             numpy_helper.from_array(np.zeros(4, np.float32), "bf")]
    pads = [1, 1, 1, 1]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="c1", pads=pads),
             helper.make_node("Relu", ["y1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y2"], name="c2", pads=pads),
             helper.make_node("Relu", ["y2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "two_convs",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                             ["N", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return load_model(model.SerializeToString())


def _batches(seed=1, n=3):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((16, 3, 8, 8)).astype(np.float32)} for _ in range(n)]


def _run(model, batches, names=None):
    runner = OrtRunner(model if names is None else expose_tensors(model, names))
    outs = [runner.run(b, names or ["logits"]) for b in batches]
    return {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}


def _group_of(structure, member):
    return next(g.group_id for g in structure.groups if member in g.members)


def test_duplicated_channel_removed_with_reconstruction_leaves_outputs_unchanged():
    model, batches = _two_convs(), _batches()
    s = analyze_structure(model)
    gid = _group_of(s, "c1")
    moments = collect_input_moments(model, consumer_sites(s, [gid]), batches)
    pruned, record, rec = prune_reconstructed(model, s, {gid: [7]}, moments, ridge=0.0)
    dense, out = _run(model, batches)["logits"], _run(pruned, batches)["logits"]
    assert record.params_after < record.params_before
    np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-5)
    layer = rec.layers[0]
    assert layer.node_name == "c2" and layer.error_before > 1e-2 and layer.error_after < 1e-10
    # without the repair the same removal changes the logits clearly
    from onnxdiag.structured import prune_channels

    plain, _ = prune_channels(model, s, {gid: [7]})
    assert np.abs(_run(plain, batches)["logits"] - dense).max() > 100 * 1e-5


def test_nothing_removed_is_the_identity():
    model, batches = _two_convs(duplicate=None), _batches()
    s = analyze_structure(model)
    moments = collect_input_moments(model, consumer_sites(s), batches)
    same, rec = reconstruct_model(model, s, {}, moments)
    assert rec.layers == () and removed_inputs(s, {}) == {}
    np.testing.assert_array_equal(_run(same, batches)["logits"], _run(model, batches)["logits"])
    a, c, kept, _ = fit_reconstruction(moments["r1"], [])
    assert a.shape == (0, 8) and c.shape == (0,) and kept.tolist() == list(range(8))


@pytest.mark.parametrize("ridge", [0.0, 0.01, 0.3])
def test_fit_equals_lstsq_on_the_exposed_consumer_inputs(ridge):
    model, batches = _two_convs(duplicate=None), _batches()
    s = analyze_structure(model)
    moments = collect_input_moments(model, consumer_sites(s), batches, positions=None)
    removed = [1, 4, 5]
    a, c, kept, lam = fit_reconstruction(moments["r1"], removed, ridge)
    x = channel_rows(_run(model, batches, ["r1"])["r1"], 1).astype(np.float64)
    xc = x - x.mean(axis=0)
    n = x.shape[0]
    design = np.vstack([xc[:, kept], np.sqrt((n - 1) * lam) * np.eye(kept.size)])
    target = np.vstack([xc[:, removed], np.zeros((kept.size, len(removed)))])
    coef = np.linalg.lstsq(design, target, rcond=None)[0]
    np.testing.assert_allclose(a, coef.T, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(c, x[:, removed].mean(0) - coef.T @ x[:, kept].mean(0),
                               rtol=1e-7, atol=1e-9)
    assert lam == pytest.approx(ridge * np.mean(np.var(x[:, kept], axis=0, ddof=1)))


def _linear_problem(seed=3, n=400, d=12, out=5):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((d, d)) * (rng.random((d, d)) < 0.4) + np.eye(d)
    x = rng.standard_normal((n, d)) @ mix + rng.standard_normal(d)
    w = rng.standard_normal((out, d))  # "oi": (out, in)
    return x, w, Moments(d).update(x)


def _brute_error(x, w, removed, ridge):
    """Σ_samples ‖W x − (W' x_S + b')‖² / (n − 1) of the fitted reconstruction."""
    removed = sorted(removed)
    mo = Moments(x.shape[1]).update(x)
    a, c, kept, _ = fit_reconstruction(mo, removed, ridge)
    resid = x[:, removed] - x[:, kept] @ a.T - c
    return float(np.sum((resid @ w[:, removed].T) ** 2) / (x.shape[0] - 1)), a


def test_greedy_error_equals_the_brute_force_reconstruction_error():
    x, w, mo = _linear_problem()
    feats = np.arange(12)[:, None]
    order, errors = greedy_elimination([(mo, w, "oi", feats)], 12, ridge=0.0, steps=6)
    for k in range(1, 7):
        brute, _ = _brute_error(x, w, order[:k], 0.0)
        assert errors[k - 1] == pytest.approx(brute, rel=1e-6)  # the 1e-10 ridge floor
    singles = [_brute_error(x, w, [j], 0.0)[0] for j in range(12)]
    assert order[0] == int(np.argmin(singles))
    # with a ridge: the increase of tr(G Σ) − tr((Σ_SS + λI)⁻¹ (Σ G Σ)_SS), in closed form
    order, errors = greedy_elimination([(mo, w, "oi", feats)], 12, ridge=0.05, steps=3)
    cov, g = mo.cov(), w.T @ w
    lam, k = 0.05 * float(np.mean(np.diag(cov))), cov @ g @ cov

    def explained(kept):
        return np.trace(np.linalg.solve(cov[np.ix_(kept, kept)] + lam * np.eye(len(kept)),
                                        k[np.ix_(kept, kept)]))
    kept = np.setdiff1d(np.arange(12), order[:3])
    assert errors[-1] == pytest.approx(explained(np.arange(12)) - explained(kept), rel=1e-8)


def test_greedy_over_blocks_equals_brute_force():
    x, w, mo = _linear_problem(seed=5, d=12)
    feats = np.arange(12).reshape(4, 3)  # 4 "heads" of 3 features
    order, errors = greedy_elimination([(mo, w, "oi", feats)], 4, ridge=0.0)
    for k in range(1, 4):
        removed = sorted(feats[order[:k]].ravel().tolist())
        assert errors[k - 1] == pytest.approx(_brute_error(x, w, removed, 0.0)[0], rel=1e-8)


def test_recon_and_wanda_scores_rank_every_channel():
    model, batches = _two_convs(), _batches()
    s = analyze_structure(model)
    moments = collect_input_moments(model, consumer_sites(s), batches)
    recon, missing = recon_scores(model, s, moments, ridge=0.0)
    gid = _group_of(s, "c1")
    assert sorted(recon[gid].tolist()) == list(range(8)) and not missing
    assert recon[gid][[2, 7]].min() == 0  # one of the duplicates goes first
    wanda, _ = wanda_scores(model, s, moments)
    assert wanda[gid].shape == (8,) and np.all(wanda[gid] >= 0)


def test_head_pruning_with_reconstruction_on_hf_bert(tmp_path):
    export = exports.hf_bert(tmp_path)
    model = load_model(export.path)
    s = analyze_structure(model)
    heads = {g.group_id: [g.n_channels - 1] for g in s.groups
             if g.role == "attention_heads" and g.prunable}
    mlp = {g.group_id: list(range(0, g.n_channels, 4)) for g in s.groups
           if g.role == "mlp_hidden" and g.prunable and not any("pooler" in m for m in g.members)}
    assert heads and mlp
    rng = np.random.default_rng(0)
    batches = [{"input_ids": rng.integers(1, 64, (8, 8)),
                "attention_mask": np.ones((8, 8), np.int64)} for _ in range(4)]
    moments = collect_input_moments(model, consumer_sites(s, [*heads, *mlp]), batches)
    pruned, record, rec = prune_reconstructed(model, s, {**heads, **mlp}, moments)
    onnx.checker.check_model(pruned, full_check=True)
    after = analyze_structure(pruned)
    assert after.n_params == record.params_after < record.params_before
    names = {la.node_name for la in rec.layers}
    assert any("attention/output/dense" in n for n in names)  # the heads' out projection
    assert any("output/dense" in n and "attention" not in n for n in names)  # fc2
    assert all(la.error_after < la.error_before for la in rec.layers)
    from onnxdiag.structured import prune_channels

    plain, _ = prune_channels(model, s, {**heads, **mlp})
    dense = _run(model, batches)["logits"]
    err_plain = np.abs(_run(plain, batches)["logits"] - dense).mean()
    err_recon = np.abs(_run(pruned, batches)["logits"] - dense).mean()
    assert err_recon < err_plain


def test_too_wide_consumers_are_left_alone_with_a_note(monkeypatch):
    import onnxdiag.structured.reconstruct as rc
    from onnxdiag.structured import prune_channels

    monkeypatch.setattr(rc, "MAX_FEATURES", 4)  # c2 reads 8 channels
    model, batches = _two_convs(), _batches()
    s = analyze_structure(model)
    gid = _group_of(s, "c1")
    moments = collect_input_moments(model, consumer_sites(s, [gid]), batches)
    assert moments == {}
    pruned, _, rec = prune_reconstructed(model, s, {gid: [7]}, moments)
    assert rec.layers[0].skipped.startswith("input of 8 features is wider than 4")
    assert any("not reconstructed: c2" in n for n in rec.notes)
    plain, _ = prune_channels(model, s, {gid: [7]})
    np.testing.assert_array_equal(_run(pruned, batches)["logits"], _run(plain, batches)["logits"])
