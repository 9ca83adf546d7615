"""Structured pruning of transformers (docs/METHODS.md §B6, §D): attention heads and MLP
hidden units removed physically equal the same heads / units zeroed in the original.

Oracles, on real converter exports (tests/exports.py: HF BERT, GPT-2 and Llama, the
timm-style ViT with a fused qkv) and on the bundled ViT sample:
- heads: the pruned model's logits equal those of the ORIGINAL model with the heads'
  value-projection rows (and value biases) set to zero, and equally with the output
  projection's input columns of those heads set to zero (both are onnx edits of copied
  initializers: a zero head contributes nothing to the output projection);
- MLP hidden units: the first projection's rows and biases zeroed (GELU(0) = SiLU(0)·u = 0).
Tolerance: float32 rounding, atol 1e-6 + rtol 1e-5 on logits whose change by the
pruning is checked to be at least 100 × that.
"""

from __future__ import annotations

import json
from pathlib import Path

import corpus
import exports
import numpy as np
import onnx
import pytest
from cli_helpers import run
from onnx import helper, numpy_helper

from onnxdiag.graph import GraphIndex, analyze_structure
from onnxdiag.model.io import load_model, model_hash
from onnxdiag.structured import (
    load_plan,
    magnitude_scores,
    plan_pruning,
    prune_channels,
    random_scores,
    replay_plan,
    save_plan,
    score_groups,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]
VIT_SAMPLE = ROOT / "models" / "vit" / "model.onnx"
_OUT_AXIS = {"oihw": 0, "oi": 0, "io": 1}
_IN_AXIS = {"oihw": 1, "oi": 1, "io": 0}
ATOL, RTOL = 1e-6, 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder, cache = tmp_path_factory.mktemp("exports"), {}

    def get(name):
        if name not in cache:
            if name == "vit_sample":
                model = load_model(VIT_SAMPLE)
                cache[name] = (model, corpus.random_feeds(model, batch=3))
            else:
                export = exports.BUILDERS[name](folder)
                cache[name] = (load_model(export.path), export.feeds)
        return cache[name]
    return get


# -- the reference: the original model with some entries of a node input set to zero --------
def _zero_inputs(model, sites) -> onnx.ModelProto:
    """Copy of ``model`` where input ``slot`` of node ``name`` reads a copy of its constant
    with ``indices`` along ``axis`` set to 0, for each (name, slot, axis, indices)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    index = GraphIndex(copy)
    nodes = {n.name: n for n in copy.graph.node}
    first = len(copy.graph.initializer)
    for k, (name, slot, axis, indices) in enumerate(sites, start=first):
        value = np.array(index.get_constant(nodes[name].input[slot]))
        np.moveaxis(value, axis, 0)[sorted(indices)] = 0
        copy.graph.initializer.append(numpy_helper.from_array(value, f"zeroed_{k}"))
        nodes[name].input[slot] = f"zeroed_{k}"
    return copy


def _features(channels, offset, block):
    return [(offset + c) * block + j for c in channels for j in range(block)]


def _zero_values(model, structure, removed) -> onnx.ModelProto:
    """The heads' value rows and value biases zeroed (V is the third member: q, k, v)."""
    sites = []
    for gid, heads in removed.items():
        group = structure.groups[gid]
        layer, offset = structure.get_layer(group.members[2]), group.member_offsets[2]
        rows = _features(heads, offset, group.block_size)
        sites.append((layer.node_name, 1, _OUT_AXIS[layer.weight_layout], rows))
        if layer.bias_node is None and layer.bias is not None:
            sites.append((layer.node_name, 2, 0, rows))
        sites += [(p.node_name, p.input_index, p.axis, rows) for p in group.params
                  if p.node_name == layer.bias_node and p.channel_offset == offset]
    return _zero_inputs(model, sites)


def _zero_output_columns(model, structure, removed) -> onnx.ModelProto:
    sites = []
    for gid, heads in removed.items():
        (out,) = structure.groups[gid].consumers
        layer = structure.get_layer(out.node_name)
        sites.append((out.node_name, 1, _IN_AXIS[layer.weight_layout],
                      _features(heads, out.channel_offset, out.block_size)))
    return _zero_inputs(model, sites)


def _zero_units(model, structure, removed) -> onnx.ModelProto:
    """MLP hidden units zeroed at every member (weight rows, Gemm bias, bias Adds)."""
    sites = []
    for gid, units in removed.items():
        group = structure.groups[gid]
        for member in group.members:
            layer = structure.get_layer(member)
            sites.append((member, 1, _OUT_AXIS[layer.weight_layout], list(units)))
            if layer.bias_node is None and layer.bias is not None:
                sites.append((member, 2, 0, list(units)))
        sites += [(p.node_name, p.input_index, p.axis, list(units)) for p in group.params]
    return _zero_inputs(model, sites)


