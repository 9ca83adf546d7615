"""Layers: geometry and FLOPs against hand-computed numbers, BN pairing, folded BN,
activations, prunability; Structure totals."""

from __future__ import annotations

import json

import corpus
import pytest

from onnxdiag.graph import analyze_structure, find_head, find_layers, get_layer
from onnxdiag.graph.flops import conv_output_spatial, linear_flops
from onnxdiag.model.io import load_model


def _layers(name: str):
    model = load_model(corpus.CORPUS[name]())
    return {la.node_name: la for la in find_layers(model, find_head(model))}


def test_conv_geometry_and_flops():
    layers = _layers("conv_bn_chain")
    assert list(layers) == ["conv0", "conv1", "head"]
    c0, c1, head = layers["conv0"], layers["conv1"], layers["head"]
    assert (c0.n_in, c0.n_out, c0.kernel, c0.stride, c0.dilation, c0.pads, c0.groups) == \
        (3, 8, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1)
    assert c0.weight == "conv0.weight" and c0.weight_layout == "oihw" and c0.bias is None
    assert c0.n_params == 8 * 3 * 9 and c0.flops == 2 * (8 * 8) * 8 * 3 * 9  # 27,648
    assert c1.output_shape == ("N", 16, 4, 4) and c1.flops == 2 * (4 * 4) * 16 * 8 * 9
    assert head.n_params == 16 * 5 + 5 and head.flops == 2 * 16 * 5 and head.is_head
    assert not c0.is_head and all(la.prunable for la in layers.values())


def test_static_batch_multiplies_flops_and_dynamic_spatial_is_unknown():
    dynamic, static = _layers("conv_bn_chain"), _layers("conv_bn_chain_batch2")
    for name in dynamic:
        assert static[name].flops == 2 * dynamic[name].flops
    conv0 = _layers("dynamic_spatial")["conv0"]
    assert conv0.flops is None and "dynamic spatial" in conv0.note
    structure = analyze_structure(load_model(corpus.dynamic_spatial()))
    assert structure.flops is None and structure.flops_known == 2 * 8 * 5
    assert "FLOPs unknown" in structure.notes[0]


def test_depthwise_projection_and_conv_transpose():
    layers = _layers("depthwise_pointwise")
    dw = layers["dw"]
    assert dw.depthwise and dw.groups == 8 and dw.n_in == dw.n_out == 8
    assert dw.n_params == 8 * 9 and dw.flops == 2 * 64 * 8 * 1 * 9
    assert layers["pw"].flops == 2 * 64 * 16 * 8 and not layers["pw"].depthwise
    proj = _layers("residual_block")["proj"]
    assert proj.kernel == (1, 1) and proj.stride == (2, 2) and proj.flops == 2 * 16 * 16 * 8
    up = _layers("conv_transpose")["up"]
    assert (up.op_type, up.weight_layout, up.n_in, up.n_out) == ("ConvTranspose", "iohw", 8, 4)
    assert up.flops == 2 * (4 * 4) * 8 * 4 * 4 and not up.prunable
    assert "ConvTranspose" in up.note


def test_linear_layouts_and_bias_add():
    assert _layers("gemm_head")["head"].weight_layout == "oi"
    t0 = _layers("gemm_head_transb0")["head"]
    assert (t0.weight_layout, t0.n_in, t0.n_out) == ("io", 16, 5)
    mm = _layers("matmul_add_head")["head"]
    assert (mm.op_type, mm.weight_layout, mm.bias, mm.bias_node, mm.n_params) == \
        ("MatMul", "io", "head.bias", "head_bias", 85)
    assert _layers("matmul_head_no_bias")["head"].bias is None


def test_weight_sources():
    head = _layers("identity_transpose_weights")["head"]
    assert head.weight_initializer is None and not head.prunable and "Identity" in head.note
    assert _layers("constant_node_weights")["head"].weight_initializer == "W"
    assert _layers("gemm_head")["head"].weight_initializer == "head.weight"


