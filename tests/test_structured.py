"""Structured pruning (METHODS §B6): physical channel removal equals the masked model.

Equivalence oracle: removing channels physically gives the same outputs (ONNX Runtime,
atol 1e-5) as the ORIGINAL model with those channels zeroed at their source — member
weight rows and biases, BN scale and shift, bias-Add entries — so that a removed
channel contributes exactly 0 downstream.
"""

from __future__ import annotations

import corpus
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxdiag.errors import OnnxDiagError
from onnxdiag.graph import analyze_structure, get_group
from onnxdiag.model.edit import ModelEditor
from onnxdiag.model.finalize import EditError
from onnxdiag.model.io import load_model, model_hash, save_model
from onnxdiag.structured import (
    Plan,
    bn_scale_scores,
    kept_output_channels,
    load_plan,
    magnitude_scores,
    plan_pruning,
    prune_channels,
    random_scores,
    replay_plan,
    save_plan,
    score_groups,
)
from onnxdiag.structured.edit import ConstantEditor

_OUT_AXIS = {"oihw": 0, "oi": 0, "io": 1}


# -- reference: the original model with the channels zeroed ----------------------------------
def _zeroed(model: onnx.ModelProto, structure, removed: dict) -> onnx.ModelProto:
    """Copy of ``model`` whose removed channels output exactly 0 (no initializer is shared)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    inits = {t.name: t for t in copy.graph.initializer}
    nodes = {n.name: n for n in copy.graph.node}

    def zero(name, axis, idx):
        value = numpy_helper.to_array(inits[name]).copy()
        np.moveaxis(value, axis, 0)[idx] = 0
        inits[name].CopyFrom(numpy_helper.from_array(value, name))

    for gid, channels in removed.items():
        group = structure.groups[gid]
        for member, offset in zip(group.members, group.member_offsets):
            layer = structure.get_layer(member)
            idx = [offset + c for c in channels]
            zero(layer.weight_initializer, _OUT_AXIS[layer.weight_layout], idx)
            if layer.bias is not None and layer.bias_node is None:
                zero(layer.bias, inits[layer.bias].dims.__len__() - 1, idx)
        for p in group.params:
            op = nodes[p.node_name].op_type
            if (op == "BatchNormalization" and p.input_index in (1, 2)) or op == "Add":
                zero(p.source, p.axis, [p.channel_offset + c for c in channels])
    return copy


def _every_other(structure, start=0) -> dict:
    return {g.group_id: list(range(start, g.n_channels, 2)) for g in structure.groups
            if g.prunable}


def _assert_equivalent(model, structure, removed, pruned, batch=3):
    feeds = corpus.random_feeds(model, batch=batch, seed=1)
    want = corpus.run_ort(_zeroed(model, structure, removed), feeds)
    got = corpus.run_ort(pruned, feeds)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=0)


def _init_elems(model) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer)


def _build(name: str) -> onnx.ModelProto:
    """A corpus model, or one of the structured corpus's own builders below."""
    local = {"mobile": _mobile, "concat_flatten": _concat_flatten}
    return local[name]() if name in local else corpus.CORPUS[name]()


# -- equivalence for every group kind --------------------------------------------------------
@pytest.mark.parametrize("name, kind", [
    ("conv_bn_chain", "chain"), ("residual_block", "residual"), ("concat_block", "concat"),
    ("depthwise_pointwise", "depthwise"), ("conv_flatten_gemm", "flatten"),
    ("se_block", "mul"), ("two_inputs", "concat"), ("mlp_head", "chain"),
    ("conv_bias_add", "chain"), ("preact_bn", "chain"), ("conv_bn_folded", "chain"),
    ("concat_flatten", "flatten"),
])
def test_pruned_equals_zeroed_original(name, kind):
    model = load_model(_build(name))
    before = model.SerializeToString()
    structure = analyze_structure(model)
    assert any(kind in g.kinds for g in structure.groups if g.prunable)
    removed = _every_other(structure, start=1)
    pruned, record = prune_channels(model, structure, removed)
    assert model.SerializeToString() == before  # never modifies the input
    onnx.checker.check_model(pruned, full_check=True)
    _assert_equivalent(model, structure, removed, pruned)
    assert _init_elems(pruned) < _init_elems(model)
    assert record.params_after < record.params_before
    assert record.flops_after < record.flops_before
    after = analyze_structure(pruned)
    assert after.flops == record.flops_after and after.n_params == record.params_after
    for cut in record.groups:
        assert cut.n_after == cut.n_before - len(removed[cut.group_id])
        for member in cut.members:
            assert record.widths[member][1] <= record.widths[member][0] - len(cut.removed)


