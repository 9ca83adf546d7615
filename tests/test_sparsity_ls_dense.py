"""docs/METHODS.md §E1 with ``--ls-inputs dense``: one dense pass, columns cut in the graph.

The references are built independently of the library's column code: the layer's input is
exposed with ONNX Runtime, im2col is done by explicit loops (positions drawn with
onnxdiag.stats.draw_positions, the documented draw), and every row is solved by
numpy.linalg.lstsq with the ridge written as augmented rows. The in-graph gather is
compared bit for bit with the NumPy columns of offline.sampled_columns.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from corpus import (
    conv1d_head,
    conv_bn_chain,
    conv_bn_folded,
    depthwise_pointwise,
    random_feeds,
    run_ort,
)
from exports import digits_mlp
from onnx import helper, numpy_helper
from test_sparsity_ls import _im2col, _lstsq_rows, _setup

from onnxdiag.channels.moments import gram_error_bound
from onnxdiag.data.source import DataWarning
from onnxdiag.graph import GraphIndex
from onnxdiag.model.io import load_model
from onnxdiag.runtime.runner import OrtRunner
from onnxdiag.sparsity import repair_model
from onnxdiag.sparsity.ls_columns import (
    channel_major_columns,
    conv_geometry,
    expose_columns,
    index_feeds,
)
from onnxdiag.sparsity.ls_repair import LSSettings
from onnxdiag.sparsity.offline import LayerOp, sampled_columns
from onnxdiag.stats import draw_positions

# (kernel, stride, pads, dilation, groups, auto_pad) on a (N, 4, 7, 6) input
GEOMETRIES = [((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, "NOTSET"),
              ((3, 3), (2, 2), (1, 0, 0, 1), (1, 1), 1, "NOTSET"),
              ((3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 1, "NOTSET"),
              ((2, 3), (2, 1), (0, 0, 0, 0), (1, 1), 1, "NOTSET"),
              ((3, 3), (2, 2), (), (1, 1), 1, "SAME_UPPER"),
              ((3, 3), (1, 2), (1, 1, 1, 1), (1, 1), 2, "NOTSET")]


def _conv_model(kernel, stride, pads, dilation, groups, auto_pad) -> onnx.ModelProto:
    """x (N, 4, 7, 6) → Relu "r" → Conv "c" (4 → 6): the conv reads a computed tensor."""
    w = np.random.default_rng(0).standard_normal((6, 4 // groups, *kernel)).astype(np.float32)
    attrs = dict(kernel_shape=list(kernel), strides=list(stride), dilations=list(dilation),
                 group=groups)
    attrs.update(auto_pad=auto_pad) if auto_pad != "NOTSET" else attrs.update(pads=list(pads))
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Conv", ["r", "w"], ["y"], name="c", **attrs)], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4, 7, 6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    return onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_gathered_columns_equal_sampled_columns(geometry):
    """The graph's patches (permuted to channel-major) equal sampled_columns bit for bit
    at 3 positions per image, at every position (None) and above the output's size, and
    a batch split in two gives the same rows as the whole batch; the graph's float32 Gram
    of them is within gram_error_bound of the float64 one."""
    kernel, stride, pads, dilation, groups, auto_pad = geometry
    model = _conv_model(*geometry)
    op = LayerOp("c", "conv", stride, pads, dilation, groups, auto_pad)
    geo = conv_geometry(GraphIndex(model), SimpleNamespace(kernel=kernel, input="r"), op)
    assert geo is not None
    exposed, names = expose_columns(model, {"k": ("r", geo)}, [])
    runner = OrtRunner(exposed)
    x = np.random.default_rng(1).standard_normal((10, 4, 7, 6)).astype(np.float32)
    relu = np.maximum(x, 0)
    for positions in (3, None, 1000):
        images = np.arange(20, 30)
        feeds = index_feeds({"k": ("r", geo)}, positions, 5, images)
        out = runner.run({"x": x, **feeds}, [names["k"]])[names["k"]]
        got = channel_major_columns(out, geo, groups)
        ref = sampled_columns(op, relu, kernel, positions, seed=5, sample_indices=images)
        np.testing.assert_array_equal(got, ref)
        halves = [runner.run({"x": x[s], **{k: v[s] for k, v in feeds.items()}},
                             [names["k"]])[names["k"]] for s in (slice(0, 4), slice(4, 10))]
        np.testing.assert_array_equal(np.concatenate(halves), out)
        if groups == 1:  # the graph's own float32 Gram and sums of the same columns
            gexp, gnames = expose_columns(model, {"k": ("r", geo)}, [], grams={"k"})
            res = OrtRunner(gexp).run({"x": x, **feeds})
            cols = out.reshape(len(ref), -1).astype(np.float64)  # tap-major
            exact = cols.T @ cols
            bound = gram_error_bound(np.abs(cols).T @ np.abs(cols), block=len(cols))
            assert np.all(np.abs(res[gnames["k/gram"]] - exact) <= bound)
            np.testing.assert_allclose(res[gnames["k/sum"]], cols.sum(0), rtol=1e-5,
                                       atol=1e-4)


def _dense_refit(model, masks, calib, prior, positions, method="ls"):
    structure = _setup(model)[0]
    return repair_model(model, structure, masks, calib, method=method,
                        ls=LSSettings(prior=prior, solver="exact", positions=positions,
                                      inputs="dense"))


@pytest.mark.parametrize("prior", ["weights", "zero"])
@pytest.mark.parametrize("positions", [None, 5])
def test_dense_conv_rows_equal_lstsq_on_the_dense_columns(prior, positions):
    """conv1 (8→16, 3×3, stride 2, pad 1) fitted on the dense model's input: rows = lstsq
    on the loop-im2col columns of the exposed dense input (at the drawn positions), x_p =
    x_d, ridge as augmented rows; bias = b + E[wᵀx_d] − E[w'ᵀx_d]; one dense pass."""
    model = load_model(conv_bn_folded())
    structure, masks, calib = _setup(model)
    repaired, rec = _dense_refit(model, masks, calib, prior, positions)
    la = next(la for la in structure.layers if la.node_name == "conv1")
    start, parts = 0, []
    for feeds in calib:
        xd = run_ort(model, feeds, [la.input])[la.input]
        cols = _im2col(xd, 3, 2, 1).reshape(len(xd), 16, -1)  # 4×4 output positions
        if positions is not None:
            pick = draw_positions(16, positions, seed=0,
                                  sample_indices=np.arange(start, start + len(xd)))
            cols = np.take_along_axis(cols, pick[:, :, None], axis=1)
        parts.append(cols.reshape(-1, cols.shape[-1]))
        start += len(xd)
    cd = np.concatenate(parts)
    index = GraphIndex(model)
    w = index.get_constant(la.weight).astype(np.float64).reshape(16, -1)
    b = index.get_constant(la.bias).astype(np.float64)
    mask = masks["conv1"].reshape(16, -1)
    ref = _lstsq_rows(cd, cd, w, mask, prior)
    node = GraphIndex(repaired).get_node("conv1")
    rindex = GraphIndex(repaired)
    got = rindex.get_constant(node.input[1]).astype(np.float64).reshape(16, -1)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    ref_b = b + (cd @ w.T).mean(0) - (cd @ ref.T).mean(0)
    np.testing.assert_allclose(rindex.get_constant(node.input[2]), ref_b, rtol=1e-4,
                               atol=1e-5 * np.abs(ref_b).max())
    r = rec.layers["conv1"]
    assert r.n_columns == len(cd) and r.error_after < r.error_before
    assert rec.passes == {"dense": 1, "sequential": 0, "segments": 0}
    assert rec.ls["inputs"] == "dense"


def test_dense_linear_rows_equal_lstsq_on_an_skl2onnx_mlp(tmp_path):
    """The head MatMul of a real skl2onnx MLP (weight stored (in, out)), dense inputs:
    rows = lstsq on the exposed dense hidden activations."""
    path, data = digits_mlp(tmp_path)
    model = load_model(path)
    x = np.load(data)["X"]
    calib = [{"X": x[i:i + 32]} for i in (0, 32)]
    structure, masks, calib = _setup(model, S=0.5, calib=calib)
    repaired, rec = _dense_refit(model, masks, calib, "weights", None)
    la = next(la for la in structure.layers if la.is_head)
    xd = np.concatenate([run_ort(model, f, [la.input])[la.input] for f in calib])
    w = GraphIndex(model).get_constant(la.weight).astype(np.float64).T  # (out, in)
    ref = _lstsq_rows(xd.astype(np.float64), xd.astype(np.float64), w,
                      masks[la.node_name].T, "weights")
    got = GraphIndex(repaired).get_constant(la.weight).astype(np.float64).T
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_dense_zero_pruning_is_the_identity_and_ls_bn_recalibrates():
    """Nothing pruned: nothing refitted, every weight unchanged. With BNs and ``ls+bn``,
    the refit takes one dense pass and the BN recalibration one sequential pass."""
    model = load_model(conv_bn_folded())
    structure, masks, calib = _setup(model, S=0.0)
    repaired, rec = _dense_refit(model, masks, calib, "weights", 4, method="ls+bn")
    for a, b in zip(model.graph.initializer, repaired.graph.initializer):
        assert a.name == b.name and a.raw_data == b.raw_data
    assert rec.layers == {} and rec.passes["dense"] == 0
    bn_model = load_model(conv_bn_chain())
    structure, masks, calib = _setup(bn_model)
    repaired, rec = _dense_refit(bn_model, masks, calib, "weights", 4, method="ls+bn")
    assert rec.bns and rec.passes["dense"] == 1 and rec.passes["sequential"] == 1
    assert all(v.error_after < v.error_before for v in rec.layers.values())


def test_dense_pass_results_equal_for_two_batch_splits():
    """The same 18 images in batches of 6 or of 4 + 8 + 6: the same refitted weights (the
    positions follow each image's global index; the moments merge)."""
    model = load_model(conv_bn_folded())
    structure, masks, calib = _setup(model)
    x = np.concatenate([f["x"] for f in calib])
    other = [{"x": x[a:b]} for a, b in ((0, 4), (4, 12), (12, 18))]
    first, _ = _dense_refit(model, masks, calib, "weights", 5)
    second, rec = _dense_refit(model, masks, other, "weights", 5)
    assert rec.layers
    for a, b in zip(first.graph.initializer, second.graph.initializer):
        np.testing.assert_allclose(numpy_helper.to_array(a), numpy_helper.to_array(b),
                                   rtol=1e-5, atol=1e-6)
    feeds = random_feeds(model, batch=5, seed=9)
    ya, yb = run_ort(first, feeds)["logits"], run_ort(second, feeds)["logits"]
    np.testing.assert_allclose(ya, yb, rtol=1e-4, atol=1e-5)


def test_dense_grouped_1d_and_fixed_batch_graphs():
    """A depthwise conv (group 8: columns permuted per batch, one λ per group), a 1-D conv
    (cut in NumPy) and a graph exported for batch 3 run on batches of 6 (ONNX Runtime runs
    it in pieces; each piece's row offsets come from the graph itself): every pruned layer
    is refitted and its output error falls; the fixed-batch graph's refit equals the
    dynamic one's."""
    for model in (load_model(depthwise_pointwise()), load_model(conv1d_head())):
        structure, masks, calib = _setup(model, S=0.5)
        _, rec = _dense_refit(model, masks, calib, "weights", 3)
        assert rec.layers and all(v.error_after <= v.error_before + 1e-9
                                  for v in rec.layers.values())
    assert len(_dense_refit(load_model(depthwise_pointwise()),
                            *_setup(load_model(depthwise_pointwise()), S=0.5)[1:], "weights",
                            3)[1].layers["dw"].lam) == 8
    dynamic, fixed = load_model(conv_bn_chain()), load_model(conv_bn_chain(batch=3))
    structure, masks, calib = _setup(dynamic)
    first, _ = _dense_refit(dynamic, masks, calib, "weights", 5)
    with pytest.warns(DataWarning, match="only runs at batch size 3"):
        second, _ = _dense_refit(fixed, masks, calib, "weights", 5)
    for a, b in zip(first.graph.initializer, second.graph.initializer):
        np.testing.assert_allclose(numpy_helper.to_array(a), numpy_helper.to_array(b),
                                   rtol=1e-5, atol=1e-6)
