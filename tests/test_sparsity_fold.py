"""METHODS §C1 repairs folded into linear layers built in code: Gemm alpha / beta and both
layouts, a BatchNormalization after a Gemm, a MatMul without bias given one, LayerNorm
detection (§D)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from corpus import GraphBuilder, random_feeds, run_ort, value_info

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
from onnxdiag.sparsity.fold import has_layer_norm


def _mlp(hidden: str, trans_b: bool = True, bn: bool = False, seed: int = 0) -> onnx.ModelProto:
    """x (N,12) → hidden layer "fc1" (24) [→ BN "bn1"] → Relu → Gemm "head" (5).

    ``hidden``: "gemm" (alpha 0.5, beta 2, bias), "gemm_nobias", "matmul" (no bias)."""
    g = GraphBuilder(seed)
    if hidden == "matmul":
        h = g.node("MatMul", ["x", g.rand("fc1.weight", 12, 24)], "fc1")
    else:
        w = g.rand("fc1.weight", *((24, 12) if trans_b else (12, 24)))
        ins = ["x", w] + ([g.rand("fc1.bias", 24, scale=0.3)] if hidden == "gemm" else [])
        h = g.node("Gemm", ins, "fc1", transB=int(trans_b), alpha=0.5, beta=2.0)
    if bn:
        h = g.bn(h, "bn1", 24)
    g.gemm(g.node("Relu", [h], "act"), "head", 24, 5, out="logits")
    return g.model([value_info("x", ("N", 12))], [value_info("logits", ("N", 5))])


def _repair(model, method, S=0.6):
    model = load_model(model)
    structure = analyze_structure(model)
    layers = find_prunable(structure)
    weights = read_weights(model, layers)
    alloc = allocate_sparsity("uniform", describe_layers(model, layers), S, weights=weights)
    masks = make_masks(alloc, weights)
    calib = [random_feeds(model, batch=16, seed=i) for i in range(3)]
    out, record = repair_model(model, structure, masks, calib, method=method)
    return model, out, record, calib


def _stats(model, calib, tensor):
    y = np.concatenate([run_ort(model, f, [tensor])[tensor] for f in calib]).astype(np.float64)
    return y.mean(0), y.std(0, ddof=1)


@pytest.mark.parametrize("hidden, trans_b", [("gemm", True), ("gemm", False),
                                             ("gemm_nobias", True), ("matmul", False)])
def test_cr_matches_the_variance_and_the_affine_the_mean_of_a_hidden_linear_layer(hidden,
                                                                                   trans_b):
    """Gemm's alpha / beta and both layouts, with and without a bias: CR matches each
    feature's std at fc1's output; the ``bn`` affine (no BN, no LayerNorm) also its mean."""
    model, out, record, calib = _repair(_mlp(hidden, trans_b), "cr")
    dense_mean, dense_std = _stats(model, calib, "fc1")
    np.testing.assert_allclose(_stats(out, calib, "fc1")[1], dense_std, rtol=2e-4)
    assert record.layers["fc1"].kind == "scale"
    model, out, record, calib = _repair(_mlp(hidden, trans_b), "bn")
    assert record.layers["fc1"].kind == "affine" and not record.notes
    mean, std = _stats(out, calib, "fc1")  # fc1 names the biased output (a new Add for MatMul)
    np.testing.assert_allclose(std, dense_std, rtol=2e-4)
    np.testing.assert_allclose(mean, dense_mean, atol=1e-4 * dense_std.max())
    onnx.checker.check_model(out, full_check=True)
    if hidden == "matmul":
        adds = [n for n in out.graph.node if n.op_type == "Add" and "fc1" in n.output]
        assert len(adds) == 1 and adds[0].input[0] == "fc1_prebias"


def test_bn_after_a_gemm_is_recalibrated_to_the_repaired_models_own_statistics():
    model, out, record, calib = _repair(_mlp("gemm", bn=True), "cr+bn")
    assert list(record.bns) == ["bn1"] and record.layers["fc1"].kind == "scale"
    index = GraphIndex(out)
    bn = index.get_node("bn1")
    mean, std = _stats(out, calib, bn.input[0])
    np.testing.assert_allclose(index.get_constant(bn.input[3]), mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(index.get_constant(bn.input[4]), std ** 2, rtol=1e-4, atol=1e-6)


def test_the_head_is_pruned_but_never_rescaled():
    model, out, record, _ = _repair(_mlp("gemm"), "cr+bn")
    assert "head" not in record.layers
    w = read_weights(model, find_prunable(analyze_structure(model)))["head"]
    kept = read_weights(out, find_prunable(analyze_structure(out)))["head"]
    np.testing.assert_array_equal(kept[kept != 0], w[kept != 0])


def _norm_graph(kind: str) -> onnx.ModelProto:
    """x (N,T,8) normalised over the last axis: ``op`` (LayerNormalization), ``decomposed``
    (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div), ``rms`` (Mul(x, x), ReduceMean,
    …), or ``spatial`` (a mean of squares over axis 1: not a LayerNorm)."""
    g = GraphBuilder(0)
    if kind == "op":
        y = g.node("LayerNormalization", ["x", g.init("g", np.ones(8)), g.init("b", np.zeros(8))],
                   "ln", axis=-1)
    else:
        axes = [1] if kind == "spatial" else [-1]
        c = "x" if kind in ("rms", "spatial") else g.node("Sub", ["x", g.node(
            "ReduceMean", ["x"], "mu", axes=axes)], "centre")
        sq = (g.node("Mul", [c, c], "sq") if kind in ("rms", "spatial") else
              g.node("Pow", [c, g.init("two", np.array(2.0, np.float32))], "sq"))
        var = g.node("ReduceMean", [sq], "var", axes=axes)
        y = g.node("Div", [c, g.node("Sqrt", [var], "sd")], "ln")
    g.node("Identity", [y], "out", "y")
    return g.model([value_info("x", ("N", 4, 8))], [value_info("y", ("N", 4, 8))], opset=17)


@pytest.mark.parametrize("kind, expected", [("op", True), ("decomposed", True), ("rms", True),
                                            ("spatial", False)])
def test_layer_norm_is_found_as_an_op_or_written_out(kind, expected):
    assert has_layer_norm(GraphIndex(_norm_graph(kind))) is expected
    assert not has_layer_norm(GraphIndex(_mlp("gemm")))


def test_repair_record_notes_reach_the_prune_report(tmp_path):
    """A LayerNorm model pruned with the default cr+bn says that its BN part acted on no
    linear layer (the notes of the report section and the sidecar)."""
    import json

    from onnxdiag.commands.base import ReportTarget, Runtime
    from onnxdiag.commands.prune import PruneOptions, prune_report_sparse

    g = GraphBuilder(1)
    h = g.node("MatMul", ["x", g.rand("fc1.weight", 8, 8)], "fc1")
    h = g.node("LayerNormalization", [h, g.init("g", np.ones(8)), g.init("b", np.zeros(8))],
               "ln", axis=-1)
    pooled = g.node("ReduceMean", [h], "pool", axes=[1], keepdims=0)
    g.gemm(pooled, "head", 8, 3, out="logits")
    model = g.model([value_info("x", ("N", 4, 8))], [value_info("logits", ("N", 3))])
    src, data = tmp_path / "ln.onnx", tmp_path / "d.npz"
    onnx.save(model, src)
    np.savez(data, x=np.random.default_rng(0).standard_normal((16, 4, 8)).astype(np.float32))
    out = tmp_path / "p.onnx"
    info = prune_report_sparse(str(src), output=out, data=str(data),
                               options=PruneOptions(sparsity=0.5, allocation="uniform"),
                               runtime=Runtime(progress=False),
                               report=ReportTarget(write=False)).report["prune"]
    assert any("nothing to act on in 1 linear layer(s)" in n for n in info["notes"])
    assert json.loads((tmp_path / "p.onnx.json").read_text())["notes"] == info["notes"]
    onnx.checker.check_model(str(out), full_check=True)
