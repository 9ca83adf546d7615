"""Export-time graph optimisation (onnxdiag.model.optimize): Conv+BN folding equals the
unfolded graph up to float rounding and leaves no foldable BN; redundant-node removal is
exact and keeps the graph outputs' names; what must not be folded or removed stays; the
input model is never modified; interleaved latency has the shape the reports read."""

from __future__ import annotations

import corpus
import numpy as np
import onnx
import pytest
from corpus import GraphBuilder, image_input, logits_output
from onnx import numpy_helper

from onnxdiag.model.finalize import EditError
from onnxdiag.model.optimize import check_equivalent, fold_bn_into, optimize_for_inference


def _ops(model) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _logits(model, feeds):
    return corpus.run_ort(model, feeds)["logits"].astype(np.float64)


@pytest.mark.parametrize("name, left", [("conv_bn_chain", 0), ("residual_block", 0),
                                        ("depthwise_pointwise", 0), ("preact_bn", 1)])
def test_folding_equals_the_unfolded_graph_up_to_float_rounding(name, left):
    """Every BN right after a Conv is folded (preact_bn's BN after a MaxPool stays), the
    logits agree to 1e-5 relative, and the source model is untouched."""
    model = corpus.CORPUS[name]()
    before = model.SerializeToString()
    folded, record = optimize_for_inference(model)
    assert model.SerializeToString() == before
    assert _ops(folded).count("BatchNormalization") == left
    assert len(record.folded) == _ops(model).count("BatchNormalization") - left
    onnx.checker.check_model(folded, full_check=True)
    feeds = corpus.random_feeds(model, batch=6)
    a, b = _logits(model, feeds), _logits(folded, feeds)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    assert {o.name for o in folded.graph.output} == {o.name for o in model.graph.output}
    gone = {f"{bn}.{k}" for _, bn in record.folded for k in ("scale", "bias", "mean", "var")}
    assert not gone & {t.name for t in folded.graph.initializer}


def test_fold_formula_matches_batchnorm_applied_after_the_conv():
    """W'·x + b' = γ (W·x + b − μ)/√(σ² + ε) + β for a 1×1 conv, by brute force."""
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((4, 3, 1, 1)), rng.standard_normal(4)
    gamma, beta, mu = rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(4)
    var = rng.uniform(0.5, 2, 4)
    x = rng.standard_normal(3)
    y = w[:, :, 0, 0] @ x + b
    want = gamma * (y - mu) / np.sqrt(var + 1e-3) + beta
    w2, b2 = fold_bn_into(w, b, gamma, beta, mu, var, epsilon=1e-3)
    np.testing.assert_allclose(w2[:, :, 0, 0] @ x + b2, want, rtol=1e-12)
    w3, b3 = fold_bn_into(w, None, gamma, beta, mu, var, epsilon=1e-3)  # no conv bias
    np.testing.assert_allclose(w3[:, :, 0, 0] @ x + b3, want - gamma * b / np.sqrt(var + 1e-3),
                               rtol=1e-12)


def _shared_and_tapped():
    """c0 → bn0 (c0's output is also a graph output: not foldable); c1 and c2 share one
    weight, c1 → bn1 (foldable, so the weight is copied for c1), c2 → Relu."""
    g = GraphBuilder(0)
    c0 = g.conv("x", "c0", 3, 4)
    r0 = g.node("Relu", [g.bn(c0, "bn0", 4)], "relu0")
    w = g.rand("shared.weight", 4, 4, 3, 3)
    c1 = g.node("Conv", [r0, w], "c1", pads=[1] * 4)
    c2 = g.node("Conv", [r0, w], "c2", pads=[1] * 4)
    s = g.node("Add", [g.bn(c1, "bn1", 4), g.node("Relu", [c2], "relu2")], "sum")
    g.gemm(g.pool_flatten(s), "head", 4, corpus.N_CLASSES, out="logits")
    return g.model([image_input()], [logits_output(), corpus.value_info("c0", ("N", 4, 8, 8))])