@pytest.mark.parametrize("name", ["residual_block", "concat_block", "depthwise_pointwise",
                                  "mobile", "concat_flatten"])
def test_random_plans_one_group_at_a_time(name):
    model = load_model(_build(name))
    structure = analyze_structure(model)
    rng = np.random.default_rng(3)
    for group in (g for g in structure.groups if g.prunable):
        k = int(rng.integers(1, group.n_channels))
        removed = {group.group_id: sorted(rng.choice(group.n_channels, k, replace=False))}
        pruned, _ = prune_channels(model, structure, removed)
        _assert_equivalent(model, structure, removed, pruned)


def test_depthwise_group_attribute_and_shapes():
    model = load_model(corpus.depthwise_pointwise())
    structure = analyze_structure(model)
    gid = get_group(list(structure.groups), "dw").group_id
    pruned, record = prune_channels(model, structure, {gid: [0, 2, 5]})
    dw = next(n for n in pruned.graph.node if n.name == "dw")
    assert helper.get_attribute_value(next(a for a in dw.attribute if a.name == "group")) == 5
    weights = {t.name: tuple(t.dims) for t in pruned.graph.initializer}
    assert weights["dw.weight"] == (5, 1, 3, 3) and weights["pw.weight"] == (16, 5, 1, 1)
    assert weights["c0_bn.scale"] == (5,) and weights["dw_bn.var"] == (5,)
    assert record.widths == {"c0": (8, 5), "dw": (8, 5)}
    assert record.groups[0].kept == (1, 3, 4, 6, 7)


def test_flatten_consumer_loses_blocks():
    model = load_model(corpus.conv_flatten_gemm())
    structure = analyze_structure(model)
    pruned, _ = prune_channels(model, structure, {0: [1, 3]})
    head = next(t for t in pruned.graph.initializer if t.name == "head.weight")
    kept = numpy_helper.to_array(head)
    original = next(numpy_helper.to_array(t) for t in model.graph.initializer
                    if t.name == "head.weight")
    np.testing.assert_array_equal(kept, np.concatenate([original[:, 0:16], original[:, 32:48]],
                                                       axis=1))


# -- graphs built here: MatMul layers, shared constants, literal Reshape ---------------------
def _matmul_mlp() -> onnx.ModelProto:
    """x (N,16) → MatMul "fc1" (16→12) → Add "fc1_bias" → Relu → MatMul "head" → Add."""
    g = corpus._G(4)
    h = g.node("MatMul", ["x", g.rand("fc1.weight", 16, 12)], "fc1")
    h = g.node("Relu", [g.node("Add", [h, g.rand("fc1.b", 12, scale=0.1)], "fc1_bias")], "r")
    mm = g.node("MatMul", [h, g.rand("head.weight", 12, 5)], "head")
    g.node("Add", [mm, g.rand("head.b", 5, scale=0.1)], "head_bias", "logits")
    return g.model([corpus._vi("x", ("N", 16))], [corpus._logits()])


def _shared_bn(shared: bool) -> onnx.ModelProto:
    """c0 (8) → bn_a → Relu → c1 (8) → bn_b → Relu → GAP → Flatten → Gemm "head"; with
    ``shared`` both BNs read the same four initializers (bn_b's scale through Identity)."""
    g = corpus._G(5)
    g.bn("x", "bn_src", 8)  # creates bn_src.* initializers; the node itself is dropped
    g.nodes.pop()
    names = [f"bn_src.{k}" for k in ("scale", "bias", "mean", "var")]
    if not shared:
        for t in list(g.inits):
            if t.name in names:
                g.init(t.name.replace("bn_src", "bn_b_src"), numpy_helper.to_array(t))
    b_names = names if shared else [n.replace("bn_src", "bn_b_src") for n in names]
    b_names[0] = g.node("Identity", [b_names[0]], "scale_identity")
    a = g.node("BatchNormalization", [g.conv("x", "c0", 3, 8, bias=False), *names], "bn_a")
    c1 = g.conv(g.node("Relu", [a], "relu_a"), "c1", 8, 8, bias=False)
    b = g.node("BatchNormalization", [c1, *b_names], "bn_b")
    g.gemm(g.pool_flatten(g.node("Relu", [b], "relu_b")), "head", 8, 5, out="logits")
    return g.model([corpus._image()], [corpus._logits()])


