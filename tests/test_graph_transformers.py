"""Linear layers and transformer channel groups (docs/METHODS.md §D) on real converter exports.

Exports (tests/exports.py): torch.onnx of HF BERT, GPT-2 and Llama classifiers from configs
with random weights, a timm-style ViT in plain torch (at opset 17 and 14, where LayerNorm
is written out), the skl2onnx MLP, and the bundled ViT sample (models/vit/model.onnx).

Oracle for the attention-head records: removing head h's value features (the members'
offsets × block_size, by a lesion of those output features) and removing head h's
columns of the output projection (the consumer record, by a mask in front of it) give
the same logits in ONNX Runtime, different from the model's.
"""

from __future__ import annotations

from pathlib import Path

import corpus
import exports
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxdiag.channels.interventions import lesion_channels
from onnxdiag.graph import GraphIndex, analyze_structure
from onnxdiag.graph.norms import find_norms
from onnxdiag.model.io import load_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")
VIT_SAMPLE = Path(__file__).resolve().parents[1] / "models" / "vit" / "model.onnx"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder, cache = tmp_path_factory.mktemp("exports"), {}

    def get(name):
        if name not in cache:
            export = exports.BUILDERS[name](folder)
            cache[name] = (export, load_model(export.path))
        return cache[name]
    return get


def _by_role(structure, role):
    return [g for g in structure.groups if g.role == role]


def _layer_names(structure, part):
    return [la.node_name for la in structure.layers if part in la.node_name]


def test_bert_layers_and_groups(built):
    export, model = built("hf_bert")
    s = analyze_structure(model)
    (stream,) = _by_role(s, "residual_stream")
    assert set(stream.members) == set(_layer_names(s, "output/dense"))  # 2 blocks × 2
    consumers = {c.node_name for c in stream.consumers}
    assert set(_layer_names(s, "self/")) | set(_layer_names(s, "intermediate")) | \
        {"/model/bert/pooler/dense/Gemm"} == consumers
    tensors = {p.tensor_name for p in stream.params}
    assert "model.bert.embeddings.word_embeddings.weight" in tensors
    assert sum("LayerNorm.weight" in t for t in tensors) == 5  # every LayerNorm's γ
    assert not stream.prunable and "residual stream" in stream.reason
    heads = _by_role(s, "attention_heads")
    assert len(heads) == 2
    for g in heads:
        assert (g.n_channels, g.block_size, g.member_offsets) == (2, 16, (0, 0, 0))
        assert [m.rsplit("/", 2)[-2] for m in g.members] == ["query", "key", "value"]
        (out,) = g.consumers
        assert out.node_name.endswith("attention/output/dense/MatMul") and out.block_size == 16
        assert len(g.params) == 3  # the q, k, v bias Adds
    hidden = _by_role(s, "mlp_hidden")
    assert [g.members for g in hidden][:2] == [(n,) for n in _layer_names(s, "intermediate")]
    assert all(g.prunable for g in hidden[:2])
    fc1 = s.get_layer(_layer_names(s, "intermediate")[0])
    assert (fc1.activation, fc1.normalization, fc1.norm_position) == ("GELU", "layernorm",
                                                                      "input")
    proj = s.get_layer(_layer_names(s, "attention/output/dense")[0])
    assert (proj.normalization, proj.norm_position) == ("layernorm", "output")


def test_gpt2_fused_attention_cut_by_a_split(built):
    export, model = built("hf_gpt2")
    s = analyze_structure(model)
    heads = _by_role(s, "attention_heads")
    assert len(heads) == 2
    for g in heads:
        assert (g.n_channels, g.block_size, g.member_offsets) == (2, 16, (0, 2, 4))
        assert set(g.members) == {g.members[0]} and g.members[0].endswith("c_attn/Gemm")
        kinds = {(r.node_name.rsplit("/", 1)[-1], r.meaning, r.value, r.per_channel)
                 for r in g.reshapes}
        assert ("Split", "channels", 32, 16) in kinds and ("Reshape_1", "channels", 96, 48) \
            in kinds
    (stream,) = _by_role(s, "residual_stream")
    assert len(stream.members) == 4 and "embedding" in stream.kinds
    assert all(r.value == 32 and r.source is not None for r in stream.reshapes)
    fc = s.get_layer(_layer_names(s, "c_fc")[0])
    assert fc.activation == "GELU"  # the tanh form, behind GPT-2's Reshape back to tokens
    assert {la.normalization for la in s.layers if not la.is_head} == {"layernorm"}


def test_gpt2_flops_at_the_data_shapes(built):
    """Shape inference leaves GPT-2's N·T rows open; one batch resolves them."""
    export, model = built("hf_gpt2")
    s = analyze_structure(model, shape_feeds=export.feeds)
    tokens = export.feeds["input_ids"].shape[1]
    for la in s.layers:
        assert la.flops == 2 * tokens * la.n_in * la.n_out, la.node_name
    assert s.flops == sum(la.flops for la in s.layers)
    assert any("measured on one batch" in n for n in s.notes)


