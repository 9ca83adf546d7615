"""A widening 1×1 conv's pruned output moments derived from its input's in the sequential
repair (onnxdiag/sparsity/derived.py): the same moments as measuring the output, the same
repaired model, and the output never leaves a segment."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from corpus import conv_bn_chain, depthwise_pointwise, random_feeds, residual_block, run_ort
from test_sparsity_repair import _setup as repair_setup
from test_sparsity_repair import assert_same_initializers

from onnxdiag.graph import analyze_structure
from onnxdiag.model.io import load_model
from onnxdiag.sparsity import derived as derived_mod
from onnxdiag.sparsity import find_prunable, repair_model
from onnxdiag.sparsity.derived import derivable, derived_moments, input_moments
from onnxdiag.sparsity.segments import SegmentedPass


def _inverted_residual():
    """A MobileNetV2-style net exported by torch.onnx: stem 3→8 (3×3, s2) → BN → ReLU6;
    an inverted residual 8 → 48 (1×1) → dw 3×3 → 8 (1×1) + x; a 1×1 to 32; GAP → Linear."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)

    def cbr(c_in, c_out, k, stride=1, groups=1, act=True):
        mods = [nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False),
                nn.BatchNorm2d(c_out)]
        return nn.Sequential(*mods, *([nn.ReLU6()] if act else []))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(cbr(8, 48, 1), cbr(48, 48, 3, groups=48),
                                      cbr(48, 8, 1, act=False))

        def forward(self, x):
            return x + self.body(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(cbr(3, 8, 3, 2), Block(), cbr(8, 32, 1))
            self.fc = nn.Linear(32, 5)

        def forward(self, x):
            return self.fc(self.features(x).mean(dim=(2, 3)))

    net = Net().eval()
    with torch.no_grad():  # BN statistics that are not the identity
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 3, 16, 16),), buf, dynamo=False,
                          input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}}, opset_version=17)
    return onnx.load_from_string(buf.getvalue())


def _setup(build):
    """(model, structure, prunable layers, uniform 60 % masks, 3 calibration batches)."""
    model, structure, masks, calib = repair_setup(build)
    return model, structure, find_prunable(structure), masks, calib


def test_the_rule_takes_widening_1x1_convs_only(monkeypatch):
    """Derived: a 1×1, one-group, stride-1 conv that widens its input within the ratio;
    not a depthwise or 3×3 conv, a stride-2 1×1 projection, a narrowing 1×1, a Gemm; none
    with the ratio 0."""
    kinds = {}
    for build in (depthwise_pointwise, residual_block, _inverted_residual):
        for la in find_prunable(analyze_structure(load_model(build()))):
            kinds[la.node_name] = (derivable(la), la.kernel, la.stride, la.groups,
                                   la.n_in, la.n_out, la.op_type)
    taken = {k for k, v in kinds.items() if v[0]}
    assert taken == {k for k, (_, kern, stride, g, c_in, c_out, op) in kinds.items()
                     if op == "Conv" and kern == (1, 1) and stride == (1, 1) and g == 1
                     and c_out > c_in and c_in ** 2 <= derived_mod.DERIVE_RATIO * c_out}
    assert len(taken) == 3  # pw (8 → 16), the expansion (8 → 48), the last 1×1 (8 → 32)
    assert any(v[1] == (1, 1) and v[2] == (2, 2) for v in kinds.values())  # proj: not taken
    assert any(v[1] == (1, 1) and v[5] < v[4] for v in kinds.values())  # narrowing: not
    monkeypatch.setattr(derived_mod, "DERIVE_RATIO", 0)
    for build in (depthwise_pointwise, _inverted_residual):
        assert not any(derivable(la) for la in find_prunable(analyze_structure(
            load_model(build()))))