def test_what_cannot_be_folded_stays_and_a_shared_weight_is_copied():
    model = _shared_and_tapped()
    folded, record = optimize_for_inference(model)
    assert record.folded == (("c1", "bn1"),)
    assert [n.name for n in folded.graph.node if n.op_type == "BatchNormalization"] == ["bn0"]
    nodes = {n.name: n for n in folded.graph.node}
    assert nodes["c2"].input[1] == "shared.weight" and nodes["c1"].input[1] != "shared.weight"
    feeds = corpus.random_feeds(model, batch=3)
    a, b = corpus.run_ort(model, feeds), corpus.run_ort(folded, feeds)
    for key in ("logits", "c0"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-5)
    kept, rec = optimize_for_inference(corpus.conv_bn_chain(), keep=["conv1"])
    assert rec.folded == (("conv0", "bn0"),) and "conv1" in {o for n in kept.graph.node
                                                           for o in n.output}
    none, rec = optimize_for_inference(corpus.conv_bn_chain(), fold_bn=False)
    assert not rec.changed and _ops(none).count("BatchNormalization") == 2


def test_a_computed_weight_is_not_folded():
    """A Conv whose weight is dequantized at run time keeps its BN: folding would store the
    weight in float32 (a QDQ model would grow 4×)."""
    g = GraphBuilder(0)
    q = g.init("w_q", g.rng.integers(-100, 100, (4, 3, 3, 3)).astype(np.int8))
    w = g.node("DequantizeLinear", [q, g.init("w_scale", np.float32(0.01))], "dq")
    c = g.node("Conv", ["x", w], "c0", pads=[1] * 4)
    g.gemm(g.pool_flatten(g.bn(c, "bn0", 4)), "head", 4, corpus.N_CLASSES, out="logits")
    model = g.model([image_input()], [logits_output()])
    out, record = optimize_for_inference(model)
    assert not record.folded and "BatchNormalization" in _ops(out)


def _redundant():
    """Identity, inference Dropout, Cast to float, an identity Transpose, a Transpose pair
    that cancels, one that composes, a Reshape pair, a same-shape Flatten and Reshape, and the graph
    output "logits" produced by an Identity."""
    g = GraphBuilder(0)
    a = g.node("Identity", [g.conv("x", "c0", 3, 4)], "ident")
    a = g.node("Dropout", [a], "drop")
    a = g.node("Cast", [a], "cast", to=onnx.TensorProto.FLOAT)
    a = g.node("Transpose", [a], "t_id", perm=[0, 1, 2, 3])
    a = g.node("Transpose", [g.node("Transpose", [a], "t1", perm=[0, 2, 3, 1])], "t1_back",
               perm=[0, 3, 1, 2])
    a = g.node("Transpose", [g.node("Transpose", [a], "t2", perm=[0, 1, 3, 2])], "t2_next",
               perm=[0, 2, 1, 3])  # composed: (0, 3, 1, 2) of the input
    a = g.node("Relu", [a], "relu")
    flat = g.init("flat", np.array([-1, 256], np.int64))
    a = g.node("Reshape", [g.node("Reshape", [a, g.init("split", np.array([-1, 2, 128],
                                                                          np.int64))], "r1"),
                           flat], "r2")
    a = g.node("Reshape", [a, g.init("flat_again", np.array([-1, 256], np.int64))], "r_same")
    a = g.node("Flatten", [a], "f_same", axis=1)
    a = g.gemm(a, "head", 256, corpus.N_CLASSES, out="gemm_out")
    a = g.node("Reshape", [a, g.init("same", np.array([-1, corpus.N_CLASSES], np.int64))],
               "r_noop")
    g.node("Identity", [a], "out_id", "logits")
    return g.model([image_input()], [logits_output()])


def test_redundant_nodes_go_exactly_and_the_outputs_keep_their_names():
    model = _redundant()
    simple, record = optimize_for_inference(model)
    gone = {name for name, _ in record.removed}
    # r1 and r2 skipped: r_same then reshapes the Relu's output
    assert gone == {"ident", "drop", "cast", "t_id", "t1", "t1_back", "t2", "r1", "r2",
                    "f_same", "r_noop", "out_id"}
    assert _ops(simple) == ["Conv", "Transpose", "Relu", "Reshape", "Gemm"]
    transpose = next(n for n in simple.graph.node if n.op_type == "Transpose")
    assert list(transpose.attribute[0].ints) == [0, 3, 1, 2]
    assert [o.name for o in simple.graph.output] == ["logits"]
    feeds = corpus.random_feeds(model, batch=3)
    np.testing.assert_array_equal(corpus.run_ort(simple, feeds)["logits"],
                                  corpus.run_ort(model, feeds)["logits"])
    same, rec = optimize_for_inference(model, simplify=False)
    assert not rec.changed and _ops(same) == _ops(model)