def _logits(model, feeds):
    return corpus.run_ort(model, feeds)[model.graph.output[0].name]


def _assert_same(pruned, reference, original, feeds):
    got, want, base = (_logits(m, feeds) for m in (pruned, reference, original))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert np.abs(want - base).max() > 100 * (ATOL + RTOL * np.abs(base).max())


def _groups(structure, role):
    return {g.group_id: g for g in structure.groups if g.role == role}


def _last_heads(structure, k=None):
    """Remove the upper half (at least one) of every head group's heads, but head 0."""
    return {gid: list(range(max(1, g.n_channels // 2) if k is None else g.n_channels - k,
                            g.n_channels))
            for gid, g in _groups(structure, "attention_heads").items()}


# -- heads ------------------------------------------------------------------------------------
HEAD_MODELS = ["hf_bert", "torch_vit", "vit_sample", "hf_gpt2", "hf_llama", "torch_vit_opset14"]


@pytest.mark.parametrize("name", HEAD_MODELS)
def test_head_pruning_equals_zeroing_the_heads(built, name):
    model, feeds = built(name)
    s = analyze_structure(model)
    heads = _groups(s, "attention_heads")
    assert heads and all(g.prunable for g in heads.values()), [g.reason for g in heads.values()]
    removed = _last_heads(s)
    pruned, record = prune_channels(model, s, removed)
    _assert_same(pruned, _zero_values(model, s, removed), model, feeds)
    _assert_same(pruned, _zero_output_columns(model, s, removed), model, feeds)
    assert record.params_after < record.params_before
    after = _groups(analyze_structure(pruned), "attention_heads")
    assert sorted(g.n_channels for g in after.values()) == \
        sorted(g.n_channels - len(removed[gid]) for gid, g in heads.items())
    assert all(g.block_size == heads[gid].block_size
               for gid, g in zip(heads, after.values()))


def test_head_pruning_rewrites_the_head_count_constants(built):
    model, feeds = built("vit_sample")
    s = analyze_structure(model)
    removed = _last_heads(s)  # 2 of 4 heads in each of 3 blocks
    pruned, record = prune_channels(model, s, removed)
    rewritten = {r.node_name for gid in removed for r in s.groups[gid].reshapes}
    assert set(record.reshapes) == rewritten and len(rewritten) == 12
    index = GraphIndex(pruned)
    split = index.node_by_name["/blocks/blocks.0/attn/Reshape"]
    assert index.shape(split.output[0])[2:] == (2, 12)  # (N, T, heads, head_dim)
    merge = index.node_by_name["/blocks/blocks.0/attn/Reshape_3"]
    assert index.shape(merge.output[0])[-1] == 24
    la = {la.node_name: la for la in analyze_structure(pruned).layers}
    assert la["/blocks/blocks.0/attn/value/MatMul"].n_out == 24
    assert la["/blocks/blocks.0/attn/out/MatMul"].n_in == 24


def test_heads_and_mlp_units_together(built):
    model, feeds = built("vit_sample")
    s = analyze_structure(model)
    heads, mlp = _last_heads(s, k=1), {gid: list(range(0, g.n_channels, 3))
                                      for gid, g in _groups(s, "mlp_hidden").items()}
    pruned, record = prune_channels(model, s, {**heads, **mlp})
    reference = _zero_units(_zero_values(model, s, heads), s, mlp)
    _assert_same(pruned, reference, model, feeds)
    assert record.flops_after < record.flops_before


# -- MLP hidden units -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hf_bert", "torch_vit", "vit_sample", "hf_gpt2", "hf_llama"])
def test_mlp_hidden_pruning_equals_zeroing_the_units(built, name):
    model, feeds = built(name)
    s = analyze_structure(model)
    mlp = {gid: g for gid, g in _groups(s, "mlp_hidden").items()
           if not any("pooler" in m for m in g.members)}  # BERT's pooler feeds the head
    assert len(mlp) == 3 if name == "vit_sample" else len(mlp) == 2
    assert all(g.prunable for g in mlp.values()), [g.reason for g in mlp.values()]
    removed = {gid: list(range(1, g.n_channels, 2)) for gid, g in mlp.items()}
    pruned, record = prune_channels(model, s, removed)
    _assert_same(pruned, _zero_units(model, s, removed), model, feeds)
    if name == "hf_llama":  # SwiGLU: the gate and up projections lose the same rows
        assert all(len(g.members) == 2 and "mul" in g.kinds for g in mlp.values())
    if name == "hf_gpt2":  # the Gemm on N·T rows: its Reshape back to tokens is rewritten
        assert any("c_fc/Reshape" in r for r in record.reshapes)


# -- shape constants as initializers, shared, and a Split attribute (opset 12) ----------------
def _attention_model(rng, n_blocks=2, heads=2, head_dim=4, tokens=5):
    """x (N, T, 6) → embed → n_blocks × [fused qkv MatMul + Add, Split by its attribute,
    Reshape by ONE shared initializer [0, 0, heads, head_dim], attention, Reshape by a
    shared [0, 0, D], output projection, residual Add] → ReduceMean over tokens → Gemm."""
    d = heads * head_dim
    f32 = np.float32
    inits = [numpy_helper.from_array(np.array([0, 0, heads, head_dim], np.int64), "split_to"),
             numpy_helper.from_array(np.array([0, 0, d], np.int64), "merge_to")]
    nodes = []

    def init(name, *shape, scale=0.5):
        inits.append(numpy_helper.from_array(rng.normal(0, scale, shape).astype(f32), name))
        return name

    def node(op, inputs, name, **attrs):
        nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    x = node("MatMul", ["x", init("embed_w", 6, d)], "embed")
    for b in range(n_blocks):
        qkv = node("Add", [node("MatMul", [x, init(f"w{b}", d, 3 * d)], f"qkv{b}"),
                           init(f"b{b}", 3 * d)], f"qkv{b}_bias")
        parts = [f"{p}{b}" for p in "qkv"]
        nodes.append(helper.make_node("Split", [qkv], parts, name=f"split{b}", axis=-1,
                                      split=[d, d, d]))
        q, k, v = (node("Transpose", [node("Reshape", [t, "split_to"], f"{t}_heads")],
                        f"{t}_t", perm=perm)
                   for t, perm in zip(parts, ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3])))
        att = node("Softmax", [node("MatMul", [q, k], f"scores{b}")], f"att{b}", axis=-1)
        y = node("Transpose", [node("MatMul", [att, v], f"mix{b}")], f"mix{b}_t",
                 perm=[0, 2, 1, 3])
        y = node("MatMul", [node("Reshape", [y, "merge_to"], f"merge{b}"),
                            init(f"o{b}", d, d)], f"out{b}")
        x = node("Add", [x, y], f"res{b}")
    pooled = node("ReduceMean", [x], "pool", axes=[1], keepdims=0)
    nodes.append(helper.make_node("Gemm", [pooled, init("head_w", 3, d), init("head_b", 3)],
                                  ["logits"], name="head", transB=1))
    graph = helper.make_graph(
        nodes, "attention", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                           ["N", tokens, 6])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def test_shared_initializer_shapes_and_split_attribute():
    model = _attention_model(np.random.default_rng(0))
    feeds = {"x": np.random.default_rng(1).normal(size=(3, 5, 6)).astype(np.float32)}
    s = analyze_structure(model)
    heads = _groups(s, "attention_heads")
    assert [(g.n_channels, g.block_size, g.member_offsets) for g in heads.values()] == \
        [(2, 4, (0, 2, 4))] * 2
    first, second = heads
    for removed in ({first: [0]}, {first: [1], second: [0]}):
        pruned, record = prune_channels(model, s, removed)
        _assert_same(pruned, _zero_values(model, s, removed), model, feeds)
        _assert_same(pruned, _zero_output_columns(model, s, removed), model, feeds)
        split = GraphIndex(pruned).node_by_name["split0"]
        assert list(helper.get_attribute_value(split.attribute[-1])) == [4, 4, 4]
    # one block pruned: the shared shape initializers are copied for its sites only
    pruned, record = prune_channels(model, s, {first: [0]})
    inits = {t.name: numpy_helper.to_array(t) for t in pruned.graph.initializer}
    assert inits["split_to"].tolist() == [0, 0, 2, 4] and inits["merge_to"].tolist() == [0, 0, 8]
    assert any(c.startswith("split_to ->") for c in record.copied)