def _reshape_flatten(pool: bool) -> onnx.ModelProto:
    """c0 (3→4, stride 2) → Relu [→ GAP] → Reshape "reshape" to (0, 64) [(0, 4)] → Gemm."""
    g = corpus._G(6)
    r = g.node("Relu", [g.conv("x", "c0", 3, 4, stride=2)], "relu0")
    r = g.node("GlobalAveragePool", [r], "pool") if pool else r
    n = 4 if pool else 64
    flat = g.node("Reshape", [r, g.init("target", np.array([0, n], np.int64))], "reshape")
    g.gemm(flat, "head", n, 5, out="logits")
    return g.model([corpus._image()], [corpus._logits()])


def _mobile() -> onnx.ModelProto:
    """stem (16) → two inverted residuals (1×1 expand ×4 → depthwise → 1×1 project, Add) →
    Concat of two branches (8 + 12) → depthwise "dwc" over the concat → 1×1 "last" → head.
    Groups: {stem, b1_proj, b2_proj}, {bK_exp, bK_dw}, {br_a, dwc@0}, {br_b, dwc@8}, …"""
    g = corpus._G(7)

    def cbr(x, name, c_in, c_out, k=3, group=1, act=True):
        y = g.bn(g.conv(x, name, c_in, c_out, k=k, group=group, bias=False), f"{name}_bn", c_out)
        return g.node("Relu", [y], f"{name}_r") if act else y

    x = cbr("x", "stem", 3, 16)
    for name in ("b1", "b2"):
        h = cbr(cbr(cbr(x, f"{name}_exp", 16, 64, k=1), f"{name}_dw", 64, 64, group=64),
                f"{name}_proj", 64, 16, k=1, act=False)
        x = g.node("Add", [x, h], f"{name}_add")
    cat = g.node("Concat", [cbr(x, "br_a", 16, 8, k=1), cbr(x, "br_b", 16, 12)], "cat", axis=1)
    x = cbr(cbr(cat, "dwc", 20, 20, group=20), "last", 20, 24, k=1)
    g.gemm(g.pool_flatten(x), "head", 24, 5, out="logits")
    return g.model([corpus._image()], [corpus._logits()])


def _concat_flatten() -> onnx.ModelProto:
    """Three branches at 4×4, a = Relu(bn(c0(x))) (4), b = Relu(c1(a)) (6), d = Relu(c2(x))
    (5), Concat(a, b, d) "cat" (15) → Flatten (240) → Gemm "head": channel c of the branch
    at offset o (0, 4, 10) is features (o + c)·16 … (o + c)·16 + 15 of the head."""
    g = corpus._G(8)
    a = g.node("Relu", [g.bn(g.conv("x", "c0", 3, 4, stride=2, bias=False), "c0_bn", 4)],
               "relu_a")
    b = g.node("Relu", [g.conv(a, "c1", 4, 6)], "relu_b")
    d = g.node("Relu", [g.conv("x", "c2", 3, 5, stride=2)], "relu_d")
    cat = g.node("Concat", [a, b, d], "cat", axis=1)
    g.gemm(g.node("Flatten", [cat], "flatten", axis=1), "head", 240, 5, out="logits")
    return g.model([corpus._image()], [corpus._logits()])


def test_concat_flatten_offsets_take_their_own_columns():
    """The head loses exactly the 16-feature blocks of the removed channels, at each
    branch's offset in the concat (hand-derived: (offset + c)·16 + j)."""
    model = load_model(_concat_flatten())
    structure = analyze_structure(model)
    gid = {m: get_group(list(structure.groups), m).group_id for m in ("c0", "c1", "c2")}
    removed = {gid["c1"]: [0, 5], gid["c2"]: [2]}
    pruned, _ = prune_channels(model, structure, removed)
    _assert_equivalent(model, structure, removed, pruned, batch=5)
    gone = {(4 + c) * 16 + j for c in (0, 5) for j in range(16)} | \
        {(10 + 2) * 16 + j for j in range(16)}
    original = next(numpy_helper.to_array(t) for t in model.graph.initializer
                    if t.name == "head.weight")
    kept = next(numpy_helper.to_array(t) for t in pruned.graph.initializer
                if t.name == "head.weight")
    np.testing.assert_array_equal(kept, original[:, [i for i in range(240) if i not in gone]])


