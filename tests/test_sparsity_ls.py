"""docs/METHODS.md §E1: the LS reconstruction repair against brute-force references.

The references are built independently of the library: the layer's input is exposed with
ONNX Runtime (dense model: x_d; repaired model: x_p, upstream layers already refitted),
im2col is done by explicit loops, and every row is solved by numpy.linalg.lstsq with the
ridge written as augmented rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from corpus import (
    conv1d_head,
    conv_bn_folded,
    conv_geometry_head,
    depthwise_pointwise,
    gemm_head,
    random_feeds,
    run_ort,
)
from exports import digits_mlp

from onnxdiag.graph import GraphIndex, analyze_structure
from onnxdiag.model.io import load_model
from onnxdiag.sparsity import (
    allocate_sparsity,
    describe_layers,
    find_prunable,
    make_masks,
    read_weights,
    repair_model,
)
from onnxdiag.sparsity.ls_repair import LSSettings, dense_output, output_rows, weight_rows
from onnxdiag.sparsity.lsq import (
    TargetMoments,
    reconstruct_rows,
    solve_rows,
    sparsegpt_rows,
)
from onnxdiag.sparsity.offline import layer_op, sampled_columns
from onnxdiag.sparsity.sweep import Pruner


class CrossMoments:
    """The reference: float64 sums of the pruned / dense input columns of one layer, per
    group, with the whole K × K cross Gram x_p x_dᵀ (what TargetMoments avoids).

    ``update(cols_p, cols_d)`` with columns ``(m, groups, K)``; the products (and the
    column sums, as products with a ones vector: 9x faster than a float64 reduction) are
    BLAS products in ``dtype`` (float32: the input's precision), summed into float64.
    """

    def __init__(self, groups: int, k: int, dtype=np.float32):
        self.n = 0
        self.dtype = dtype
        self.sum_p = np.zeros((groups, k))
        self.sum_d = np.zeros((groups, k))
        self.pp = np.zeros((groups, k, k))
        self.pd = np.zeros((groups, k, k))

    def update(self, cols_p: np.ndarray, cols_d: np.ndarray) -> CrossMoments:
        same = cols_d is cols_p  # an input no pruning reached: x_p = x_d
        cp = np.asarray(cols_p, self.dtype)
        cd = cp if same else np.asarray(cols_d, self.dtype)
        ones = np.ones(cp.shape[0], self.dtype)  # column sums as BLAS products, too
        for g in range(cp.shape[1]):
            a, b = cp[:, g, :], cd[:, g, :]
            aa = a.T @ a
            self.pp[g] += aa
            self.pd[g] += aa if same else a.T @ b
            self.sum_p[g] += ones @ a
            self.sum_d[g] += ones @ b
        self.n += cp.shape[0]
        return self

    def merge(self, other: CrossMoments) -> CrossMoments:
        for name in ("sum_p", "sum_d", "pp", "pd"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.n += other.n
        return self

    def moments(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(H_pp, H_pd, μ_p, μ_d) of group ``g`` (population moments)."""
        n = max(self.n, 1)
        return self.pp[g] / n, self.pd[g] / n, self.sum_p[g] / n, self.sum_d[g] / n

    def row_moments(self, g: int, w: np.ndarray) -> tuple:
        """What the row solves of group ``g``'s rows ``w`` (rows, K) read: (H_pp,
        H_pd wᵀ (K, rows), μ_p, W μ_d (rows,))."""
        h_pp, h_pd, mu_p, mu_d = self.moments(g)
        return h_pp, h_pd @ np.asarray(w, np.float64).T, mu_p, np.asarray(w) @ mu_d


def _setup(model, S=0.6, rule="uniform", calib=None):
    structure = analyze_structure(model)
    layers = find_prunable(structure)
    weights = read_weights(model, layers)
    alloc = allocate_sparsity(rule, describe_layers(model, layers), S, weights=weights)
    calib = calib or [random_feeds(model, batch=6, seed=i) for i in range(3)]
    return structure, make_masks(alloc, weights), calib


def _im2col(x, k, stride, pad):
    """(n·ho·wo, C·k·k) patches by explicit loops (rows image-major, then ho, wo)."""
    n, c, h, w = x.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    out = np.zeros((n, ho, wo, c * k * k))
    for i in range(ho):
        for j in range(wo):
            out[:, i, j] = xp[:, :, i * stride:i * stride + k, j * stride:j * stride + k
                              ].reshape(n, -1)
    return out.reshape(-1, c * k * k)


def _inputs(dense, repaired, calib, tensor):
    xd = np.concatenate([run_ort(dense, f, [tensor])[tensor] for f in calib])
    xp = np.concatenate([run_ort(repaired, f, [tensor])[tensor] for f in calib])
    return xd, xp


def _lstsq_rows(xp, xd, w, mask, prior, ridge=0.01):
    """Per row: argmin ‖X_p[:, S] v − X_d w_i‖² + nλ‖v − t‖² via lstsq on augmented rows
    (t = w_i,S for the 'weights' prior, 0 for 'zero'); λ = ridge · mean diag(X_pᵀX_p / n)."""
    n = xp.shape[0]
    lam = ridge * np.mean(np.sum(xp * xp, axis=0) / n)
    out = np.zeros_like(w)
    for i in range(w.shape[0]):
        s = np.flatnonzero(mask[i])
        a = np.vstack([xp[:, s], np.sqrt(n * lam) * np.eye(s.size)])
        t = w[i, s] if prior == "weights" else np.zeros(s.size)
        y = np.concatenate([xd @ w[i], np.sqrt(n * lam) * t])
        out[i, s] = np.linalg.lstsq(a, y, rcond=None)[0]
    return out


@pytest.mark.parametrize("prior", ["weights", "zero"])
def test_conv_rows_equal_lstsq_on_the_exposed_inputs(prior):
    """conv1 (8→16, 3×3, stride 2, pad 1) of a BN-folded chain, conv0 pruned upstream:
    its refitted rows and bias equal the brute-force lstsq on im2col(x_p), im2col(x_d)."""
    model = load_model(conv_bn_folded())
    structure, masks, calib = _setup(model)
    repaired, rec = repair_model(model, structure, masks, calib, method="ls",
                                 ls=LSSettings(prior=prior, solver="exact"))
    la = next(la for la in structure.layers if la.node_name == "conv1")
    xd, xp = _inputs(model, repaired, calib, la.input)
    cd, cp = _im2col(xd, 3, 2, 1), _im2col(xp, 3, 2, 1)
    index = GraphIndex(model)
    w = index.get_constant(la.weight).astype(np.float64).reshape(16, -1)
    b = index.get_constant(la.bias).astype(np.float64)
    mask = masks["conv1"].reshape(16, -1)
    ref = _lstsq_rows(cp, cd, w, mask, prior)
    rindex = GraphIndex(repaired)
    node = rindex.get_node("conv1")
    got = rindex.get_constant(node.input[1]).astype(np.float64).reshape(16, -1)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    ref_b = b + (cd @ w.T).mean(0) - (cp @ ref.T).mean(0)
    np.testing.assert_allclose(rindex.get_constant(node.input[2]), ref_b, rtol=1e-4,
                               atol=1e-5 * np.abs(ref_b).max())
    # the reported output errors are the measured ones: ‖Y − Y_d‖ / ‖Y_d‖ on the calib data
    yd = cd @ w.T + b
    after = np.linalg.norm(cp @ got.T + rindex.get_constant(node.input[2]) - yd)
    before = np.linalg.norm(cp @ np.where(mask, w, 0).T + b - yd)
    r = rec.layers["conv1"]
    assert r.error_after == pytest.approx(after / np.linalg.norm(yd), rel=1e-3)
    assert r.error_before == pytest.approx(before / np.linalg.norm(yd), rel=1e-3)
    assert r.error_after < r.error_before and r.solver == "exact"


def test_linear_rows_equal_lstsq_on_an_skl2onnx_mlp(tmp_path):
    """The head MatMul (16→10, weight stored (in, out)) of a real skl2onnx MLP, its hidden
    MatMul pruned: rows = lstsq on the exposed hidden activations; the bias Add absorbs
    the mean correction."""
    path, data = digits_mlp(tmp_path)
    model = load_model(path)
    x = np.load(data)["X"]
    calib = [{"X": x[i:i + 32]} for i in (0, 32)]
    structure, masks, calib = _setup(model, S=0.5, calib=calib)
    repaired, rec = repair_model(model, structure, masks, calib, method="ls",
                                 ls=LSSettings(solver="exact"))
    la = next(la for la in structure.layers if la.is_head)
    xd, xp = _inputs(model, repaired, calib, la.input)
    w = GraphIndex(model).get_constant(la.weight).astype(np.float64).T  # (out, in)
    ref = _lstsq_rows(xp.astype(np.float64), xd.astype(np.float64), w, masks[la.node_name].T,
                      "weights")
    got = GraphIndex(repaired).get_constant(la.weight).astype(np.float64).T
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    assert rec.layers[la.node_name].error_after <= rec.layers[la.node_name].error_before


def test_depthwise_groups_are_solved_per_group():
    """A depthwise conv (group 8): each output channel sees only its own input channel's
    3×3 patch; the refit keeps the grouping and lowers the layer's output error."""
    model = load_model(depthwise_pointwise())
    structure, masks, calib = _setup(model, S=0.5)
    repaired, rec = repair_model(model, structure, masks, calib, method="ls")
    w = GraphIndex(repaired).get_constant(GraphIndex(repaired).get_node("dw").input[1])
    assert w.shape == (8, 1, 3, 3) and np.all(w[~masks["dw"]] == 0)
    assert rec.layers["dw"].error_after <= rec.layers["dw"].error_before + 1e-9
    assert len(rec.layers["dw"].lam) == 8


def test_zero_pruning_is_the_identity():
    """Nothing pruned: no layer is reached and every weight comes back unchanged; and the
    solvers themselves give w back when x_p = x_d and S is everything (the default
    'weights' prior), whereas the 'zero' prior shrinks."""
    model = load_model(conv_bn_folded())
    structure, masks, calib = _setup(model, S=0.0)
    repaired, rec = repair_model(model, structure, masks, calib, method="ls+bn")
    for a, b in zip(model.graph.initializer, repaired.graph.initializer):
        assert a.name == b.name and a.raw_data == b.raw_data
    assert rec.layers == {}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 12)) @ rng.standard_normal((12, 12))
    acc = CrossMoments(1, 12, dtype=np.float64).update(x[:, None], x[:, None])
    w, full = rng.standard_normal((5, 12)), np.ones((5, 12), bool)
    for method in ("exact", "sparsegpt"):
        got = reconstruct_rows(w, full, acc.row_moments(0, w), method=method)[0]
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-10)
    shrunk = reconstruct_rows(w, full, acc.row_moments(0, w), prior="zero")[0]
    assert np.abs(shrunk - w).max() > 1e-4


