"""METHODS §C2: offline single-layer evaluation equals ONNX Runtime; RR curves against brute
force."""

from __future__ import annotations

import numpy as np
import pytest
from corpus import (
    conv_bias_add,
    depthwise_pointwise,
    gemm_head,
    matmul_add_head,
    random_feeds,
    residual_block,
    run_ort,
)
from onnx import TensorProto, helper, numpy_helper

from onnxdiag.graph import GraphIndex, analyze_structure
from onnxdiag.model.io import load_model
from onnxdiag.runtime.bound import BoundRunner
from onnxdiag.runtime.runner import OrtRunner
from onnxdiag.sparsity import (
    DEFAULT_GRID,
    apply_masks,
    compute_rr_curves,
    find_prunable,
    magnitude_mask,
    read_weights,
)
from onnxdiag.sparsity.offline import (
    conv_columns,
    evaluate_layer,
    layer_columns,
    layer_op,
    sampled_columns,
)
from onnxdiag.sparsity.repairability import PairMoments, distortions, parse_positions
from onnxdiag.stats import draw_positions


def _conv_geometry_model():
    """Dilated strided conv with asymmetric pads → Relu → grouped SAME_UPPER conv with bias."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=s).astype(np.float32), n) for n, s in (
        ("w1", (6, 4, 3, 3)), ("w2", (6, 3, 3, 3)), ("b2", (6,)))]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["y1"], name="dil", dilations=[2, 2],
                         strides=[2, 1], pads=[1, 2, 0, 1]),
        helper.make_node("Relu", ["y1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["out"], name="same", strides=[2, 2],
                         auto_pad="SAME_UPPER", group=2)]
    graph = helper.make_graph(nodes, "geo", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["N", 4, 9, 11])], [helper.make_tensor_value_info(
            "out", TensorProto.FLOAT, ["N", None, None, None])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _conv1d_model():
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.normal(size=(5, 4, 3)).astype(np.float32), "w")
    node = helper.make_node("Conv", ["x", "w"], ["out"], name="c1d", strides=[2], pads=[1, 0])
    graph = helper.make_graph([node], "c1d", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["N", 4, 12])], [helper.make_tensor_value_info(
            "out", TensorProto.FLOAT, ["N", None, None])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _weighted_layers(model):
    structure = analyze_structure(model, require_head=False)
    return [la for la in structure.layers if la.prunable]


@pytest.mark.parametrize("build", [residual_block, depthwise_pointwise, conv_bias_add,
                                   gemm_head, lambda: gemm_head(trans_b=False),
                                   _conv_geometry_model, _conv1d_model])
def test_offline_layer_equals_onnx_runtime_for_the_same_mask(build):
    model = load_model(build())
    layers = _weighted_layers(model)
    weights = read_weights(model, layers)
    masks = {name: magnitude_mask(w, 0.7) for name, w in weights.items()}
    pruned = apply_masks(model, masks)
    feeds = random_feeds(model, batch=3)
    names = [t for la in layers for t in (la.input, la.output)]
    out = {**run_ort(pruned, feeds, [n for n in names if n not in feeds]), **feeds}
    index = GraphIndex(model)
    for la in layers:
        node = index.get_node(la.node_name)
        bias = index.get_constant(node.input[2]) if len(node.input) > 2 else None
        y = evaluate_layer(layer_op(index, la), out[la.input], weights[la.node_name]
                           * masks[la.node_name], bias)
        ref = out[la.output]
        assert y.shape == ref.shape, la.node_name
        np.testing.assert_allclose(y, ref, atol=1e-4 * max(1.0, np.abs(ref).max()),
                                   err_msg=la.node_name)


def _calibration(model, n_batches=3, batch=4):
    return [random_feeds(model, batch=batch, seed=i) for i in range(n_batches)]


def test_rr_is_one_and_damage_zero_at_sparsity_zero():
    assert len(DEFAULT_GRID) == 28 and DEFAULT_GRID[18] == 0.9 and DEFAULT_GRID[-1] == 0.99
    model = load_model(residual_block())
    curves = compute_rr_curves(model, find_prunable(analyze_structure(model)), _calibration(model))
    assert curves.grid[0] == 0 and curves.n_images == 12
    np.testing.assert_array_equal(curves.rr[:, 0], 1.0)
    np.testing.assert_array_equal(curves.d_raw[:, 0], 0.0)
    assert np.all(curves.d_raw[:, -1] > curves.d_raw[:, 1])
    assert curves.rr_at("c3", 0.0) == 1.0
    assert curves.rr_at("c3", 0.925) == pytest.approx(
        (curves.rr_at("c3", 0.92) + curves.rr_at("c3", 0.93)) / 2)


def test_rr_curves_equal_the_explicit_definition():
    model = load_model(residual_block())
    layers = find_prunable(analyze_structure(model))
    calib = _calibration(model)
    grid = (0.0, 0.3, 0.9, 0.99)
    curves = compute_rr_curves(model, layers, calib, grid=grid, positions="all")
    index = GraphIndex(model)
    for la in layers:
        x = np.concatenate([run_ort(model, f, [la.input])[la.input] if la.input not in f
                            else f[la.input] for f in calib])
        w = index.get_constant(la.weight).astype(np.float64)
        op = layer_op(index, la)
        yd = _rows(evaluate_layer(op, x.astype(np.float64), w))
        for j, s in enumerate(grid):
            yp = _rows(evaluate_layer(op, x.astype(np.float64), w * magnitude_mask(w, s)))
            sd, sp = yd.std(axis=0), yp.std(axis=0)
            keep = sp > 1e-6 * sd
            yhat = np.where(keep, yd.mean(0) + sd / np.where(keep, sp, 1) * (yp - yp.mean(0)),
                            yd.mean(0))
            d_raw = ((yd - yp) ** 2).mean(0).sum() / yd.var(0).sum()
            d_rep = ((yd - yhat) ** 2).mean(0).sum() / yd.var(0).sum()
            i = curves.get_index(la.node_name)
            assert curves.d_raw[i, j] == pytest.approx(d_raw, rel=1e-4, abs=1e-9)
            assert curves.d_repair[i, j] == pytest.approx(d_rep, rel=1e-4, abs=1e-9)
            assert curves.rr[i, j] == pytest.approx((d_rep + 1e-12) / (d_raw + 1e-12), rel=1e-3)


def _rows(y):
    return np.moveaxis(y, 1, -1).reshape(-1, y.shape[1]) if y.ndim > 2 else y


def test_repair_error_identity_per_channel():
    rng = np.random.default_rng(0)
    yd = rng.normal(size=(500, 4)) * [1, 2, 3, 4] + [0, 1, -1, 5]
    yp = 0.3 * yd + rng.normal(size=(500, 4)) * [0.5, 1, 2, 0.1]
    yhat = yd.mean(0) + yd.std(0) / yp.std(0) * (yp - yp.mean(0))
    corr = np.array([np.corrcoef(yd[:, c], yp[:, c])[0, 1] for c in range(4)])
    np.testing.assert_allclose(((yd - yhat) ** 2).mean(0), 2 * yd.var(0) * (1 - corr), rtol=1e-10)
    # the streamed moments give the same D_repair, for any batch split
    acc = PairMoments(4)
    for part in np.array_split(np.arange(500), 7):
        acc.update(yd[part], yd[part] - yp[part])
    raw, rep = distortions(acc)
    assert rep == pytest.approx((2 * yd.var(0) * (1 - corr)).sum() / yd.var(0).sum(), rel=1e-10)
    assert raw == pytest.approx(((yd - yp) ** 2).mean(0).sum() / yd.var(0).sum(), rel=1e-10)
    acc = PairMoments(1).update(yd[:, :1], yd[:, :1])  # collapsed channel: restored to its mean
    y0 = yd[:, 0]
    assert distortions(acc) == pytest.approx(((y0 ** 2).mean() / y0.var(), 1.0))


def test_rr_uses_one_runtime_pass_and_is_batch_split_invariant(monkeypatch):
    model = load_model(residual_block())
    layers = find_prunable(analyze_structure(model))
    calls, sessions = [], []
    original, init = BoundRunner.run, OrtRunner.__init__
    monkeypatch.setattr(BoundRunner, "run", lambda self, *a, **k: calls.append(1) or
                        original(self, *a, **k))
    monkeypatch.setattr(OrtRunner, "__init__", lambda self, *a, **k: sessions.append(1) or
                        init(self, *a, **k))
    split = compute_rr_curves(model, layers, _calibration(model, 3, 4))
    assert len(calls) == 3 and len(sessions) == 1  # one session, one run per batch
    whole = compute_rr_curves(model, layers, [{"x": np.concatenate(
        [f["x"] for f in _calibration(model, 3, 4)])}])
    # D is a fraction of the output variance: float32 products (Gram, R_l Σ) leave ~1e-10
    np.testing.assert_allclose(split.d_repair, whole.d_repair, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(split.rr, whole.rr, rtol=2e-6)  # 1.2e-6 measured
    assert compute_rr_curves(model, layers[:2], _calibration(model), n_images=6).n_images == 6


def test_rr_shows_a_bar_for_each_pass_over_the_layers_on_a_terminal(monkeypatch):
    """``label``: bars for the planning, the capture and the layers' finish on a
    terminal's stderr (click writes the label); the same curves as without them."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    model = load_model(residual_block())
    layers = find_prunable(analyze_structure(model))
    quiet = compute_rr_curves(model, layers, _calibration(model, 3, 4), label="RR curves")
    monkeypatch.setattr(sys, "stderr", Terminal())
    shown = compute_rr_curves(model, layers, _calibration(model, 3, 4), label="RR curves")
    text = sys.stderr.getvalue()
    for part in ("plan", "capture", "layers"):
        assert f"RR curves: {part}" in text
    np.testing.assert_array_equal(quiet.rr, shown.rr)