@pytest.mark.parametrize("chunk", [1 << 22, 300])
def test_derived_moments_equal_the_measured_outputs(chunk, monkeypatch):
    """Input moments (in chunks of any size) and the quadratic forms of the weights give
    each derivable conv's output mean and variance as a float64 pass over its measured
    (ONNX Runtime) output does, to float32 rounding; the input's covariance equals the
    float64 definition."""
    monkeypatch.setattr(derived_mod, "CHUNK_VALUES", chunk)
    model = load_model(_inverted_residual())
    index = analyze_structure(model)
    layers = [la for la in find_prunable(index) if derivable(la)]
    assert layers
    feeds = [random_feeds(model, batch=4, seed=i) for i in range(3)]
    tensors = [t for la in layers for t in (la.input, la.output)]
    outs = [run_ort(model, f, tensors) for f in feeds]
    from onnxdiag.graph import GraphIndex

    g = GraphIndex(model)
    for la in layers:
        xs = [o[la.input] for o in outs]
        got_in = input_moments(xs)
        rows = np.concatenate([np.moveaxis(x, 1, -1).reshape(-1, x.shape[1]) for x in xs]
                              ).astype(np.float64)
        np.testing.assert_allclose(got_in.mean, rows.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_in.cov(), np.cov(rows.T), rtol=1e-10, atol=1e-12)
        node = g.get_node(la.node_name)
        bias = g.get_constant(node.input[2]) if len(node.input) > 2 else None
        got = derived_moments(g.get_constant(la.weight), bias, got_in)
        y = np.concatenate([np.moveaxis(o[la.output], 1, -1).reshape(-1, la.n_out)
                            for o in outs]).astype(np.float64)
        assert got.n == len(y)
        sd = y.std(0, ddof=1)
        assert np.abs(got.mean - y.mean(0)).max() <= 1e-5 * sd.max()
        np.testing.assert_allclose(got.var(), y.var(0, ddof=1), rtol=1e-5)


@pytest.mark.parametrize("method", ["cr+bn", "cr", "shrunk-cr+bn"])
@pytest.mark.parametrize("build", [_inverted_residual, depthwise_pointwise, conv_bn_chain])
def test_repair_with_derived_layers_equals_the_measured_repair(build, method, monkeypatch):
    """The repaired model with the widening 1×1 convs measured on their inputs equals the
    one with every conv measured on its output (the rule's ratio 0) to float32 rounding of
    its initializers, and so do the logits; a derived conv's output is never a segment's
    output (it stays inside ONNX Runtime); a model without such convs is unchanged."""
    model, structure, layers, masks, calib = _setup(build)
    seen: list = []
    real = SegmentedPass._run_segment

    def spy(self, nodes, start, end, produced, wanted, watch=None):
        seen.extend(wanted)
        return real(self, nodes, start, end, produced, wanted, watch)

    monkeypatch.setattr(SegmentedPass, "_run_segment", spy)
    fast, rec = repair_model(model, structure, masks, calib, method=method)
    out_derived = {la.output for la in layers if derivable(la)}
    assert not out_derived & set(seen)
    seen.clear()
    monkeypatch.setattr(derived_mod, "DERIVE_RATIO", 0)
    slow, rec_slow = repair_model(model, structure, masks, calib, method=method)
    assert out_derived <= set(seen)
    assert rec.layers.keys() == rec_slow.layers.keys()
    for name, r in rec.layers.items():
        np.testing.assert_allclose(r.alpha, rec_slow.layers[name].alpha, rtol=2e-5)
    assert_same_initializers(fast, slow, 0.0 if not out_derived else 2e-5)
    la, lb = (np.concatenate([run_ort(m, f)["logits"] for f in calib]) for m in (fast, slow))
    np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-5)


def test_bn_recalibration_of_folded_convs_with_derived_layers(monkeypatch):
    """recalibrate_batchnorm re-standardises the convs a torch export folded its BNs into
    (affine folds, as after channel removal): with the widening ones measured on their
    inputs the result equals measuring every output, to float32 rounding."""
    from onnxdiag.sparsity import apply_masks
    from onnxdiag.sparsity.repair import recalibrate_batchnorm

    model, structure, layers, masks, calib = _setup(_inverted_residual)
    assert any(derivable(la) for la in layers)
    pruned = apply_masks(model, masks)
    fast, rec = recalibrate_batchnorm(pruned, calib, dense_model=model)
    monkeypatch.setattr(derived_mod, "DERIVE_RATIO", 0)
    slow, rec_slow = recalibrate_batchnorm(pruned, calib, dense_model=model)
    assert rec.layers.keys() == rec_slow.layers.keys() and rec.layers
    for name, r in rec.layers.items():
        np.testing.assert_allclose(r.alpha, rec_slow.layers[name].alpha, rtol=2e-5)
        np.testing.assert_allclose(r.shift, rec_slow.layers[name].shift, rtol=1e-4,
                                   atol=1e-6)
    la, lb = (np.concatenate([run_ort(m, f)["logits"] for f in calib]) for m in (fast, slow))
    np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-5)