def _objective(v, w, mask, h_pp, h_pd, yd_sq, lam):
    """E[(vᵀx_p − wᵀx_d)²] + λ‖v − w_S‖², summed over rows."""
    quad = np.einsum("ik,kl,il->", v, h_pp, v) - 2 * np.einsum("ik,kl,il->", v, h_pd, w)
    return quad + yd_sq + lam * np.sum((v - np.where(mask, w, 0)) ** 2)


def test_sparsegpt_sweep_is_close_to_exact_and_exact_without_pruning():
    """The sweep equals the exact solves with nothing pruned and for rows whose pruned
    entries precede the kept ones (OBS on a prefix is exact); on a 50 % magnitude mask
    its excess objective over the unconstrained optimum is within 2x of the exact one
    and well below that of the plain masked weights."""
    rng = np.random.default_rng(1)
    k, n = 40, 4000
    xd = rng.standard_normal((n, k)) @ (np.eye(k) + 0.3 * rng.standard_normal((k, k)))
    xp = xd + 0.3 * rng.standard_normal((n, k))  # upstream damage
    acc = CrossMoments(1, k, dtype=np.float64).update(xp[:, None], xd[:, None])
    w = rng.standard_normal((16, k))
    h_pp, hw, _, _ = acc.row_moments(0, w)
    h_pd = acc.moments(0)[1]
    lam = 0.01 * np.mean(np.diag(h_pp))
    full = np.ones_like(w, bool)
    np.testing.assert_allclose(sparsegpt_rows(w, full, h_pp, hw, lam),
                               solve_rows(w, full, h_pp, hw, lam), rtol=1e-9, atol=1e-9)
    prefix = full.copy()
    for i in range(16):
        prefix[i, :i + 1] = False
    np.testing.assert_allclose(sparsegpt_rows(w, prefix, h_pp, hw, lam),
                               solve_rows(w, prefix, h_pp, hw, lam), rtol=1e-8, atol=1e-8)
    mask = np.abs(w) >= np.quantile(np.abs(w), 0.5, axis=1, keepdims=True)
    yd_sq = float(np.einsum("ik,kl,il->", w, xd.T @ xd / n, w))

    def f(v):
        return _objective(v, w, mask, h_pp, h_pd, yd_sq, lam)

    best = f(solve_rows(w, full, h_pp, hw, lam))
    exact, sgpt = f(solve_rows(w, mask, h_pp, hw, lam)), f(sparsegpt_rows(
        w, mask, h_pp, hw, lam))
    naive = f(np.where(mask, w, 0))
    assert exact <= sgpt * (1 + 1e-9)
    assert sgpt - best <= 2 * (exact - best) and sgpt - best < 0.75 * (naive - best)
    assert np.all(sparsegpt_rows(w, mask, h_pp, hw, lam)[~mask] == 0)