@pytest.mark.parametrize("build", [residual_block, depthwise_pointwise, gemm_head])
def test_float32_gram_steps_are_within_their_bound_of_float64(build, monkeypatch):
    """The sampled Gram finish's R_l Σ in float32 (GRAM_STEPS_FLOAT32): the curves are
    those of float64 products to 1e-9 of the output variance (D) and 1e-5 relative (RR);
    with every position the products stay float64 (identical curves)."""
    from onnxdiag.sparsity import repairability

    model = load_model(build())
    layers = _weighted_layers(model)
    calib = [random_feeds(model, batch=5, seed=i) for i in range(3)]
    curves = {}
    for flag in (True, False):
        monkeypatch.setattr(repairability, "GRAM_STEPS_FLOAT32", flag)
        curves[flag] = [compute_rr_curves(model, layers, calib, strategy="gram", positions=p)
                        for p in (2, None)]
    (f32, f32_all), (f64, f64_all) = curves[True], curves[False]
    for name in ("d_raw", "d_repair"):
        np.testing.assert_allclose(getattr(f32, name), getattr(f64, name), rtol=1e-5,
                                   atol=1e-9)
        np.testing.assert_array_equal(getattr(f32_all, name), getattr(f64_all, name))
    np.testing.assert_allclose(f32.rr, f64.rr, rtol=1e-5)
    assert not np.array_equal(f32.d_repair, f64.d_repair)  # the float32 path ran