def _dense_channel_of(pruned_out: np.ndarray, reference_out: np.ndarray) -> list[int]:
    """For each channel of ``pruned_out`` (n, C', H, W), the one channel of
    ``reference_out`` (n, C, H, W) holding the same values (asserted unique)."""
    found = []
    for j in range(pruned_out.shape[1]):
        diff = np.abs(reference_out - pruned_out[:, j:j + 1]).max(axis=(0, 2, 3))
        match = np.flatnonzero(diff <= 1e-5)
        assert match.size == 1, (j, diff.min())
        found.append(int(match[0]))
    return found


def test_kept_output_channels_match_the_outputs_channel_by_channel():
    """kept_output_channels on a depthwise conv over a concat (groups at offsets 0 and 8),
    against two derivations that do not use the structure analysis: by hand (dwc reads
    br_a's 8 channels then br_b's 12), and by brute force: only these two groups are cut,
    so every channel the pruned "dwc" and "br_b" keep equals one of the ORIGINAL model's."""
    model = load_model(_mobile())
    structure = analyze_structure(model)
    dwc = [g.group_id for g in structure.groups if "dwc" in g.members]
    removed = {dwc[0]: [1, 6], dwc[1]: [0, 1, 3, 11]}  # channel 1 in both groups
    kept = kept_output_channels(structure, removed)
    assert kept == {"br_a": [0, 2, 3, 4, 5, 7],
                    "br_b": [2, 4, 5, 6, 7, 8, 9, 10],
                    "dwc": [i for i in range(20) if i not in (1, 6, 8, 9, 11, 19)]}
    pruned, _ = prune_channels(model, structure, removed)
    feeds = corpus.random_feeds(model, batch=2, seed=4)
    want = corpus.run_ort(model, feeds, outputs=["dwc", "br_b"])
    got = corpus.run_ort(pruned, feeds, outputs=["dwc", "br_b"])
    for name in ("dwc", "br_b"):
        assert kept[name] == _dense_channel_of(got[name], want[name])


@pytest.mark.parametrize("budget", ["uniform", "global"])
def test_depthwise_over_concat_and_inverted_residuals(budget):
    model = load_model(_mobile())
    structure = analyze_structure(model)
    dwc = [g for g in structure.groups if "dwc" in g.members]
    assert [g.member_offsets for g in dwc] == [(0, 0), (0, 8)] and all(g.prunable for g in dwc)
    plan = plan_pruning(model, structure, magnitude_scores(model, structure), 0.6, budget=budget)
    pruned, record = prune_channels(model, structure, plan)
    _assert_equivalent(model, structure, plan.removed, pruned)
    node = next(n for n in pruned.graph.node if n.name == "dwc")
    n_dwc = sum(structure.groups[g.group_id].n_channels - len(plan.removed[g.group_id])
                for g in dwc)
    assert any(a.name == "group" and a.i == n_dwc for a in node.attribute)
    assert record.widths["dwc"] == (20, n_dwc) and record.flops_after < record.flops_before / 2


def test_matmul_layers_and_bias_add():
    model = load_model(_matmul_mlp())
    structure = analyze_structure(model)
    assert structure.get_layer("fc1").weight_layout == "io"
    removed = {get_group(list(structure.groups), "fc1").group_id: [0, 4, 5, 11]}
    pruned, _ = prune_channels(model, structure, removed)
    _assert_equivalent(model, structure, removed, pruned)
    dims = {t.name: tuple(t.dims) for t in pruned.graph.initializer}
    assert dims["fc1.weight"] == (16, 8) and dims["fc1.b"] == (8,) and dims["head.weight"] == (8, 5)


