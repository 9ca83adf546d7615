"""A conv whose input is act(BN(y)) of another analysed layer's exposed output y is tapped
there (``onnxdiag/channels/taps.py``: ``DerivedInputTap``): its input is computed at the
sampled patches, padding after the activation, and the conv evaluated in float64; its own
output is not exposed. Same samples as the output tap, to float32 rounding."""

from __future__ import annotations

import corpus
import numpy as np
import onnxruntime as ort
import pytest

from onnxdiag.channels.collect import collect_channel_moments, find_analysed_layers
from onnxdiag.channels.taps import DerivedInputTap, _bn_act_chain, _input_tap, choose_taps
from onnxdiag.data.source import open_data
from onnxdiag.graph import GraphIndex, analyze_structure
from onnxdiag.model import io as model_io
from onnxdiag.model.expose import expose_channels_last
from onnxdiag.stats import draw_positions

N = 24


def _derived(model, layer_name):
    index = GraphIndex(model)
    la = next(la for la in find_analysed_layers(analyze_structure(model))
              if la.node_name == layer_name)
    base, chain = _input_tap(index, la), _bn_act_chain(index, la.input)
    assert chain is not None
    return la, DerivedInputTap(base.op, base.kernel, base.matrix, base.bias, *chain)


@pytest.mark.parametrize("build, layer, act", [
    (corpus.depthwise_pointwise, "dw", (0.0, np.inf)),  # Relu(BN(c0)), 3×3 depthwise, pad 1
    (corpus.relu6_constant_clip, "conv1", (0.0, 6.0)),  # Clip(BN(conv0)) bounds from
    # Constant nodes, 3×3 stride 2
    (corpus.depthwise_pointwise, "pw", (0.0, 6.0)),  # Clip(BN(dw)) with initializer bounds
])
@pytest.mark.parametrize("positions", [3, 100])  # sampled patches; every position
def test_derived_samples_equal_the_output_taps(build, layer, act, positions):
    """The derived tap's rows equal the layer's own output at the same drawn positions
    (ONNX Runtime, every optimisation off) to float32 rounding, where patches reach into
    the padding too, from the source's channels-last copy alone."""
    model = model_io.load_model(build())
    la, tap = _derived(model, layer)
    assert (tap.lo, tap.hi) == act
    exposed, names = expose_channels_last(model, {tap.source: 4, la.output: 4})
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(exposed.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    feeds = corpus.random_feeds(model, batch=5, seed=4)
    src, out = sess.run([names[tap.source], names[la.output]], feeds)
    indices = np.arange(10, 15)
    got = tap.samples(src, indices, positions, seed=2)
    n, h, w, c = out.shape
    pos = draw_positions(h * w, positions, seed=2, sample_indices=indices)
    want = out.reshape(n, h * w, c)[np.arange(n)[:, None], pos].reshape(-1, c)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _depthwise_multiplier():
    """c0 (3→4) → bn → Clip(0, 6) → "dw" (3×3, group 4, 4→8: two outputs per channel,
    stride 2, pad 1, bias) → bn → Relu → GAP → Gemm head."""
    g = corpus.GraphBuilder(3)
    c0 = g.bn(g.conv("x", "c0", 3, 4, bias=False), "c0_bn", 4)
    r0 = g.node("Clip", [c0, g.init("lo", np.array(0, np.float32)),
                         g.init("hi", np.array(6, np.float32))], "relu6")
    dw = g.conv(r0, "dw", 4, 8, stride=2, group=4)
    r1 = g.node("Relu", [g.bn(dw, "dw_bn", 8)], "relu1")
    g.gemm(g.pool_flatten(r1), "head", 8, corpus.N_CLASSES, out="logits")
    return g.model([corpus.image_input()], [corpus.logits_output()])


@pytest.mark.parametrize("derived", [False, True])
@pytest.mark.parametrize("positions", [3, 100])
def test_depthwise_taps_sum_in_float32_as_the_conv_does(derived, positions):
    """A depthwise conv's input tap (plain or derived; channel multiplier 2, stride 2, pad
    1, bias) sums its kh·kw products per output in float32 from the channels-last patches:
    ONNX Runtime's own output at the drawn positions, and the float64 columns' product, to
    float32 rounding."""
    from onnxdiag.sparsity.offline import apply_columns, sampled_columns

    model = model_io.load_model(_depthwise_multiplier())
    la, tap = _derived(model, "dw")
    if not derived:
        tap = _input_tap(GraphIndex(model), la)
    assert tap.depthwise and tap.matrix.shape == (4, 9, 2)
    exposed, names = expose_channels_last(model, {tap.reads(la): 4, la.output: 4})
    got_all = corpus.run_ort(exposed, corpus.random_feeds(model, batch=5, seed=4))
    src, out = got_all[names[tap.reads(la)]], got_all[names[la.output]]
    indices = np.arange(3, 8)
    got = tap.samples(src, indices, positions, seed=5)
    n, h, w, c = out.shape
    pos = draw_positions(h * w, positions, seed=5, sample_indices=indices)
    want = out.reshape(n, h * w, c)[np.arange(n)[:, None], pos].reshape(-1, c)
    assert got.shape == want.shape and (positions > h * w or got.dtype == np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    cols = sampled_columns(tap.op, np.moveaxis(src, -1, 1), tap.kernel, positions, seed=5,
                           sample_indices=indices, x_last=src,
                           transform=getattr(tap, "_input", None) if derived else None)
    exact = apply_columns(cols.astype(np.float64), tap.matrix) + tap.bias
    np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-6 * np.abs(exact).max())


def test_auto_derives_a_layer_only_where_it_saves_an_exposure(monkeypatch):
    """"auto" derives an output-tapped layer only where its float64 work is at most
    DERIVE_SHARE (grouped convs) or DERIVE_DENSE_SHARE (ungrouped) of its output's values:
    none of this 8×8 MobileNet block's at shares of 1/16; at the default dense share the
    1×1 pointwise conv; at share 1 and one position per image, a conv read through a BN
    from the exposed first conv (so the first conv keeps its output tap and the derived
    output is not exposed). The statistics of every layer equal those of output taps to
    float32 rounding. Of two layers in a row only one is derived."""
    from onnxdiag.channels import taps as taps_module

    model = model_io.load_model(corpus.depthwise_pointwise())
    structure = analyze_structure(model)
    chosen = find_analysed_layers(structure)

    def derived_now():
        return sorted(name for name, t in choose_taps(model, chosen, "auto",
                                                       n_positions=1).items()
                      if isinstance(t, DerivedInputTap))

    assert derived_now() == ["pw"]  # the default dense share: 1·8·16 ≤ 4 · 16·64
    monkeypatch.setattr(taps_module, "DERIVE_DENSE_SHARE", 1 / 16)
    assert derived_now() == []
    monkeypatch.setattr(taps_module, "DERIVE_SHARE", 1.0)
    monkeypatch.setattr(taps_module, "DERIVE_DENSE_SHARE", 1.0)
    taps = choose_taps(model, chosen, "auto", n_positions=1)
    kinds = {name: type(t).__name__ if not isinstance(t, str) else t
             for name, t in taps.items()}
    derived = [name for name, kind in kinds.items() if kind == "DerivedInputTap"]
    assert derived and all(kinds[name] == "output" for name in ("c0",))
    assert not {"dw", "pw"} <= set(derived)  # pw reads dw's output: not both
    feeds = corpus.random_feeds(model, batch=N, seed=2)
    y = np.random.default_rng(0).integers(0, 5, N)

    def stats(tap):
        source = open_data({**feeds, "labels": y}, model_io.get_input_specs(model),
                           batch_size=7)
        return collect_channel_moments(model, structure, source, seed=1, n_positions=1,
                                       tap=tap, targets="labels")

    auto, output = stats("auto"), stats("output")
    for la in chosen:
        a, b = auto.layers[la.node_name].task, output.layers[la.node_name].task
        c = la.n_out
        scale = np.sqrt(np.diag(b.cov()[:c, :c]))
        err = np.abs(a.cov()[:c, :c] - b.cov()[:c, :c]) / np.outer(scale, scale)
        assert err.max() < 1e-5, la.node_name
        np.testing.assert_allclose(a.mean[:c], b.mean[:c], atol=1e-5 * scale.max())
    assert output.taps != auto.taps and auto.taps[derived[0]] == "input"


def test_only_act_of_bn_is_a_derivable_input():
    """A conv's input derives from an exposed tensor only through an inference BN (then
    Relu / Clip / nothing): not a Relu of a residual Add, nor a Relu of a conv whose BN
    was folded, nor a graph input."""
    cases = {corpus.residual_block: {"stem": False, "c1": True, "c2": True, "c3": False,
                                     "proj": False, "c4": True},
             corpus.conv_bn_folded: {"conv0": False, "conv1": False},
             corpus.preact_bn: {"conv0": False, "conv1": True}}
    for build, expected in cases.items():
        model = model_io.load_model(build())
        index = GraphIndex(model)
        got = {la.node_name: _bn_act_chain(index, la.input) is not None
               for la in find_analysed_layers(analyze_structure(model))}
        assert got == expected, build.__name__


def _bottleneck():
    """x → "c0" (3→4, 3×3) → bn → Relu → "expand" (1×1, 4→32, no bias) → bn → Relu →
    GAP → Gemm head: "expand" is input-tapped (its input has an eighth of its output's
    values) and its input is relu(BN(c0))."""
    g = corpus.GraphBuilder(5)
    r0 = g.node("Relu", [g.bn(g.conv("x", "c0", 3, 4), "c0_bn", 4)], "relu0")
    e = g.conv(r0, "expand", 4, 32, k=1, bias=False)
    r1 = g.node("Relu", [g.bn(e, "expand_bn", 32)], "relu1")
    g.gemm(g.pool_flatten(r1), "head", 32, corpus.N_CLASSES, out="logits")
    return g.model([corpus.image_input()], [corpus.logits_output()])


def test_an_input_tapped_conv_reads_the_exposed_conv_before_it():
    """An input-tapped conv whose input is relu(BN(y)) of an exposed conv output y is
    derived from y (no added work: its float64 product is the input tap's), so its input
    is not exposed; the statistics equal those of output taps and of the plain input tap
    to float32 rounding, at sampled and at every position."""
    from onnxdiag.channels import collect as collect_module

    model = model_io.load_model(_bottleneck())
    structure = analyze_structure(model)
    chosen = find_analysed_layers(structure)
    taps = choose_taps(model, chosen, "auto", n_positions=4)
    assert taps["c0"] == "output" and isinstance(taps["expand"], DerivedInputTap)
    assert taps["expand"].source == "c0" and taps["expand"].reads(None) == "c0"
    tensors, _ = collect_module._tensors(chosen, taps)
    assert set(tensors) == {"c0"}  # relu0, the input tap's tensor, is not exposed
    feeds = corpus.random_feeds(model, batch=N, seed=3)
    y = np.random.default_rng(1).integers(0, 5, N)
    for positions in (4, 100):
        def stats(tap, positions=positions):
            source = open_data({**feeds, "labels": y}, model_io.get_input_specs(model),
                               batch_size=7)
            return collect_channel_moments(model, structure, source, seed=1,
                                           n_positions=positions, tap=tap,
                                           targets="labels")

        got, want, plain = stats("auto"), stats("output"), stats("input")
        assert got.taps["expand"] == "input" and want.taps["expand"] == "output"
        for ref in (want, plain):
            a, b = got.layers["expand"].task, ref.layers["expand"].task
            scale = np.sqrt(np.diag(b.cov()[:32, :32]))
            err = np.abs(a.cov()[:32, :32] - b.cov()[:32, :32]) / np.outer(scale, scale)
            assert err.max() < 1e-5
            np.testing.assert_allclose(a.mean[:32], b.mean[:32], atol=1e-5 * scale.max())