@pytest.mark.parametrize("build", [residual_block, depthwise_pointwise, gemm_head,
                                   matmul_add_head])
def test_gram_and_incremental_strategies_agree(build):
    """The two exact evaluation schemes (quadratic forms of the column moments vs the
    removed weights' output grown level by level) give the same curves."""
    model = load_model(build())
    layers = _weighted_layers(model)
    calib = [random_feeds(model, batch=5, seed=i) for i in range(3)]
    a, b = (compute_rr_curves(model, layers, calib, strategy=s) for s in ("gram", "incremental"))
    for name in ("d_raw", "d_repair"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-6, atol=1e-10)
    np.testing.assert_allclose(a.rr, b.rr, rtol=1e-5)
    assert a.n_samples == b.n_samples
    with pytest.raises(Exception, match="Unknown RR strategy"):
        compute_rr_curves(model, layers, calib, strategy="fast")


# --------------------------------------------------------------------------- position sampling

def _inputs(model, layers, calib):
    """Each layer's captured dense input over all of ``calib`` (float32, as ORT gives it)."""
    return {la.node_name: np.concatenate([f[la.input] if la.input in f else run_ort(
        model, f, [la.input])[la.input] for f in calib]) for la in layers}


@pytest.mark.parametrize("table", [True, False])
@pytest.mark.parametrize("build", [_conv_geometry_model, _conv1d_model, depthwise_pointwise])
def test_sampled_columns_are_the_drawn_rows_of_the_full_im2col(build, table, monkeypatch):
    """Sampled patches (NumPy or ORT channels-last gather, padding included) are exactly
    the full im2col's rows at draw_positions' positions, per image, for any batch split;
    from the geometry's cached patch table and (``table`` False: a map above
    PATCH_TABLE_ENTRIES) from the drawn positions' entries alone."""
    from onnxdiag.sparsity import offline

    if not table:
        monkeypatch.setattr(offline, "PATCH_TABLE_ENTRIES", 0)
    model = load_model(build())
    index = GraphIndex(model)
    calib = [random_feeds(model, batch=5, seed=i) for i in range(2)]
    for la in [la for la in _weighted_layers(model) if la.op_type == "Conv"]:
        x = _inputs(model, [la], calib)[la.node_name]
        op, kernel = layer_op(index, la), tuple(la.kernel)
        full, lead = conv_columns(op, x, kernel)
        n_pos = int(np.prod(lead[1:]))
        k = max(1, n_pos // 3)
        flat = draw_positions(n_pos, k, seed=7, sample_indices=np.arange(10))
        want = full.reshape(10, n_pos, *full.shape[1:])[np.arange(10)[:, None], flat]
        want = want.reshape(-1, *full.shape[1:])
        last = np.moveaxis(x, 1, -1)
        for part in (slice(0, 10), slice(0, 4), slice(4, 10)):
            idx = np.arange(10)[part]
            rows = slice(idx[0] * k, (idx[-1] + 1) * k)
            for xl in (None, last[part]):
                got = sampled_columns(op, x[part], kernel, k, seed=7, sample_indices=idx,
                                      x_last=xl)
                np.testing.assert_array_equal(got, want[rows], err_msg=la.node_name)
        # at least as many positions as the output has: every position, in order
        np.testing.assert_array_equal(sampled_columns(op, x, kernel, n_pos, seed=7,
                                                      sample_indices=np.arange(10)), full)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("build", [_conv_geometry_model, depthwise_pointwise, residual_block])
def test_rr_capture_cuts_sampled_patches_in_the_graph_with_the_numpy_curves(build, k,
                                                                            monkeypatch):
    """The capture gathers a sampled 2-D conv's patches inside the graph (only k patches
    per image leave the session, not its whole input; dilation, strides, asymmetric and
    SAME_UPPER pads, groups; where the k patches hold at most half the input's values):
    the columns NumPy cuts from the layer's input, so the
    curves are those of the NumPy path (to float32 rounding: other graphs fuse other
    ops, and the arrays' layouts differ), for pieces of 3 images and any batch split."""
    import onnxdiag.sparsity.repairability as rr
    import onnxdiag.sparsity.rr_capture as rc

    model = load_model(build())
    layers = _weighted_layers(model)
    convs = [la for la in layers if la.op_type == "Conv"]
    calib = _calibration(model, 2, 5)
    index = GraphIndex(model)
    plans = [rr._plan(index, la, np.asarray(DEFAULT_GRID), "auto", k, 1) for la in layers]
    cap = rc.capture_session(model, index, layers, plans, k, 1, None, None)
    small = {la.node_name for la in convs if 2 * k * int(np.prod(la.kernel)) <= int(np.prod(
        index.shape(la.input)[2:]))}
    assert set(cap.key_of) == small and (small or k > 1)
    convs = [la for la in convs if la.node_name in small]
    assert not {la.input for la in convs} & (set(cap.fetch) - set(index.inputs))
    images = np.arange(5, 10)  # the second batch's global indices
    outs = {**cap.runner.run({**calib[1], **cap.extra_feeds(images)}, cap.fetch), **calib[1]}
    xs = _inputs(model, layers, calib[1:])
    for la, plan in zip(layers, plans):
        want = sampled_columns(plan["op"], xs[la.node_name], tuple(la.kernel), k, seed=1,
                               sample_indices=images)
        # the input itself may differ by float32 rounding (another graph, other fusions)
        np.testing.assert_allclose(cap.columns(la, plan, outs, images), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max(), err_msg=la.node_name)
    monkeypatch.setattr(rc, "BOUND_ROWS", 3)
    monkeypatch.setattr(rc, "PIECE_BYTES", 1)  # pieces of BOUND_ROWS images
    assert rc.capture_session(model, index, layers, plans, k, 1, None, None).piece == 3
    graph = compute_rr_curves(model, layers, calib, positions=k, seed=1)
    one = compute_rr_curves(model, layers, [{"x": np.concatenate([f["x"] for f in calib])}],
                            positions=k, seed=1)
    monkeypatch.setattr(rc, "GRAPH_COLUMNS", False)
    plain = compute_rr_curves(model, layers, calib, positions=k, seed=1)
    assert graph.n_samples == plain.n_samples == one.n_samples
    # the columns differ by float32 rounding (above), so the curves do by a few 1e-7
    # relative: 1.1e-6 seen on one AVX-512 host whose ONNX Runtime kernels differ
    for got in (graph, one):
        for name in ("d_raw", "d_repair", "rr"):
            np.testing.assert_allclose(getattr(got, name), getattr(plain, name), rtol=5e-6,
                                       atol=1e-12)


def _explicit_rr(op, cols, w, grid):
    """(D_raw, D_repair) (n_s,) from explicit columns in float64, METHODS §C2 definition."""
    c = cols.astype(np.float64)
    m = weight_matrix_f64(op, w)
    yd = _apply64(c, m)
    out = []
    for s in grid:
        yp = _apply64(c, weight_matrix_f64(op, w * magnitude_mask(w, s)))
        sd, sp = yd.std(axis=0), yp.std(axis=0)
        keep = sp > 1e-6 * sd
        yhat = np.where(keep, yd.mean(0) + sd / np.where(keep, sp, 1) * (yp - yp.mean(0)),
                        yd.mean(0))
        total = yd.var(0).sum()
        out.append((((yd - yp) ** 2).mean(0).sum() / total,
                    ((yd - yhat) ** 2).mean(0).sum() / total))
    return np.array(out)


def weight_matrix_f64(op, w):
    from onnxdiag.sparsity.offline import weight_matrix
    return weight_matrix(op, w).astype(np.float64)


def _apply64(cols, matrix):
    return np.concatenate([cols[:, g, :] @ matrix[g] for g in range(cols.shape[1])], axis=1)


@pytest.mark.parametrize("strategy", ["gram", "incremental"])
def test_sampled_rr_equals_the_definition_on_the_sampled_patches(strategy):
    """With sampling, D_raw / D_repair are the METHODS §C2 moments over exactly the sampled
    patches (so the sampled Σ_X is the explicit one), for both evaluation schemes; with
    positions='all' they equal the every-position two-pass definition in float64 to 1e-6
    (one-pass float64 Gram moments; float32 dense outputs for incremental)."""
    tol = 1e-6
    model = load_model(residual_block())
    layers = find_prunable(analyze_structure(model))
    calib = [random_feeds(model, batch=4, seed=i) for i in range(3)]
    grid = (0.0, 0.3, 0.8, 0.95)
    sampled = compute_rr_curves(model, layers, calib, grid=grid, positions=5, seed=3,
                                strategy=strategy)
    exact = compute_rr_curves(model, layers, calib, grid=grid, positions="all",
                              strategy=strategy)
    assert (sampled.positions, sampled.seed, exact.positions) == (5, 3, None)
    index = GraphIndex(model)
    xs = _inputs(model, layers, calib)
    for i, la in enumerate(layers):
        op, w = layer_op(index, la), index.get_constant(la.weight).astype(np.float32)
        x = xs[la.node_name]
        full = layer_columns(op, x, tuple(w.shape[2:]))[0]
        cols = sampled_columns(op, x, tuple(w.shape[2:]), 5, seed=3,
                               sample_indices=np.arange(len(x)))
        ref = _explicit_rr(op, cols, w, grid)
        np.testing.assert_allclose(sampled.d_raw[i], ref[:, 0], rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(sampled.d_repair[i], ref[:, 1], rtol=1e-4, atol=1e-9)
        assert sampled.n_samples[i] == len(cols)
        ref = _explicit_rr(op, full, w, grid)
        np.testing.assert_allclose(exact.d_raw[i], ref[:, 0], rtol=tol, atol=1e-12)
        np.testing.assert_allclose(exact.d_repair[i], ref[:, 1], rtol=tol, atol=1e-12)
        assert exact.n_samples[i] == len(full)


@pytest.mark.parametrize("strategy", ["gram", "incremental"])
def test_rr_of_a_head_over_near_constant_features_keeps_their_variance(strategy):
    """A head whose features vary by less than float32's resolution of their mean (a
    random-weight net's pooled features): both schemes shift the columns before their
    products, so the curves are the float64 definition's on the same float32 features
    (unshifted, the incremental scheme's float32 outputs were 87 % off on a 224×224
    MobileNetV2's head)."""
    model = load_model(gemm_head())
    layers = find_prunable(analyze_structure(model))
    rng = np.random.default_rng(0)
    base = rng.uniform(2.0, 3.0, 16)
    calib = [{"x": (base + 4e-7 * rng.standard_normal((8, 16))).astype(np.float32)}
             for _ in range(3)]
    x = np.concatenate([f["x"] for f in calib])
    assert (x.std(axis=0) / x.mean(axis=0)).max() < 3e-7  # a few float32 steps
    grid = (0.0, 0.2, 0.5, 0.8)
    curves = compute_rr_curves(model, layers, calib, grid=grid, strategy=strategy)
    index = GraphIndex(model)
    (la,) = layers
    op, w = layer_op(index, la), index.get_constant(la.weight).astype(np.float32)
    ref = _explicit_rr(op, x[:, None, :], w, grid)
    np.testing.assert_allclose(curves.d_raw[0], ref[:, 0], rtol=1e-5)
    np.testing.assert_allclose(curves.d_repair[0], ref[:, 1], rtol=1e-4, atol=1e-9)


def test_sampled_rr_is_close_to_exact_and_batch_split_invariant():
    model = load_model(residual_block())
    layers = find_prunable(analyze_structure(model))
    calib = [random_feeds(model, batch=16, seed=i) for i in range(4)]
    exact = compute_rr_curves(model, layers, calib, positions="all")
    sampled = compute_rr_curves(model, layers, calib)  # default: 16 of 64 positions
    assert sampled.positions == 16 and sampled.n_samples[0] == 64 * 16
    assert np.abs(sampled.rr - exact.rr).max() < 0.05
    whole = compute_rr_curves(model, layers, [{"x": np.concatenate([f["x"] for f in calib])}])
    np.testing.assert_allclose(whole.rr, sampled.rr, rtol=1e-4, atol=1e-6)
    assert np.abs(compute_rr_curves(model, layers, calib, seed=1).rr - sampled.rr).max() > 0


@pytest.mark.parametrize("bad", [0, -3, 2.5, "some", "16x"])
def test_positions_must_be_a_positive_integer_or_all(bad):
    assert parse_positions("all") is None and parse_positions(None) is None
    assert parse_positions("8") == 8
    with pytest.raises(Exception, match="positive integer or 'all'"):
        parse_positions(bad)


@pytest.mark.parametrize("positions", [16, "all"])
def test_rr_curves_of_a_3x3_conv_on_a_1x1_input(positions):
    """Regression (VGG-16-BN's last stage in the zoo): the im2col columns of a 3×3 conv on a
    1×1 spatial input are a view; folding them must not write into it."""
    from corpus import conv_on_1x1_spatial, random_feeds

    from onnxdiag.graph import analyze_structure
    from onnxdiag.sparsity import compute_rr_curves, find_prunable

    model = conv_on_1x1_spatial()
    layers = find_prunable(analyze_structure(model))
    feeds = [random_feeds(model, batch=8, seed=i) for i in range(3)]
    curves = compute_rr_curves(model, layers, feeds, n_images=24, positions=positions)
    assert np.isfinite(curves.rr).all() and (curves.d_raw[:, 1:] > 0).all()
    again = compute_rr_curves(model, layers, feeds, n_images=24, positions=positions)
    np.testing.assert_array_equal(curves.rr, again.rr)  # the inputs were not modified