@pytest.mark.parametrize("name", ["torch_vit", "torch_vit_opset14"])
def test_timm_vit_fused_qkv_and_written_out_layernorm(built, name):
    export, model = built(name)
    s = analyze_structure(model)
    norms = find_norms(GraphIndex(model))
    assert len(norms) == 5 and {n.kind for n in norms.values()} == {"layernorm"}
    assert all(len(n.nodes) == (1 if name == "torch_vit" else 9) for n in norms.values())
    heads = _by_role(s, "attention_heads")
    assert [(g.n_channels, g.block_size, g.member_offsets) for g in heads] == \
        [(2, 16, (0, 2, 4))] * 2
    (stream,) = _by_role(s, "residual_stream")
    assert stream.members[0] == "/patch_embed/Conv" and len(stream.members) == 5
    tensors = {p.tensor_name for p in stream.params}
    assert {"cls_token", "pos_embed"} <= tensors and sum("norm" in t for t in tensors) == 10
    assert [g.members for g in _by_role(s, "mlp_hidden")] == \
        [(n,) for n in _layer_names(s, "fc1")]
    qkv = s.get_layer("/blocks/blocks.0/qkv/MatMul")
    assert (qkv.normalization, qkv.norm_position) == ("layernorm", "input")
    assert s.get_layer("/blocks/blocks.0/fc1/MatMul").activation == "GELU"


def test_llama_rmsnorm_and_gated_mlp(built):
    export, model = built("hf_llama")
    s = analyze_structure(model)
    norms = find_norms(GraphIndex(model))
    assert len(norms) == 5 and {n.kind for n in norms.values()} == {"rmsnorm"}
    (stream,) = _by_role(s, "residual_stream")
    assert "rmsnorm" in stream.kinds and len(stream.members) == 4
    gated = _by_role(s, "mlp_hidden")
    assert len(gated) == 2
    for g in gated:
        assert "mul" in g.kinds and [m.rsplit("/", 2)[-2] for m in g.members] == \
            ["gate_proj", "up_proj"]
        assert [c.node_name.rsplit("/", 2)[-2] for c in g.consumers] == ["down_proj"]
    assert [(g.n_channels, g.block_size) for g in _by_role(s, "attention_heads")] == \
        [(2, 16)] * 2
    gate = s.get_layer(_layer_names(s, "gate_proj")[0])
    assert (gate.activation, gate.normalization) == ("SiLU", "rmsnorm")


def test_sklearn_mlp_hidden_units(built):
    export, model = built("sklearn_mlp")
    s = analyze_structure(model)
    (hidden,) = _by_role(s, "mlp_hidden")
    assert hidden.members == ("MatMul",) and hidden.n_channels == 16 and hidden.prunable
    assert [c.node_name for c in hidden.consumers] == ["MatMul1"]
    assert s.get_layer("MatMul").activation == "Relu"
    assert s.get_layer("MatMul").normalization is None


def test_vit_sample_layers_and_groups():
    s = analyze_structure(load_model(VIT_SAMPLE))
    linear = [la for la in s.layers if la.op_type in ("Gemm", "MatMul")]
    assert len(linear) == 19 and s.flops is not None
    heads = _by_role(s, "attention_heads")
    assert [(g.n_channels, g.block_size, len(g.members)) for g in heads] == [(4, 12, 3)] * 3
    assert all({r.meaning for r in g.reshapes} == {"heads", "channels"} for g in heads)
    (stream,) = _by_role(s, "residual_stream")
    assert stream.n_channels == 48 and len(stream.members) == 7
    assert len(_by_role(s, "mlp_hidden")) == 3


@pytest.mark.parametrize("name", ["hf_bert", "hf_gpt2", "torch_vit", "hf_llama",
                                  "torch_vit_opset14"])
def test_every_layer_in_exactly_one_group(built, name):
    _, model = built(name)
    s = analyze_structure(model)
    holders = {}
    for g in s.groups:
        for m in set(g.members):
            holders.setdefault(m, []).append(g.group_id)
    assert sorted(holders) == sorted(la.node_name for la in s.layers)
    assert all(len(v) == 1 for v in holders.values())


def _mask_input(model, node_name, columns, width):
    """The model with the input of ``node_name`` multiplied by a mask, 0 at ``columns``."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    mask = np.ones(width, np.float32)
    mask[list(columns)] = 0
    m.graph.initializer.append(numpy_helper.from_array(mask, "ref_mask"))
    node = next(n for n in m.graph.node if n.name == node_name)
    m.graph.node.append(helper.make_node("Mul", [node.input[0], "ref_mask"], ["ref_masked"],
                                         name="ref_mul"))
    node.input[0] = "ref_masked"
    del m.graph.value_info[:]
    return m


def _head_model(name, built):
    if name == "vit_sample":
        model = load_model(VIT_SAMPLE)
        return model, corpus.random_feeds(model, batch=3)
    export, model = built(name)
    return model, export.feeds


@pytest.mark.parametrize("name", ["hf_bert", "hf_gpt2", "torch_vit", "hf_llama", "vit_sample"])
def test_head_records_index_the_same_features_of_values_and_output(built, name):
    model, feeds = _head_model(name, built)
    s = analyze_structure(model)
    final = model.graph.output[0].name
    base = corpus.run_ort(model, feeds)[final]
    for g in _by_role(s, "attention_heads"):
        h, d = 1, g.block_size
        value, offset = g.members[2], g.member_offsets[2]  # q, k, v in every export
        lesioned = lesion_channels(model, s.get_layer(value),
                                   [(offset + h) * d + j for j in range(d)])
        (out,) = g.consumers
        width = s.get_layer(out.node_name).n_in
        masked = _mask_input(model, out.node_name,
                             [(out.channel_offset + h) * out.block_size + j
                              for j in range(out.block_size)], width)
        a = corpus.run_ort(lesioned, feeds)[final]
        b = corpus.run_ort(masked, feeds)[final]
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
        assert np.abs(a - base).max() > 1e-6  # the head matters
