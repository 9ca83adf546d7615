"""METHODS §C1 masks: exact counts, tie rule, prunable set, masks applied on a copy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from corpus import (
    constant_node_weights,
    depthwise_pointwise,
    mlp_head,
    random_feeds,
    residual_block,
    run_ort,
)
from onnx import TensorProto, helper, numpy_helper

from onnxdiag.errors import OnnxDiagError
from onnxdiag.graph import analyze_structure
from onnxdiag.model.io import load_model, model_hash
from onnxdiag.sparsity import (
    apply_masks,
    describe_layers,
    find_prunable,
    magnitude_mask,
    prune_count,
    read_weights,
)


def test_prune_count_is_exact_floor_of_the_decimal():
    assert prune_count(20, 0.95) == 19  # 0.95 * 20 is 18.999… in binary floating point
    assert prune_count(11_210_432, 0.9) == 10_089_388
    assert prune_count(7, 0.0) == 0 and prune_count(7, 1.0) == 7
    with pytest.raises(OnnxDiagError, match="outside"):
        prune_count(10, 1.5)


@pytest.mark.parametrize("size", [1, 7, 64, 1001])
@pytest.mark.parametrize("s", [0.0, 0.05, 0.5, 0.9, 0.99, 1.0])
def test_magnitude_mask_prunes_exactly_floor_s_n_keeping_the_largest(size, s):
    w = np.random.default_rng(size).normal(size=(size,)).astype(np.float32)
    mask = magnitude_mask(w, s)
    assert mask.dtype == bool and mask.shape == w.shape
    assert int((~mask).sum()) == prune_count(size, s)
    if mask.any() and (~mask).any():
        assert np.abs(w[mask]).min() >= np.abs(w[~mask]).max()


def test_magnitude_mask_ties_keep_the_lower_flat_index():
    w = np.array([[1.0, -1.0], [1.0, 0.5]])
    assert magnitude_mask(w, n_keep=2).tolist() == [[True, True], [False, False]]
    assert magnitude_mask(np.zeros(5), n_keep=2).tolist() == [True, True, False, False, False]


def test_find_prunable_is_every_conv_and_linear_layer():
    structure = analyze_structure(load_model(residual_block()))
    names = [la.node_name for la in find_prunable(structure)]
    assert sorted(names) == sorted(["stem", "c1", "c2", "c3", "c4", "proj", "head"])
    # an MLP's hidden Gemm is prunable like the head (METHODS §C1, §D; issue 16)
    assert [la.node_name for la in find_prunable(analyze_structure(load_model(mlp_head())))] \
        == ["fc1", "fc2"]


def test_find_prunable_rejects_unknown_keep_dense_names():
    structure = analyze_structure(load_model(residual_block()))
    assert len(find_prunable(structure, keep_dense=["stem", "head"])) == 7
    with pytest.raises(OnnxDiagError, match="'nope'.*stem"):
        find_prunable(structure, keep_dense=["stem", "nope"])


def test_describe_layers_shapes_and_projections():
    model = load_model(residual_block())
    infos = {i.name: i for i in describe_layers(model, find_prunable(analyze_structure(model)))}
    assert [n for n, i in infos.items() if i.is_projection] == ["proj"]
    assert infos["c3"].shape == (16, 8, 3, 3) and infos["head"].shape == (5, 16)
    assert infos["head"].is_head
    model = load_model(depthwise_pointwise())
    infos = {i.name: i for i in describe_layers(model, find_prunable(analyze_structure(model)))}
    assert infos["dw"].shape == (8, 1, 3, 3) and not infos["pw"].is_projection


def test_apply_masks_zeroes_on_a_copy():
    model = load_model(residual_block())
    before = model_hash(model)
    layers = find_prunable(analyze_structure(model))
    weights = read_weights(model, layers)
    masks = {name: magnitude_mask(w, 0.6) for name, w in weights.items()}
    out = apply_masks(model, masks)
    assert model_hash(model) == before
    onnx.checker.check_model(out, full_check=True)
    pruned = read_weights(out, layers)
    for name, mask in masks.items():
        np.testing.assert_array_equal(pruned[name], np.where(mask, weights[name], 0))
    run_ort(out, random_feeds(out))


def _shared_weight_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(3, 3, 3, 3)).astype(np.float32), "w")
    hw = numpy_helper.from_array(rng.normal(size=(2, 3)).astype(np.float32), "hw")
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], name="ca", pads=[1] * 4),
             helper.make_node("Conv", ["a", "w"], ["b"], name="cb", pads=[1] * 4),
             helper.make_node("GlobalAveragePool", ["b"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "hw"], ["logits"], name="head", transB=1)]
    graph = helper.make_graph(
        nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 2])], [w, hw])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return load_model(model)


def test_apply_masks_copies_a_shared_initializer_first():
    model = _shared_weight_model()
    w = read_weights(model, find_prunable(analyze_structure(model)))["ca"]
    out = apply_masks(model, {"ca": magnitude_mask(w, 0.5)})
    after = read_weights(out, find_prunable(analyze_structure(out)))
    assert int((after["ca"] == 0).sum()) == prune_count(w.size, 0.5)
    np.testing.assert_array_equal(after["cb"], w)
    onnx.checker.check_model(out, full_check=True)


def test_apply_masks_replaces_a_constant_node_weight_and_drops_it():
    model = load_model(constant_node_weights())
    layers = find_prunable(analyze_structure(model))
    w = read_weights(model, layers)["head"]
    out = apply_masks(model, {"head": magnitude_mask(w, 0.5)})
    assert "Constant" in [n.op_type for n in model.graph.node]
    assert [n.op_type for n in out.graph.node].count("Constant") == 1  # only the bias's is left
    onnx.checker.check_model(out, full_check=True)
    after = read_weights(out, find_prunable(analyze_structure(out)))["head"]
    assert int((after == 0).sum()) == prune_count(w.size, 0.5)


def test_apply_masks_user_errors():
    model = load_model(residual_block())
    with pytest.raises(OnnxDiagError, match="shape"):
        apply_masks(model, {"stem": np.ones((2, 2), bool)})
    with pytest.raises(OnnxDiagError, match="not in the model"):
        apply_masks(model, {"nope": np.ones((2, 2), bool)})


def test_magnitude_order_equals_a_stable_argsort_with_ties_and_signed_zeros():
    """The one-sort key path gives exactly the stable argsort of −|w| (ties: lower index
    first; −0 and +0 tie), and float64 / NaN weights take the argsort path."""
    from onnxdiag.sparsity.masks import magnitude_order

    rng = np.random.default_rng(1)
    cases = [rng.standard_normal((64, 3, 3, 3)).astype(np.float32),
             np.round(rng.standard_normal(5000), 1).astype(np.float32),  # many ties
             np.array([0.0, -0.0, 1.0, -1.0, 2.0, 0.0, np.inf, -np.inf], np.float32),
             rng.standard_normal(100), np.array([1.0, np.nan, -3.0], np.float32)]
    for w in cases:
        ref = np.argsort(-np.abs(w.astype(np.float64)).ravel(), kind="stable")
        got = magnitude_order(w)
        assert got.dtype == np.int64 and np.array_equal(got, ref)


def test_make_masks_with_a_cache_of_orders_are_the_magnitude_masks():
    """A sweep's cells reuse each layer's magnitude order; the masks are unchanged."""
    from types import SimpleNamespace

    from onnxdiag.sparsity import make_masks

    rng = np.random.default_rng(0)
    weights = {"a": rng.standard_normal((6, 3, 3, 3)).astype(np.float32),
               "b": np.round(rng.standard_normal((5, 7)), 1).astype(np.float32)}  # ties
    orders = {}
    for kept in ({"a": 40, "b": 9}, {"a": 0, "b": 35}, {"a": 162, "b": 1}):
        alloc = SimpleNamespace(n_kept=kept)
        plain, cached = make_masks(alloc, weights), make_masks(alloc, weights, orders)
        assert set(orders) == {"a", "b"}
        for name in weights:
            np.testing.assert_array_equal(cached[name], plain[name])
            assert cached[name].sum() == kept[name]
    with pytest.raises(ValueError, match="outside"):
        make_masks(SimpleNamespace(n_kept={"b": 36}), weights, orders)


def test_magnitude_levels_equal_the_ranks_of_magnitude_order():
    """The bucket selection gives every weight the level its keep-first rank gives it —
    ties (the lower index kept), ±0, ±inf, a single value throughout, float16, and the
    float64 / NaN fallback — for cuts that split buckets, share one, or keep all / none."""
    from onnxdiag.sparsity.masks import magnitude_levels, magnitude_order

    rng = np.random.default_rng(1)
    cases = [rng.standard_normal((64, 3, 3, 3)).astype(np.float32),
             np.round(rng.standard_normal(5000), 1).astype(np.float32),  # many ties
             np.array([0.0, -0.0, 1.0, -1.0, 2.0, 0.0, np.inf, -np.inf], np.float32),
             np.ones(1000, np.float32), rng.standard_normal(3001).astype(np.float16),
             np.array([5.0], np.float32), rng.standard_normal(100),
             np.array([1.0, np.nan, -3.0], np.float32)]
    for w in cases:
        ranks = np.empty(w.size, np.int64)
        ranks[magnitude_order(w)] = np.arange(w.size)
        for kept in ([w.size], [0], [w.size, w.size // 2, w.size // 2, 1, 0],
                     [w.size * 3 // 4, w.size // 3], range(w.size, -1, -max(1, w.size // 30))):
            kept = np.minimum.accumulate(list(kept))
            want = (kept[None, :] > ranks[:, None]).sum(axis=1)
            got = magnitude_levels(w, kept)
            assert got.dtype == np.uint8 and np.array_equal(got, want), (w.dtype, kept)
    many = np.arange(300, 0, -1)  # 300 levels: uint32
    assert magnitude_levels(rng.standard_normal(300).astype(np.float32), many).dtype == np.uint32
    with pytest.raises(ValueError, match="non-increasing"):
        magnitude_levels(np.ones(3, np.float32), [1, 2])
