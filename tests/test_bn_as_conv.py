"""An exposed conv's BatchNormalization before a ReLU6 becomes a 1×1 depthwise Conv in the
statistics graph (onnxdiag/model/expose.py: ``bn_as_depthwise_conv``), so that ONNX
Runtime's CPU optimiser keeps the Clip fused and the tensor in its blocked layout: the same
affine map to float32 rounding, the exposed tensors untouched, the statistics unchanged."""

from __future__ import annotations

import collections

import corpus
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxdiag.channels.collect import (
    StatsRunner,
    _stats_model,
    collect_channel_moments,
    find_analysed_layers,
    make_stats_runner,
)
from onnxdiag.channels.taps import choose_taps
from onnxdiag.data.source import open_data
from onnxdiag.graph import analyze_structure
from onnxdiag.model import io as model_io
from onnxdiag.model.expose import bn_as_depthwise_conv, expose_tensors


def _conv_outputs(model) -> dict:
    return {n.output[0]: 4 for n in model.graph.node if n.op_type == "Conv"}


def _ort_ops(model) -> collections.Counter:
    """The op types of ONNX Runtime's optimised CPU graph of ``model``."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = str(Path(tmp) / "optimised.onnx")
        opts.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), opts,
                             providers=["CPUExecutionProvider"])
        return collections.Counter(n.op_type for n in onnx.load(opts.optimized_model_filepath)
                                   .graph.node)


def _run(model, feeds, disable=False) -> dict:
    opts = ort.SessionOptions()
    if disable:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


@pytest.mark.parametrize("build", [corpus.relu6_constant_clip, corpus.depthwise_pointwise])
def test_the_statistics_graph_keeps_every_relu6_fused(build):
    """With the pre-BN conv outputs exposed, ONNX Runtime leaves each BN-then-Clip as a
    standalone Clip; the CPU statistics graph (BN as a depthwise Conv) has none left and
    the same number of reorders out of the blocked layout (one per exposed tensor)."""
    model = model_io.load_model(build())
    structure = analyze_structure(model)
    chosen = find_analysed_layers(structure)
    taps = choose_taps(model, chosen, "output", "match", 16)
    n_clips = sum(n.op_type == "Clip" for n in model.graph.node)
    before = _ort_ops(_stats_model(model, chosen, structure.head, taps, cpu=False)[0])
    after = _ort_ops(_stats_model(model, chosen, structure.head, taps, cpu=True)[0])
    assert before["Clip"] == n_clips > 0  # the failure this rewrite removes
    assert after["Clip"] == 0 and after["ReorderInput"] == 0
    assert after["ReorderOutput"] <= before["ReorderOutput"]


def test_the_depthwise_conv_computes_the_batch_normalization():
    """Every tensor of the rewritten graph (BN outputs, Clips, logits) equals the original
    one's to float32 rounding, with an epsilon other than the default and ONNX Runtime's
    own rewrites off (its BN kernel against our Conv); the conv outputs are bit-identical."""
    model = model_io.load_model(corpus.relu6_constant_clip(seed=3))
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            node.attribute[0].f = 1e-2
    every = [t for n in model.graph.node for t in n.output if n.op_type != "Constant"]
    exposed = expose_tensors(model, every)
    rewritten, names = bn_as_depthwise_conv(exposed, _conv_outputs(model))
    assert sorted(names) == ["bn0", "bn1"]
    assert [n.op_type for n in rewritten.graph.node if n.name in names] == ["Conv", "Conv"]
    onnx.checker.check_model(rewritten, full_check=True)
    feeds = corpus.random_feeds(model, batch=6, seed=1)
    a, b = _run(exposed, feeds, disable=True), _run(rewritten, feeds, disable=True)
    assert a.keys() == b.keys()
    for name in a:
        scale = np.abs(a[name]).max() + 1e-30
        assert np.abs(a[name] - b[name]).max() <= 2e-6 * scale, name
    for conv in _conv_outputs(model):
        if conv.startswith("conv0"):
            np.testing.assert_array_equal(a[conv], b[conv])


def test_only_a_bn_of_an_exposed_conv_before_a_clip_is_rewritten():
    """In a MobileNet block only the depthwise conv's BN (before ReLU6) changes, and only
    when its conv output is exposed; a BN before Relu, one in training mode, and a model
    with nothing to rewrite (returned as it is) stay; the input model is never modified."""
    model = model_io.load_model(corpus.depthwise_pointwise())
    original = model.SerializeToString()
    convs = _conv_outputs(model)
    out, names = bn_as_depthwise_conv(model, convs)
    assert names == ["dw_bn"] and model.SerializeToString() == original
    assert [n.op_type for n in out.graph.node].count("BatchNormalization") == 2
    dw = next(n.output[0] for n in model.graph.node if n.name == "dw")
    same, none = bn_as_depthwise_conv(model, {t: r for t, r in convs.items() if t != dw})
    assert same is model and none == []
    training = onnx.ModelProto()
    training.CopyFrom(model)
    bn = next(n for n in training.graph.node if n.name == "dw_bn")
    bn.attribute.append(onnx.helper.make_attribute("training_mode", 1))
    assert bn_as_depthwise_conv(training, convs)[1] == []


def test_channel_statistics_are_those_of_the_graph_as_exported():
    """The statistics of every layer from the CPU statistics graph equal those from the
    graph without the rewrite to float32 rounding; the first layer's channel block (its
    conv is upstream of any rewritten BN; the logit margin columns are not) bit for bit."""
    model = model_io.load_model(corpus.depthwise_pointwise())
    structure = analyze_structure(model)
    feeds = corpus.random_feeds(model, batch=40, seed=2, size=9)
    y = np.random.default_rng(0).integers(0, 5, 40)
    chosen = find_analysed_layers(structure)
    taps = choose_taps(model, chosen, "output", "match", 5)
    plain = _stats_model(model, chosen, structure.head, taps, cpu=False)[0]
    runners = {"cpu": make_stats_runner(model, structure, n_positions=5, providers="cpu"),
               "as exported": StatsRunner(plain, providers="cpu")}
    assert runners["cpu"]._model is not plain and any(
        n.name == "dw_bn" and n.op_type == "Conv" for n in runners["cpu"]._model.graph.node)
    stats = {k: collect_channel_moments(
        model, structure, open_data({**feeds, "labels": y}, model_io.get_input_specs(model),
                                    batch_size=16), seed=1, n_positions=5, runner=r)
        for k, r in runners.items()}
    first = chosen[0].node_name
    for name, lm in stats["cpu"].layers.items():
        other = stats["as exported"].layers[name]
        scale = np.sqrt(np.diag(other.task.cov()))
        err = np.abs(lm.task.cov() - other.task.cov()) / np.outer(scale, scale)
        assert err.max() < 1e-5, name
        if name == first:
            c = chosen[0].n_out
            np.testing.assert_array_equal(lm.task.cov()[:c, :c], other.task.cov()[:c, :c])


def test_the_rr_capture_keeps_every_relu6_fused_with_the_same_curves(monkeypatch):
    """The RR capture exposes the layers' pre-BN outputs for the repairs' dense moments; on
    CPU its BNs before a ReLU6 run as depthwise Convs (no standalone Clip in ONNX Runtime's
    graph), and the curves and moments equal those of the capture without the rewrite to
    float32 rounding."""
    from onnxdiag.graph import GraphIndex
    from onnxdiag.sparsity import DEFAULT_GRID, compute_rr_curves, find_prunable, rr_capture
    from onnxdiag.sparsity.rr_layer import plan_layer

    model = model_io.load_model(corpus.depthwise_pointwise())
    layers = find_prunable(analyze_structure(model))
    index = GraphIndex(model)
    plans = [plan_layer(index, la, DEFAULT_GRID) for la in layers]
    cap = rr_capture.capture_session(model, index, layers, plans, 16, 0, "cpu", None,
                                     outputs=[la.output for la in layers])
    assert any(n.name == "dw_bn" and n.op_type == "Conv" for n in cap.runner._model.graph.node)
    assert _ort_ops(cap.runner._model)["Clip"] == 0
    feeds = [corpus.random_feeds(model, batch=12, seed=s, size=9) for s in range(3)]

    def curves():
        return compute_rr_curves(model, layers, feeds, n_images=36, output_moments=True,
                                 providers="cpu")

    new = curves()
    monkeypatch.setattr(rr_capture, "bn_as_depthwise_conv", lambda graph, tensors: (graph, []))
    old = curves()
    for field in ("d_raw", "d_repair", "rr"):
        np.testing.assert_allclose(getattr(new, field), getattr(old, field), rtol=1e-5,
                                   atol=1e-9, err_msg=field)
    for name, m in old.output_moments.items():
        other, scale = new.output_moments[name], np.sqrt(m.var())
        assert other.n == m.n and np.abs(other.mean - m.mean).max() < 1e-5 * scale.max()
        np.testing.assert_allclose(other.var(), m.var(), rtol=1e-5, err_msg=name)