@pytest.mark.parametrize("build", [conv_geometry_head, conv1d_head, depthwise_pointwise,
                                   lambda: gemm_head(trans_b=False)])
@pytest.mark.parametrize("positions", [None, 3])
def test_dense_outputs_read_off_the_pass_equal_the_columns_times_weights(build, positions):
    """The dense layer outputs the sequential LS reads off ONNX Runtime (its own bias, or
    a Gemm's β·C, removed; sampled at the columns' positions) equal W x_d computed from
    the sampled input columns, row for row: dilation, strides, pads, SAME_UPPER, groups,
    a 1-D conv, a depthwise conv, a Gemm with α = 0.5, β = 2 and its weight stored (in, out)."""
    model = build()
    index = GraphIndex(model)
    feeds = random_feeds(model, batch=5, seed=4)
    for la in find_prunable(analyze_structure(model)):
        node = index.get_node(la.node_name)
        got = run_ort(model, feeds, [la.input, node.output[0]]) if la.input not in feeds else {
            la.input: feeds[la.input], **run_ort(model, feeds, [node.output[0]])}
        op = layer_op(index, la)
        w = index.get_constant(la.weight)
        g = op.groups if op.kind == "conv" else 1
        draw = dict(seed=7, sample_indices=np.arange(10, 15))
        cols = sampled_columns(op, got[la.input], tuple(w.shape[2:]), positions, **draw)
        rows = weight_rows(la, op, w).reshape(g, -1, cols.shape[2])
        ref = np.einsum("mgk,gok->mgo", cols.astype(np.float64), rows)
        y = output_rows(op, dense_output(index, la, got[node.output[0]]), g, positions,
                        **draw)
        assert y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_target_moments_equal_the_cross_gram_projection():
    """TargetMoments (x_p against y_d = W x_d, no K × K cross Gram) gives the row solves'
    inputs H_pd wᵀ, W μ_d and E[y_d²] of the full cross moments: to float64 rounding in
    float64, to float32 rounding in float32; x_p = x_d (y_d None) projects H_pp; the sums
    do not depend on the batch split."""
    rng = np.random.default_rng(3)
    g, k, per, m = 2, 9, 5, 400
    xd = rng.standard_normal((m, g, k)) + 0.5
    xp = xd + 0.2 * rng.standard_normal((m, g, k))
    w = rng.standard_normal((g, per, k))
    yd = np.einsum("mgk,gpk->mgp", xd, w)
    full = CrossMoments(g, k, dtype=np.float64).update(xp, xd)
    for dtype, tol in ((np.float64, 1e-11), (np.float32, 2e-6)):
        tm = TargetMoments(g, k, per, dtype=dtype).update(xp[:150], yd[:150]).merge(
            TargetMoments(g, k, per, dtype=dtype).update(xp[150:], yd[150:]))
        for j in range(g):
            for got, ref in zip(tm.row_moments(j, w[j]), full.row_moments(j, w[j])):
                np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())
            ref_sq = np.mean(yd[:, j] ** 2, axis=0)
            np.testing.assert_allclose(tm.output_sq(j, w[j]), ref_sq, rtol=tol)
    same = TargetMoments(g, k, per, dtype=np.float64).update(xd, None)
    dense = CrossMoments(g, k, dtype=np.float64).update(xd, xd)
    for got, ref in zip(same.row_moments(1, w[1]), dense.row_moments(1, w[1])):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(same.output_sq(1, w[1]), np.mean(yd[:, 1] ** 2, axis=0),
                               rtol=1e-10)