# -- scores and plans ---------------------------------------------------------------------------
def _minmax(v):
    return (v - v.min()) / (v.max() - v.min())


def test_a_heads_score_is_the_sum_of_its_features_over_q_k_v(built):
    model, _ = built("vit_sample")
    s = analyze_structure(model)
    scores = magnitude_scores(model, s)
    got = score_groups(s, scores)
    for gid, g in _groups(s, "attention_heads").items():
        want = sum(_minmax(scores[m]).reshape(g.n_channels, g.block_size).sum(axis=1)
                   for m in g.members)
        np.testing.assert_allclose(got[gid], want, rtol=1e-12)
    assert set(random_scores(s)[1].shape) == {4}  # one random value per head


def test_plans_count_whole_heads_and_keep_one(built):
    model, _ = built("vit_sample")
    s = analyze_structure(model)
    scores = magnitude_scores(model, s)
    for ratio, kept in ((0.25, 3), (0.5, 2), (0.9, 1)):
        plan = plan_pruning(model, s, scores, ratio, score_name="magnitude")
        for gid, g in _groups(s, "attention_heads").items():
            assert g.n_channels - len(plan.removed[gid]) == kept
    rounded = plan_pruning(model, s, scores, 0.5, round_to=16)  # heads are not rounded
    assert all(len(rounded.removed[gid]) == 2 for gid in _groups(s, "attention_heads"))
    glob = plan_pruning(model, s, scores, 0.9, budget="global")
    assert all(len(glob.removed[gid]) <= 3 for gid in _groups(s, "attention_heads"))