def test_kept_tensors_and_used_dropout_masks_stay():
    g = GraphBuilder(0)
    c = g.conv("x", "c0", 3, 4)
    g.nodes.append(onnx.helper.make_node("Dropout", [c], ["d", "mask"], name="drop"))
    feat = g.node("Identity", ["d"], "feat")
    g.gemm(g.pool_flatten(feat), "head", 4, corpus.N_CLASSES, out="logits")
    model = g.model([image_input()], [logits_output(),
                                      corpus.value_info("mask", ("N", 4, 8, 8),
                                                        onnx.TensorProto.BOOL)])
    out, record = optimize_for_inference(model, keep=["feat"])
    assert not record.removed and _ops(out) == _ops(model)


def test_check_equivalent_refuses_a_changed_model():
    model = corpus.conv_bn_chain()
    folded, _ = optimize_for_inference(model)
    feeds = corpus.random_feeds(model, batch=4)
    assert check_equivalent(model, folded, feeds)["max_rel_output_diff"] < 1e-5
    broken = onnx.ModelProto()
    broken.CopyFrom(folded)
    init = next(t for t in broken.graph.initializer if t.name == "head.bias")
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + 1, init.name))
    with pytest.raises(EditError, match="differ from the unoptimised one"):
        check_equivalent(model, broken, feeds)


def test_compare_latency_interleaves_and_reports_the_spread():
    from onnxdiag.runtime.latency import compare_latency

    model = corpus.conv_bn_chain()
    x = corpus.random_feeds(model, batch=4)
    out = compare_latency(model, optimize_for_inference(model)[0], {1: {"x": x["x"][:1]},
                                                                   4: x}, rounds=3, threads=1)
    assert set(out) == {"source", "emitted", "speedup", "speedup_iqr", "rounds", "rounds_run",
                        "budget_s", "threads"}
    assert out["rounds"] == 3 and out["threads"] == 1 and out["rounds_run"] == {"1": 3, "4": 3}
    for b in ("1", "4"):
        assert out["source"][b] > 0 and out["emitted"][b] > 0
        assert out["speedup"][b] == pytest.approx(out["source"][b] / out["emitted"][b])
        lo, hi = out["speedup_iqr"][b]
        assert 0 < lo <= hi


def test_latency_rounds_fit_the_budget_between_the_floor_and_the_cap():
    from onnxdiag.runtime.latency import MIN_ROUNDS, planned_rounds

    assert MIN_ROUNDS == 5
    # budget // round, clamped to [5, rounds]; no budget: every round asked for
    assert [planned_rounds(r, 21, 10.0) for r in (0.1, 0.5, 0.6, 2.0, 3.0, 60.0)] == \
        [21, 20, 16, 5, 5, 5]
    assert planned_rounds(3.0, 21, None) == 21 and planned_rounds(0.0, 21, 10.0) == 21
    assert planned_rounds(9.0, 3, 1.0) == 3  # fewer rounds asked for than the floor


@pytest.mark.parametrize("budget, expected", [(0.0, 5), (None, 8)])
def test_compare_latency_runs_the_planned_rounds_only(budget, expected, monkeypatch):
    """Every session runs two warm-ups and then exactly the planned rounds per batch size:
    a zero budget the floor of 5, no budget every round asked for."""
    from onnxdiag.runtime import runner as runner_module
    from onnxdiag.runtime.latency import compare_latency

    calls = []
    real = runner_module.OrtRunner.run

    def counted(self, feeds, *args, **kwargs):
        calls.append(id(self))
        return real(self, feeds, *args, **kwargs)

    monkeypatch.setattr(runner_module.OrtRunner, "run", counted)
    model = corpus.conv_bn_chain()
    x = corpus.random_feeds(model, batch=2)
    out = compare_latency(model, model, {1: {"x": x["x"][:1]}, 2: x}, rounds=8,
                          budget_s=budget)
    assert out["rounds_run"] == {"1": expected, "2": expected} and out["budget_s"] == budget
    per_session = {k: calls.count(k) for k in set(calls)}
    assert sorted(per_session.values()) == [2 * (2 + expected)] * 2