def test_target_moments_do_not_depend_on_the_batch_split():
    rng = np.random.default_rng(2)
    a, y = rng.standard_normal((90, 2, 7)), rng.standard_normal((90, 2, 3))
    w = rng.standard_normal((3, 7))
    one = TargetMoments(2, 7, 3, dtype=np.float64).update(a, y)
    parts = TargetMoments(2, 7, 3, dtype=np.float64).update(a[:31], y[:31]).merge(
        TargetMoments(2, 7, 3, dtype=np.float64).update(a[31:], y[31:]))
    for x, z in zip((*one.row_moments(1, w), one.output_sq(1, w)),
                    (*parts.row_moments(1, w), parts.output_sq(1, w))):
        np.testing.assert_allclose(x, z, rtol=1e-12, atol=1e-12)


def test_ls_improves_agreement_on_an_skl2onnx_mlp_and_the_sample_vit(tmp_path):
    """LS vs no repair at high sparsity on two linear models: the skl2onnx MLP (S = 0.8)
    and the bundled ViT (MatMul / Gemm layers under LayerNorm, S = 0.7)."""
    from onnxdiag.data.sample import get_sample

    path, data = digits_mlp(tmp_path)
    x = np.load(data)["X"]
    cases = [(path, [{"X": x[:32]}, {"X": x[32:]}], 0.8)]
    sample = get_sample()
    imgs = np.load(sample.calibration)["input"][:96]
    vit = sample.folder.parent / "vit" / "model.onnx"
    cases.append((vit, [{"input": imgs[i:i + 48]} for i in (0, 48)], 0.7))
    for model_path, calib, S in cases:
        model = load_model(model_path)
        pruner = Pruner(model, analyze_structure(model), calib)
        alloc = pruner.allocate("uniform", S)
        none = pruner.agreement(pruner.prune(alloc, "none")[0])
        ls = pruner.agreement(pruner.prune(alloc, "ls")[0])
        assert ls > none + 0.05, (model_path, none, ls)


@pytest.mark.parametrize("inputs", ["sequential", "dense"])
def test_ls_passes_show_a_progress_bar_on_a_terminal(monkeypatch, inputs):
    """``label`` gives the LS pass (sequential: over its layers; dense inputs: over the
    batches) a progress bar on a terminal's stderr, and nothing off a terminal."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    model = load_model(conv_bn_folded())
    structure, masks, calib = _setup(model)
    settings = LSSettings(inputs=inputs)
    quiet = repair_model(model, structure, masks, calib, method="ls", ls=settings,
                         label="LS refit")[0]
    monkeypatch.setattr(sys, "stderr", Terminal())
    shown = repair_model(model, structure, masks, calib, method="ls", ls=settings,
                         label="LS refit")[0]
    assert "LS refit" in sys.stderr.getvalue()
    for a, b in zip(quiet.graph.initializer, shown.graph.initializer):
        assert a.raw_data == b.raw_data