def test_shared_initializers_are_copied_before_slicing():
    model = load_model(_shared_bn(shared=True))
    structure = analyze_structure(model)
    gid = get_group(list(structure.groups), "c0").group_id
    removed = {gid: [1, 2, 6]}
    pruned, record = prune_channels(model, structure, removed)
    onnx.checker.check_model(pruned, full_check=True)
    assert len(record.copied) == 4
    dims = {t.name: tuple(t.dims) for t in pruned.graph.initializer}
    assert all(dims[f"bn_src.{k}"] == (8,) for k in ("scale", "bias", "mean", "var"))
    bn_a = next(n for n in pruned.graph.node if n.name == "bn_a")
    assert all(dims[name] == (5,) for name in bn_a.input[1:])
    unshared = load_model(_shared_bn(shared=False))
    feeds = corpus.random_feeds(model, seed=2)
    want = corpus.run_ort(_zeroed(unshared, analyze_structure(unshared), removed), feeds)
    np.testing.assert_allclose(corpus.run_ort(pruned, feeds)["logits"], want["logits"],
                               atol=1e-5, rtol=0)
    # both groups pruned alike: bn_a and bn_b ask for different channels → two copies
    both = {gid: [1, 2, 6], get_group(list(structure.groups), "c1").group_id: [0]}
    pruned, record = prune_channels(model, structure, both)
    names = {t.name for t in pruned.graph.initializer}
    assert len(record.copied) == 8 and "bn_src.scale" not in names and "bn_src.var" not in names
    assert not any(n.op_type == "Identity" for n in pruned.graph.node)


def test_constant_node_params_become_sliced_initializers():
    model = onnx.ModelProto()
    model.CopyFrom(corpus.residual_block())
    for t in [t for t in model.graph.initializer if t.name.startswith("stem_bn.")]:
        model.graph.initializer.remove(t)
        model.graph.node.insert(0, helper.make_node("Constant", [], [t.name],
                                                    name=f"const_{t.name}", value=t))
    model = load_model(model)
    structure = analyze_structure(model)
    removed = {get_group(list(structure.groups), "stem").group_id: [1, 3]}
    pruned, record = prune_channels(model, structure, removed)
    assert len(record.copied) == 4 and not any(n.op_type == "Constant" for n in pruned.graph.node)
    plain = load_model(corpus.residual_block())
    feeds = corpus.random_feeds(model, seed=3)
    want = corpus.run_ort(prune_channels(plain, analyze_structure(plain), removed)[0], feeds)
    np.testing.assert_allclose(corpus.run_ort(pruned, feeds)["logits"], want["logits"],
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("pool, target", [(False, [0, 48]), (True, [0, 3])])
def test_literal_reshape_target_is_rewritten(pool, target):
    model = load_model(_reshape_flatten(pool))
    structure = analyze_structure(model)
    removed = {get_group(list(structure.groups), "c0").group_id: [2]}
    pruned, record = prune_channels(model, structure, removed)
    assert record.reshapes == ("reshape",)
    found = next(t for t in pruned.graph.initializer if t.name == "target")
    assert numpy_helper.to_array(found).tolist() == target
    _assert_equivalent(model, structure, removed, pruned)


# -- refusals ---------------------------------------------------------------------------------
def test_refusals_name_the_problem():
    model = load_model(corpus.residual_block())
    structure = analyze_structure(model)
    head = get_group(list(structure.groups), "head").group_id
    with pytest.raises(OnnxDiagError, match="classes"):
        prune_channels(model, structure, {head: [0]})
    with pytest.raises(OnnxDiagError, match="keep at least one"):
        prune_channels(model, structure, {0: list(range(8))})
    with pytest.raises(OnnxDiagError, match="out of range"):
        prune_channels(model, structure, {0: [8]})
    with pytest.raises(OnnxDiagError, match="twice"):
        prune_channels(model, structure, {0: [1, 1]})
    with pytest.raises(OnnxDiagError, match="No channel group 99"):
        prune_channels(model, structure, {99: [0]})
    other = analyze_structure(load_model(corpus.conv_bn_chain()))
    with pytest.raises(OnnxDiagError, match="does not match the model"):
        prune_channels(model, other, {0: [0]})
    pruned, record = prune_channels(model, structure, {head: []})  # empty: a no-op
    assert record.groups == () and record.params_after == record.params_before


# -- scores -----------------------------------------------------------------------------------
def test_builtin_scores():
    model = load_model(corpus.residual_block())
    structure = analyze_structure(model)
    mags = magnitude_scores(model, structure)
    w = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "c1.weight")
    np.testing.assert_allclose(mags["c1"], np.linalg.norm(w.reshape(8, -1), axis=1))
    assert mags["head"].shape == (5,)
    gammas = bn_scale_scores(model, structure)
    assert set(gammas) == {"stem", "c1", "c2", "c3", "c4", "proj"}
    assert all(v.min() >= 0 for v in gammas.values())
    r1, r2 = random_scores(structure, seed=1), random_scores(structure, seed=1)
    assert all(np.array_equal(r1[g], r2[g]) for g in r1)
    stem = get_group(list(structure.groups), "stem").group_id
    summed = score_groups(structure, mags)[stem]
    norm = [(v - v.min()) / (v.max() - v.min()) for v in (mags["stem"], mags["c2"])]
    np.testing.assert_allclose(summed, norm[0] + norm[1])
    with pytest.raises(OnnxDiagError, match="expected 8"):
        score_groups(structure, {"stem": np.ones(3)})
    with pytest.raises(OnnxDiagError, match="No scores"):
        score_groups(structure, {"stem": np.ones(8)})
    given = {stem: np.arange(8.0)}
    assert score_groups(structure, given, groups=[stem])[stem].tolist() == list(range(8))


