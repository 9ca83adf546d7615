"""Channel groups (METHODS §B6): coupling through residual Add, depthwise convs, gating Mul,
Concat offsets, Flatten blocks; conservative refusal for ops that mix channels.

Oracle for offsets and blocks: zeroing one output channel of a member (weight row and
bias) zeroes exactly the consumer inputs the record points to, in ONNX Runtime.
"""

from __future__ import annotations

import io

import corpus
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxdiag.graph import find_channel_groups, find_head, find_layers, get_group
from onnxdiag.model.io import load_model


def _groups(model):
    model = load_model(model)
    layers = find_layers(model, find_head(model))
    return layers, find_channel_groups(model, layers)


def _by_members(groups):
    return {tuple(sorted(g.members)): g for g in groups}


@pytest.mark.parametrize("name", sorted(corpus.CORPUS))
def test_every_layer_in_a_group_and_consumer_ranges_fit(name):
    layers, groups = _groups(corpus.CORPUS[name]())
    by_name = {la.node_name: la for la in layers}
    members = [m for g in groups for m in g.members]
    assert sorted(members) == sorted(by_name)
    for g in groups:
        for member, offset in zip(g.members, g.member_offsets):
            assert offset + g.n_channels <= by_name[member].n_out
        for c in g.consumers:
            assert (c.channel_offset + g.n_channels) * c.block_size <= by_name[c.node_name].n_in
        head = [m for m in g.members if by_name[m].is_head]
        assert not (head and g.prunable)


def test_residual_groups():
    _, groups = _groups(corpus.residual_block())
    found = _by_members(groups)
    assert set(found) == {("c2", "stem"), ("c1",), ("c3",), ("c4", "proj"), ("head",)}
    stem = found[("c2", "stem")]
    assert stem.kinds == ("residual",) and stem.n_channels == 8 and stem.prunable
    assert sorted(c.node_name for c in stem.consumers) == ["c1", "c3", "proj"]
    assert {p.node_name for p in stem.params} == {"stem_bn", "c2_bn"}
    assert {(p.input_index, p.axis) for p in stem.params} == {(i, 0) for i in (1, 2, 3, 4)}
    assert found[("c4", "proj")].consumers[0].node_name == "head"
    assert found[("c1",)].kinds == ("chain",)
    head = found[("head",)]
    assert not head.prunable and "classes" in head.reason
    assert get_group(groups, "proj") is found[("c4", "proj")]
    with pytest.raises(KeyError):
        get_group(groups, "nope")


def test_depthwise_and_gating_mul():
    found = _by_members(_groups(corpus.depthwise_pointwise())[1])
    assert found[("c0", "dw")].kinds == ("depthwise",)
    assert [c.node_name for c in found[("c0", "dw")].consumers] == ["pw"]
    found = _by_members(_groups(corpus.se_block())[1])
    gated = found[("c0", "se_expand")]
    assert gated.kinds == ("mul",) and gated.prunable
    assert sorted(c.node_name for c in gated.consumers) == ["head", "se_reduce"]
    assert found[("se_reduce",)].prunable


def test_concat_offsets_and_flatten_blocks():
    found = _by_members(_groups(corpus.concat_block())[1])
    assert [(c.node_name, c.channel_offset) for c in found[("c0",)].consumers] == \
        [("c1", 0), ("c2", 0)]
    assert [(c.node_name, c.channel_offset) for c in found[("c1",)].consumers] == [("c2", 4)]
    assert found[("c1",)].kinds == ("concat",)
    found = _by_members(_groups(corpus.conv_flatten_gemm())[1])
    (consumer,) = found[("c0",)].consumers
    assert (consumer.node_name, consumer.channel_offset, consumer.block_size) == ("head", 0, 16)
    assert found[("c0",)].kinds == ("flatten",)
    found = _by_members(_groups(corpus.two_inputs())[1])
    assert [(c.node_name, c.channel_offset) for c in found[("conv0",)].consumers] == [("head", 0)]


def _zero_channel(model: onnx.ModelProto, layer: str, channel: int) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for init in copy.graph.initializer:
        if init.name in (f"{layer}.weight", f"{layer}.bias"):
            value = numpy_helper.to_array(init).copy()
            value[channel] = 0
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    return copy


@pytest.mark.parametrize("name, layer, channel, tensor", [
    ("conv_flatten_gemm", "c0", 2, "flatten"),
    ("concat_block", "c1", 3, "cat"),
    ("two_inputs", "conv0", 1, "features"),
])
def test_consumer_records_point_at_the_right_inputs(name, layer, channel, tensor):
    model = corpus.CORPUS[name]()
    group = get_group(_groups(model)[1], layer)
    consumer = group.consumers[-1]
    feeds = corpus.random_feeds(model, batch=4)
    base = corpus.run_ort(model, feeds, [tensor])[tensor]
    cut = corpus.run_ort(_zero_channel(model, layer, channel), feeds, [tensor])[tensor]
    base, cut = (v.reshape(v.shape[0], v.shape[1], -1) for v in (base, cut))
    start = (consumer.channel_offset + channel) * consumer.block_size
    expected = np.zeros(base.shape[1], bool)
    expected[start:start + consumer.block_size] = True
    assert np.all(cut[:, expected] == 0)
    changed = np.any(base != cut, axis=(0, 2))
    assert changed.any() and not np.any(changed & ~expected)