def test_bn_pairing_folded_and_activations():
    chain = _layers("conv_bn_chain")
    assert [(chain[n].bn_node, chain[n].bn_position, chain[n].bn_folded, chain[n].activation)
            for n in ("conv0", "conv1")] == [("bn0", "after", False, "Relu"),
                                             ("bn1", "after", False, "Relu")]
    folded = _layers("conv_bn_folded")
    assert folded["conv0"].bn_folded and folded["conv0"].bias == "conv0.bias"
    assert "folded" in folded["conv0"].note
    assert folded["conv1"].activation == "Clip" and "ReLU6" in folded["conv1"].note
    assert not folded["head"].bn_folded  # a head's bias says nothing about BN
    added = _layers("conv_bias_add")["conv0"]
    assert (added.bias, added.bias_node, added.bn_folded) == ("conv0.bias_add", "conv0_bias",
                                                              True)
    assert "per-channel Add" in added.note
    assert (added.activation, added.activation_node) == ("SiLU", "silu0")
    pre = _layers("preact_bn")
    assert (pre["conv0"].bn_node, pre["conv0"].bn_position, pre["conv0"].activation) == \
        ("bn0", "before_next", "Relu")
    assert (pre["conv1"].bn_node, pre["conv1"].bn_position, pre["conv1"].activation) == \
        ("bn1", "after", "LeakyRelu")
    res = _layers("residual_block")
    assert res["c2"].bn_node == "c2_bn" and res["c2"].activation is None


def test_structure_totals_and_json():
    structure = analyze_structure(load_model(corpus.conv_bn_chain()))
    assert structure.n_params_layers == 216 + 1152 + 85
    assert structure.n_params == structure.n_params_layers + 4 * (8 + 16)  # + BN tensors
    assert structure.flops == 27648 + 36864 + 160 == structure.flops_known
    assert structure.opset == 17 and structure.inputs[0].shape == ("N", 3, 8, 8)
    assert structure.outputs[0].dtype == "float32"
    d = json.loads(json.dumps(structure.to_dict()))
    assert d["head"]["node_name"] == "head" and len(d["layers"]) == 3
    assert d["layers"][1]["output_shape"] == ["N", 16, 4, 4]
    assert structure.get_layer("conv1").n_out == 16
    with pytest.raises(KeyError, match="conv0"):
        get_layer(list(structure.layers), "nope")


def test_structure_without_head():
    with pytest.raises(Exception, match="No linear classifier head"):
        analyze_structure(load_model(corpus.no_linear_head()))
    structure = analyze_structure(load_model(corpus.no_linear_head()), require_head=False)
    assert structure.head is None and "Resize" in structure.notes[0]
    assert [la.node_name for la in structure.layers] == ["conv0"]
    assert structure.groups[0].prunable is False  # reaches the graph output through Resize


def test_flops_helpers():
    assert conv_output_spatial((8, 8), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)) == (4, 4)
    assert conv_output_spatial((8, "W"), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)) is None
    assert linear_flops(4, 3, ("N", 7, 3)) == (2 * 7 * 4 * 3, "")
    assert linear_flops(4, 3, ("N", "T", 3))[0] is None


def test_node_names_differ_from_tensor_names():
    """Exporters name nodes and tensors differently; records must use node names for
    nodes and tensor names for tensors."""
    for name in ("preact_bn", "conv_bias_add", "conv_bn_folded", "residual_block"):
        model = corpus.CORPUS[name]()
        expected = _layers(name)
        for node in model.graph.node:
            node.name = f"node/{node.name}"
        model = load_model(model)
        got = {la.node_name: la for la in find_layers(model, find_head(model))}
        assert set(got) == {f"node/{n}" for n in expected}
        for n, la in expected.items():
            other = got[f"node/{n}"]
            for field in ("bn_node", "activation_node", "bias_node"):
                value = getattr(la, field)
                assert getattr(other, field) == (None if value is None else f"node/{value}")
            assert (other.output, other.bias, other.bn_position, other.activation) == \
                (la.output, la.bias, la.bn_position, la.activation)