# -- plans ------------------------------------------------------------------------------------
def test_uniform_plan_removes_lowest_scores():
    model = load_model(corpus.conv_bn_chain())
    structure = analyze_structure(model)
    mags = magnitude_scores(model, structure)
    plan = plan_pruning(model, structure, mags, 0.5, score_name="magnitude")
    assert plan.removed == {0: tuple(sorted(np.argsort(mags["conv0"])[:4])),
                            1: tuple(sorted(np.argsort(mags["conv1"])[:8]))}
    assert plan.model_hash == model_hash(model) and plan.score == "magnitude"
    assert plan.flops_after < plan.flops_before and plan.params_after < plan.params_before
    nan = {"conv0": np.r_[np.nan, np.ones(7)], "conv1": np.arange(16.0)}
    assert plan_pruning(model, structure, nan, 0.2).removed == {0: (0,), 1: (0, 1, 2)}


def test_budgets_match_flops_and_respect_caps():
    model = load_model(corpus.residual_block())
    structure = analyze_structure(model)
    mags = magnitude_scores(model, structure)
    uniform = plan_pruning(model, structure, mags, 0.7)
    rand = plan_pruning(model, structure, random_scores(structure, 4), 0.7, score_name="random")
    assert {g: len(v) for g, v in uniform.removed.items()} == \
        {g: len(v) for g, v in rand.removed.items()}
    assert uniform.flops_after == rand.flops_after  # FLOPs-matched by construction
    ref = plan_pruning(model, structure, bn_scale_scores(model, structure), None,
                       budget="reference", reference=uniform)
    assert {g: len(v) for g, v in ref.removed.items()} == \
        {g: len(v) for g, v in uniform.removed.items()}
    half = plan_pruning(model, structure, mags, None, budget="reference", reference={2: 0.5})
    assert half.removed == {2: tuple(sorted(np.argsort(mags["c3"])[:8]))}
    glob = plan_pruning(model, structure, mags, 0.8, budget="global")
    total = sum(structure.groups[g].n_channels for g in glob.removed)
    assert glob.n_removed == int(0.8 * total)
    for g, chans in glob.removed.items():
        assert len(chans) <= int(0.9 * structure.groups[g].n_channels)
    capped = plan_pruning(model, structure, mags, 0.5, budget="global", caps=0.25)
    assert all(len(v) <= structure.groups[g].n_channels // 4 for g, v in capped.removed.items())
    with pytest.raises(OnnxDiagError, match="Unknown budget"):
        plan_pruning(model, structure, mags, 0.5, budget="erk")
    with pytest.raises(OnnxDiagError, match="must be in"):
        plan_pruning(model, structure, mags, 1.0)
    with pytest.raises(OnnxDiagError, match="reference allocation"):
        plan_pruning(model, structure, mags, 0.5, budget="reference")
    with pytest.raises(OnnxDiagError, match="classes"):
        plan_pruning(model, structure, mags, 0.5, groups=[4])


@pytest.mark.parametrize("budget", ["uniform", "global"])
@pytest.mark.parametrize("multiple", [4, 8])
def test_round_to_keeps_multiples_and_spares_the_best_scored(budget, multiple):
    """--round-to N: every narrowed group keeps a multiple of N channels (rounded up, at
    most the group), only channels the exact plan removed are removed, and those spared
    are the best-scored of them; FLOPs stay matched across scores under ``uniform``."""
    model = load_model(corpus.residual_block())
    structure = analyze_structure(model)
    mags = magnitude_scores(model, structure)
    groups = score_groups(structure, mags, [g.group_id for g in structure.groups
                                            if g.prunable])
    for ratio in (0.3, 0.6, 0.8):
        exact = plan_pruning(model, structure, mags, ratio, budget=budget)
        rounded = plan_pruning(model, structure, mags, ratio, budget=budget,
                               round_to=multiple)
        assert rounded.settings["round_to"] == multiple
        for g, chans in exact.removed.items():
            n, kept = structure.groups[g].n_channels, rounded.removed.get(g, ())
            assert (n - len(kept)) % multiple == 0 or len(kept) == 0
            assert set(kept) <= set(chans) and n - len(kept) >= n - len(chans)
            spared = set(chans) - set(kept)
            if spared and kept:
                assert min(groups[g][c] for c in spared) >= max(groups[g][c] for c in kept)
    if budget == "uniform":
        rand = plan_pruning(model, structure, random_scores(structure, 1), 0.6,
                            round_to=multiple)
        assert rand.flops_after == plan_pruning(model, structure, mags, 0.6,
                                                round_to=multiple).flops_after
    with pytest.raises(OnnxDiagError, match="round_to must be a positive integer"):
        plan_pruning(model, structure, mags, 0.5, round_to=0)


def test_cpu_conv_block_reads_the_cpu_flags():
    from onnxdiag.runtime.latency import cpu_conv_block

    assert cpu_conv_block("processor: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n") == 16
    assert cpu_conv_block("flags : fpu sse2 avx avx2 fma\n") == 8
    assert cpu_conv_block("flags : fpu sse2\n") is None
    assert cpu_conv_block("Features: fp asimd\n") is None  # e.g. ARM: unknown


def test_plan_replays_to_identical_bytes(tmp_path):
    source = corpus.depthwise_pointwise().SerializeToString()
    model = load_model(source)
    structure = analyze_structure(model)
    plan = plan_pruning(model, structure, magnitude_scores(model, structure), 0.5,
                        score_name="magnitude")
    first, _ = prune_channels(model, structure, plan)
    save_model(first, tmp_path / "a.onnx")
    save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.to_dict() == plan.to_dict()
    assert Plan.from_dict(plan.to_dict()).removed == plan.removed
    fresh = load_model(source)
    before = fresh.SerializeToString()
    again, record = replay_plan(fresh, loaded)
    assert fresh.SerializeToString() == before
    save_model(again, tmp_path / "b.onnx")
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert record.flops_after == plan.flops_after
    with pytest.raises(OnnxDiagError, match="made for model"):
        replay_plan(load_model(corpus.conv_bn_chain()), loaded)
    (tmp_path / "bad.json").write_text("{\"schema\": \"other\"}")
    with pytest.raises(OnnxDiagError, match="Not an onnxdiag pruning plan"):
        load_plan(tmp_path / "bad.json")


# -- the postcondition ------------------------------------------------------------------------
def test_site_edits_verify_that_the_removed_channels_are_gone(monkeypatch):
    model = load_model(corpus.conv_bn_chain())
    sites = ConstantEditor(ModelEditor(model))
    sites.remove("conv0", 1, 0, [1, 2])
    sites.remove("bn0", 1, 0, [1, 2])
    sites.apply()
    assert sites.editor.value("conv0.weight").shape == (6, 3, 3, 3)
    sites.verify(sites.editor.model)  # the edited copy has lost them
    with pytest.raises(EditError, match="'conv0'.*\\(8, 3, 3, 3\\)"):
        sites.verify(model)  # the source still has them: a bug, not a user error
    assert not issubclass(EditError, OnnxDiagError)

    def broken(self, model):
        raise EditError("rows left")

    monkeypatch.setattr(ConstantEditor, "verify", broken)
    structure = analyze_structure(model)
    with pytest.raises(EditError, match="rows left.*leaving them out"):
        prune_channels(model, structure, {0: [1]})