def test_params_for_bias_add():
    found = _by_members(_groups(corpus.conv_bias_add())[1])
    (param,) = found[("conv0",)].params
    assert (param.node_name, param.input_index, param.axis, param.source) == \
        ("conv0_bias", 1, 0, "conv0.bias_add")


def test_unknown_ops_and_outputs_block_groups():
    found = _by_members(_groups(corpus.channel_shuffle())[1])
    assert not found[("c0",)].prunable and "Reshape" in found[("c0",)].reason
    assert "'split'" in found[("c0",)].reason and found[("c1",)].prunable
    found = _by_members(_groups(corpus.conv_transpose())[1])
    assert not found[("c0",)].prunable and not found[("up",)].prunable
    model = corpus.conv_bn_chain()
    model.graph.output.append(helper.make_tensor_value_info("relu1", 1, ["N", 16, 4, 4]))
    found = _by_members(_groups(model)[1])
    assert not found[("conv1",)].prunable and "graph output 'relu1'" in found[("conv1",)].reason
    assert found[("conv0",)].prunable


def _small(body) -> onnx.ModelProto:
    """x → c0 (8) → body(g, tensor) → c1 (8) → GAP → Flatten → Gemm head."""
    g = corpus._G(0)
    mid = body(g, g.conv("x", "c0", 3, 8))
    g.gemm(g.pool_flatten(g.conv(mid, "c1", 8, 8)), "head", 8, 5, out="logits")
    return g.model([corpus._image()], [corpus._logits()])


def test_axis_tracking_and_conservative_ops():
    def nhwc(g, t):
        t = g.node("Relu", [g.node("Transpose", [t], "to_nhwc", perm=[0, 2, 3, 1])], "relu")
        return g.node("Transpose", [t], "to_nchw", perm=[0, 3, 1, 2])

    def lrn(g, t):
        return g.node("LRN", [t], "lrn", size=3)

    def softmax_channels(g, t):
        return g.node("Softmax", [t], "sm", axis=1)

    def spatial_mul(g, t):  # an (8,) constant broadcasts along W, not channels
        return g.node("Mul", [t, g.init("w_scale", np.linspace(1, 2, 8))], "scale")

    def channel_mul(g, t):
        return g.node("Mul", [t, g.init("c_scale", np.linspace(1, 2, 8).reshape(8, 1, 1))],
                      "scale")

    assert get_group(_groups(_small(nhwc))[1], "c0").prunable
    blocked = get_group(_groups(_small(lrn))[1], "c0")
    assert not blocked.prunable and "'LRN'" in blocked.reason
    assert not get_group(_groups(_small(softmax_channels))[1], "c0").prunable
    spatial = get_group(_groups(_small(spatial_mul))[1], "c0")
    assert spatial.prunable and not spatial.params
    channel = get_group(_groups(_small(channel_mul))[1], "c0")
    assert channel.prunable and [(p.node_name, p.axis) for p in channel.params] == [("scale", 0)]


def test_group_to_dict():
    groups = _groups(corpus.residual_block())[1]
    d = groups[0].to_dict()
    assert d["members"] == ["stem", "c2"] and d["consumers"][0]["node_name"] == "c1"
    assert d["params"][0]["axis"] == 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_torch_view_flatten_maps_blocks():
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
            self.fc = torch.nn.Linear(64, 5)

        def forward(self, x):
            x = torch.relu(self.conv(x))
            return self.fc(x.view(x.size(0), -1))  # Shape → Gather → Concat → Reshape

    buf = io.BytesIO()
    torch.onnx.export(Net().eval(), torch.randn(2, 3, 8, 8), buf, dynamo=False,
                      input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}}, opset_version=17)
    group = get_group(_groups(buf.getvalue())[1], "/conv/Conv")
    assert group.prunable and group.kinds == ("flatten",)
    assert [(c.node_name, c.block_size) for c in group.consumers] == [("/fc/Gemm", 16)]


def test_node_names_differ_from_tensor_names():
    for name in ("residual_block", "concat_block", "depthwise_pointwise", "conv_bias_add"):
        model = corpus.CORPUS[name]()
        expected = _groups(model)[1]
        for node in model.graph.node:
            node.name = f"node/{node.name}"
        got = _groups(model)[1]
        assert [tuple(f"node/{m}" for m in g.members) for g in expected] == \
            [g.members for g in got]
        assert [[(f"node/{c.node_name}", c.channel_offset) for c in g.consumers]
                for g in expected] == [[(c.node_name, c.channel_offset) for c in g.consumers]
                                       for g in got]
        assert [[(p.tensor_name, p.source) for p in g.params] for g in expected] == \
            [[(p.tensor_name, p.source) for p in g.params] for g in got]