def test_plan_replay_is_byte_exact_on_the_vit_sample(built, tmp_path):
    model, _ = built("vit_sample")
    s = analyze_structure(model)
    plan = plan_pruning(model, s, magnitude_scores(model, s), 0.5, score_name="magnitude")
    assert all(plan.removed[gid] for gid in _groups(s, "attention_heads"))
    first, _ = prune_channels(model, s, plan)
    again, _ = replay_plan(model, load_plan(save_plan(plan, tmp_path / "plan.json")))
    assert first.SerializeToString() == again.SerializeToString()
    assert model_hash(model) == plan.model_hash


def test_prune_channels_cli_on_the_vit_sample_removes_heads(tmp_path):
    out, plan = tmp_path / "small.onnx", tmp_path / "plan.json"
    data = ROOT / "models" / "sample" / "calib.npz"
    # --no-reconstruct: with --data the reconstruction (default without BN) would change
    # the weights the plan replayed without data is compared with
    result = run("prune-channels", VIT_SAMPLE, "--ratio", 0.5, "--score", "peer", "--data",
                 data, "--limit", 64, "--no-reconstruct", "-o", out, "--plan-out", plan,
                 "--out", tmp_path / "r")
    assert result.exit_code == 0, result.output
    side = json.loads((tmp_path / "small.onnx.json").read_text())
    assert 0.4 < side["flops_ratio"] < 0.6 and 0.4 < side["params_ratio"] < 0.6
    assert not any("scored by magnitude" in n for n in side["notes"])  # Q, K, V have stats
    heads = [gid for gid, n in side["plan"]["n_channels"].items() if n == 4]
    assert len(heads) == 3 and all(len(side["plan"]["removed"][g]) == 2 for g in heads)
    assert len(side["record"]["reshapes"]) == 12
    # the plan made with the statistics replays on the model file (its hash is the file's)
    again = tmp_path / "again.onnx"
    result = run("prune-channels", VIT_SAMPLE, "--plan", plan, "-o", again, "--out",
                 tmp_path / "r2")
    assert result.exit_code == 0, result.output
    feeds = corpus.random_feeds(onnx.load(out), batch=2)
    np.testing.assert_array_equal(_logits(onnx.load(out), feeds),
                                  _logits(onnx.load(again), feeds))


def test_prune_channels_cli_plan_replay_is_byte_exact_on_the_vit_sample(tmp_path):
    first, again, plan = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "plan.json"
    assert run("prune-channels", VIT_SAMPLE, "--ratio", 0.5, "--score", "magnitude", "-o",
               first, "--plan-out", plan, "--out", tmp_path / "r1").exit_code == 0
    assert run("prune-channels", VIT_SAMPLE, "--plan", plan, "-o", again, "--out",
               tmp_path / "r2").exit_code == 0
    assert first.read_bytes() == again.read_bytes()


def test_prune_sweep_on_the_vit_sample_is_flops_matched(tmp_path):
    data = ROOT / "models" / "sample"
    result = run("prune-sweep", VIT_SAMPLE, "--data", data / "calib.npz", "--limit", 64,
                 "--eval-data", data / "eval.npz", "--scores",
                 "magnitude,ix,random", "--ratios", "0.25,0.5", "--out", tmp_path / "r",
                 "--format", "json")
    assert result.exit_code == 0, result.output
    section = json.loads(result.stdout)["prune_sweep"]
    assert section["flops_matched"] and not section["failed"]
    for ratio in (0.25, 0.5):
        cells = [r for r in section["rows"] if r["ratio"] == ratio]
        assert len(cells) == 3 and len({r["flops_ratio"] for r in cells}) == 1
        assert cells[0]["flops_ratio"] < 1 - ratio / 2
