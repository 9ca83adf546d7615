"""METHODS §C1 repair: BN recalibration as a fixed point, CR+BN ≈ BN, folded-BN affine, s = 0."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from corpus import (
    conv_bias_add,
    conv_bn_chain,
    conv_bn_folded,
    conv_on_1x1_spatial,
    random_feeds,
    relu6_constant_clip,
    residual_block,
    run_ort,
)

from onnxdiag.data.source import open_data
from onnxdiag.errors import OnnxDiagError
from onnxdiag.graph import GraphIndex, analyze_structure
from onnxdiag.model.io import get_input_specs, load_model, model_hash
from onnxdiag.runtime.runner import OrtRunner
from onnxdiag.sparsity import (
    METHODS,
    allocate_sparsity,
    describe_layers,
    find_prunable,
    make_masks,
    read_weights,
    repair_model,
)
from onnxdiag.sparsity.repair import cr_alpha


def _setup(build, S=0.6, rule="uniform"):
    model = load_model(build())
    structure = analyze_structure(model)
    layers = find_prunable(structure)
    weights = read_weights(model, layers)
    alloc = allocate_sparsity(rule, describe_layers(model, layers), S, weights=weights)
    calib = [random_feeds(model, batch=4, seed=i) for i in range(3)]
    return model, structure, make_masks(alloc, weights), calib


def _stats(model, calib, tensors):
    """Per-channel mean and unbiased variance of ``tensors`` over the calibration set."""
    outs = [run_ort(model, f, tensors) for f in calib]
    result = {}
    for t in tensors:
        x = np.concatenate([o[t] for o in outs]).astype(np.float64)
        rows = np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])
        result[t] = (rows.mean(0), rows.var(0, ddof=1))
    return result


def assert_same_initializers(fast, slow, rel: float) -> None:
    """The two models have the same initializers, each within ``rel`` of its largest
    magnitude (at least 1e-3)."""
    a = {t.name: onnx.numpy_helper.to_array(t) for t in fast.graph.initializer}
    b = {t.name: onnx.numpy_helper.to_array(t) for t in slow.graph.initializer}
    assert a.keys() == b.keys()
    for k in a:
        scale = max(float(np.abs(b[k]).max()), 1e-3)
        assert np.abs(a[k].astype(np.float64) - b[k]).max() <= rel * scale, k


def _logits(model, calib):
    return np.concatenate([run_ort(model, f)["logits"] for f in calib])


@pytest.mark.parametrize("build", [conv_bn_chain, residual_block])
@pytest.mark.parametrize("method", ["bn", "cr+bn", "shrunk-cr+bn"])
def test_bn_recalibration_equals_the_repaired_models_own_statistics(build, method):
    model, structure, masks, calib = _setup(build)
    out, record = repair_model(model, structure, masks, calib, method=method)
    index = GraphIndex(out)
    bns = [n for n in index.nodes if n.op_type == "BatchNormalization"]
    assert sorted(record.bns) == sorted(b.name for b in bns)  # every conv here is pruned
    stats = _stats(out, calib, [b.input[0] for b in bns])
    for bn in bns:
        mean, var = stats[bn.input[0]]
        np.testing.assert_allclose(index.get_constant(bn.input[3]), mean, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(index.get_constant(bn.input[4]), var, rtol=1e-4, atol=1e-6)


def test_cr_plus_bn_equals_bn_only_when_no_channel_collapses():
    model, structure, masks, calib = _setup(residual_block, S=0.5)
    bn_only, _ = repair_model(model, structure, masks, calib, method="bn")
    crbn, record = repair_model(model, structure, masks, calib, method="cr+bn")
    assert all(r.n_capped == 0 for r in record.layers.values())
    a, b = _logits(bn_only, calib), _logits(crbn, calib)
    np.testing.assert_allclose(a, b, atol=2e-3 * np.abs(a).max())


def test_cr_matches_the_dense_standard_deviation_layer_by_layer():
    model, structure, masks, calib = _setup(conv_bn_chain, S=0.7)
    out, record = repair_model(model, structure, masks, calib, method="cr")
    convs = ["conv0", "conv1"]
    dense = _stats(model, calib, convs)
    after = _stats(out, calib, convs)
    for c in convs:
        np.testing.assert_allclose(np.sqrt(after[c][1]), np.sqrt(dense[c][1]), rtol=1e-4)
        assert record.layers[c].kind == "scale"
    out, _ = repair_model(model, structure, masks, calib, method="layer-cr")
    after = _stats(out, calib, convs)
    for c in convs:  # one scalar per layer: the pooled variance is matched
        assert after[c][1].mean() == pytest.approx(dense[c][1].mean(), rel=1e-4)


@pytest.mark.parametrize("build, tensors", [(conv_bn_folded, ["conv0", "conv1"]),
                                            (conv_bias_add, ["conv0_bias"])])
def test_folded_bn_affine_restores_dense_mean_and_std(build, tensors):
    model, structure, masks, calib = _setup(build, S=0.7)
    dense = _stats(model, calib, tensors)
    results = []
    for method in ("cr+bn", "bn"):
        out, record = repair_model(model, structure, masks, calib, method=method)
        assert {r.kind for r in record.layers.values()} == {"affine"}
        after = _stats(out, calib, tensors)
        for t in tensors:
            np.testing.assert_allclose(after[t][0], dense[t][0], atol=1e-4)
            np.testing.assert_allclose(after[t][1], dense[t][1], rtol=1e-4)
        results.append(_logits(out, calib))
    np.testing.assert_allclose(results[0], results[1], atol=1e-5)  # channel CR α is BN's α


@pytest.mark.parametrize("method", METHODS)
def test_sparsity_zero_leaves_the_model_unchanged(method):
    model, structure, _, calib = _setup(residual_block)
    masks = {name: np.ones_like(w, dtype=bool)
             for name, w in read_weights(model, find_prunable(structure)).items()}
    out, _ = repair_model(model, structure, masks, calib, method=method)
    np.testing.assert_allclose(_logits(out, calib), _logits(model, calib), atol=1e-5)
    # with every BN recalibrated, a calibrated dense model is a fixed point
    calibrated, _ = repair_model(model, structure, masks, calib, method="bn", recalibrate="all")
    again, _ = repair_model(calibrated, structure, masks, calib, method=method, recalibrate="all")
    np.testing.assert_allclose(_logits(again, calib), _logits(calibrated, calib), atol=1e-5)


@pytest.mark.parametrize("build", [residual_block, conv_bn_folded, conv_bias_add])
@pytest.mark.parametrize("method", METHODS)
def test_emitted_model_is_valid_and_the_input_untouched(build, method):
    model, structure, masks, calib = _setup(build, S=0.9, rule="erk")
    before = model_hash(model)
    out, record = repair_model(model, structure, masks, calib, method=method)
    assert model_hash(model) == before
    onnx.checker.check_model(out, full_check=True)
    assert np.isfinite(_logits(out, calib)).all()
    record.to_dict(arrays=True)


def test_sequential_pass_runs_every_node_once(monkeypatch):
    model, structure, masks, calib = _setup(residual_block)
    sessions = []
    original = OrtRunner.__init__

    def spy(self, m, **kwargs):
        sessions.append([n.name for n in m.graph.node])
        original(self, m, **kwargs)

    monkeypatch.setattr(OrtRunner, "__init__", spy)
    _, record = repair_model(model, structure, masks, calib, method="cr+bn")
    segments = sessions[1:]  # the first session is the dense pass
    assert record.passes == {"dense": 1, "sequential": 1, "segments": len(segments)}
    assert len(segments) == 6  # one per conv (each BN reads its conv's output directly)
    executed = [n for seg in segments for n in seg]
    assert len(executed) == len(set(executed))


def test_repair_accepts_a_data_source_and_counts_images():
    model, structure, masks, _ = _setup(conv_bn_chain)
    x = np.random.default_rng(0).normal(size=(10, 3, 8, 8)).astype(np.float32)
    source = open_data({"x": x}, get_input_specs(model), batch_size=4)
    _, record = repair_model(model, structure, masks, source, n_images=6)
    assert record.n_images == 6


def test_cr_alpha_variants():
    vd, vp = np.array([1.0, 1.0, 1.0]), np.array([0.25, 1.0, 4.0])
    np.testing.assert_allclose(cr_alpha("channel", vd, vp), [2, 1, 0.5], rtol=1e-7)
    # shrunk: r = [0.25, 1, 4], median 1, λ = [0.2, 0.5, 0.8]
    np.testing.assert_allclose(cr_alpha("shrunk", vd, vp), [2 ** 0.2, 1, 0.5 ** 0.8], rtol=1e-7)
    np.testing.assert_allclose(cr_alpha("layer", vd, vp), np.sqrt(1 / 1.75), rtol=1e-7)
    assert cr_alpha("channel", np.array([1.0]), np.array([0.0]), cap=100)[0] == 100


def test_unknown_method_is_a_user_error():
    model, structure, masks, calib = _setup(conv_bn_chain)
    with pytest.raises(OnnxDiagError, match="Unknown repair method"):
        repair_model(model, structure, masks, calib, method="magic")


@pytest.mark.parametrize("build", [relu6_constant_clip, conv_on_1x1_spatial])
@pytest.mark.parametrize("method", ["bn", "cr+bn"])
def test_repair_handles_constant_nodes_and_1x1_spatial_inputs(build, method):
    """Regression (found on the zoo's MobileNetV2 and VGG-16-BN): scalar Constant outputs
    read across repair segments, and im2col of a 3×3 conv on a 1×1 input."""
    model, structure, masks, calib = _setup(build, S=0.5, rule="uniform")
    out, _ = repair_model(model, structure, masks, calib, method=method)
    onnx.checker.check_model(out, full_check=True)
    # BN recalibration is a fixed point of the repaired model's own statistics
    bn_inputs = [n.input[0] for n in out.graph.node if n.op_type == "BatchNormalization"]
    stats = _stats(out, calib, bn_inputs)
    index = GraphIndex(out)
    for node in (n for n in out.graph.node if n.op_type == "BatchNormalization"):
        mean, var = stats[node.input[0]]
        np.testing.assert_allclose(index.get_constant(node.input[3]), mean, atol=1e-4)
    masks_all = {k: np.ones_like(v) for k, v in masks.items()}
    dense, _ = repair_model(model, structure, masks_all, calib, method=method)
    np.testing.assert_allclose(_logits(dense, calib), _logits(model, calib), atol=1e-5)


@pytest.mark.parametrize("build", [residual_block, conv_bn_chain])
def test_recalibrate_batchnorm_after_channel_removal_is_a_fixed_point(build):
    """On a model with channels physically removed, every BN's new running statistics
    equal the mean / unbiased variance of its input in the recalibrated model itself
    (upstream BNs recalibrated first), the input model is untouched, and a second
    recalibration changes nothing."""
    from onnxdiag.sparsity.repair import recalibrate_batchnorm
    from onnxdiag.structured import plan_pruning, prune_channels
    from onnxdiag.structured.scores import magnitude_scores

    model = load_model(build())
    structure = analyze_structure(model)
    plan = plan_pruning(model, structure, magnitude_scores(model, structure), 0.5)
    pruned, _ = prune_channels(model, structure, plan)
    before = model_hash(pruned)
    calib = [random_feeds(pruned, batch=5, seed=i) for i in range(3)]
    out, record = recalibrate_batchnorm(pruned, calib)
    assert model_hash(pruned) == before
    index = GraphIndex(out)
    bns = [n for n in index.nodes if n.op_type == "BatchNormalization"]
    assert bns and sorted(record.bns) == sorted(b.name for b in bns)
    assert record.n_images == 15 and record.passes["sequential"] == 1
    stats = _stats(out, calib, [b.input[0] for b in bns])
    for bn in bns:
        mean, var = stats[bn.input[0]]
        np.testing.assert_allclose(index.get_constant(bn.input[3]), mean, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(index.get_constant(bn.input[4]), var, rtol=1e-4, atol=1e-6)
    again, _ = recalibrate_batchnorm(out, calib)
    np.testing.assert_allclose(_logits(again, calib), _logits(out, calib), rtol=1e-4, atol=1e-5)


def test_recalibrate_batchnorm_without_bn_says_so():
    from onnxdiag.sparsity.repair import recalibrate_batchnorm

    model = load_model(conv_bn_folded())
    out, record = recalibrate_batchnorm(model, [random_feeds(model, batch=3)])
    assert record.bns == {} and record.layers == {}
    assert "2 conv(s) without BatchNormalization left" in record.notes[0]
    assert "nothing to recalibrate" in record.notes[1]
    np.testing.assert_array_equal(_logits(out, [random_feeds(model, batch=3)]),
                                  _logits(model, [random_feeds(model, batch=3)]))
    with pytest.raises(OnnxDiagError, match="at least 2 calibration samples"):
        recalibrate_batchnorm(model, [])


def test_recalibration_restandardises_folded_convs_to_the_dense_statistics_they_keep():
    """BN folded into the convs: with the dense model, every conv without BN gets
    y' = (y − μ^p)·σ^d/σ^p + μ^d, so in the recovered pruned model each conv output
    channel has the mean and std of the dense channel it kept (upstream repairs in
    place); the kept-channel map is the plan's."""
    from onnxdiag.sparsity.repair import recalibrate_batchnorm
    from onnxdiag.structured import kept_output_channels, plan_pruning, prune_channels
    from onnxdiag.structured.scores import magnitude_scores

    model = load_model(conv_bn_folded())
    structure = analyze_structure(model)
    plan = plan_pruning(model, structure, magnitude_scores(model, structure), 0.5)
    pruned, _ = prune_channels(model, structure, plan)
    kept = kept_output_channels(structure, plan.removed)
    assert sorted(kept) == ["conv0", "conv1"] and len(kept["conv0"]) == 4
    calib = [random_feeds(model, batch=6, seed=i) for i in range(3)]
    out, record = recalibrate_batchnorm(pruned, calib, dense_model=model, kept_channels=kept)
    assert sorted(record.layers) == ["conv0", "conv1"] and record.bns == {}
    assert all(r.kind == "affine" for r in record.layers.values())
    convs = ["conv0", "conv1"]
    dense, fixed = _stats(model, calib, convs), _stats(out, calib, convs)
    for name in convs:
        np.testing.assert_allclose(fixed[name][0], dense[name][0][kept[name]], rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(fixed[name][1], dense[name][1][kept[name]], rtol=1e-3,
                                   atol=1e-6)
    before = _stats(pruned, calib, ["conv1"])["conv1"][1]
    assert not np.allclose(before, dense["conv1"][1][kept["conv1"]], rtol=1e-2)


def test_kept_output_channels_index_the_original_channels():
    """Channel j of a pruned member is original channel kept[j]: the pruned BN's scale
    equals the original scale at the kept indices, for every narrowed member."""
    from onnxdiag.structured import kept_output_channels, plan_pruning, prune_channels
    from onnxdiag.structured.scores import random_scores

    model = load_model(residual_block())
    structure = analyze_structure(model)
    plan = plan_pruning(model, structure, random_scores(structure, seed=4), 0.5)
    pruned, record = prune_channels(model, structure, plan)
    kept = kept_output_channels(structure, plan.removed)
    assert set(kept) == set(record.widths)
    before, after = GraphIndex(model), GraphIndex(pruned)
    for name, idx in kept.items():
        bn = structure.get_layer(name).bn_node
        assert len(idx) == record.widths[name][1] and idx == sorted(idx)
        scale = before.get_constant(before.get_node(bn).input[1])
        np.testing.assert_array_equal(after.get_constant(after.get_node(bn).input[1]),
                                      scale[idx])


def _bns_sharing_parameters():
    """conv_bn_chain with bn1 reading bn0's four parameters (8 channels each side)."""
    import corpus

    g = corpus._G(2)
    a = g.bn(g.conv("x", "conv0", 3, 8, bias=False), "bn0", 8)
    c1 = g.conv(g.node("Relu", [a], "relu0"), "conv1", 8, 8, bias=False)
    g.nodes.append(onnx.helper.make_node(
        "BatchNormalization", [c1, *g.nodes[1].input[1:]], ["bn1"], name="bn1"))
    g.gemm(g.pool_flatten(g.node("Relu", ["bn1"], "relu1")), "head", 8, 5, out="logits")
    return g.model([corpus._image()], [corpus._logits()])


def test_recalibrating_bns_that_share_parameters_copies_them_first():
    # SegmentedPass reads each node's inputs when its segment runs, so the copy-on-write
    # copy of a shared BN parameter reaches its segment.
    model, structure, masks, calib = _setup(_bns_sharing_parameters)
    out, record = repair_model(model, structure, masks, calib, method="bn")
    assert sorted(record.bns) == ["bn0", "bn1"]
    index = GraphIndex(out)
    assert index.get_node("bn0").input[3] != index.get_node("bn1").input[3]


def _float64_path(monkeypatch):
    """The repair as before its float32 moments: every moment by Moments.update_axis
    (float64 copies) and every BN measured on its patched input (no derived moments, no
    stand-in BN)."""
    from onnxdiag.sparsity import recal, sequential
    from onnxdiag.stats import Moments

    monkeypatch.setattr(Moments, "update_channels", lambda self, x: self.update_axis(x, 1))
    monkeypatch.setattr(sequential, "scaled_moments", lambda rep: None)
    monkeypatch.setattr(sequential, "deferred_bn", lambda *args: None)
    assert recal.recalibrate_bn is sequential.recalibrate_bn


@pytest.mark.parametrize("build", [conv_bn_chain, residual_block, conv_bn_folded])
@pytest.mark.parametrize("method", ["cr+bn", "bn", "cr", "shrunk-cr+bn"])
def test_fast_moments_give_the_float64_repair(build, method, monkeypatch):
    """Float32 pairwise channel moments, a CR-scaled conv's BN statistics taken from the
    conv's measured moments, the in-place patch: the repaired initializers equal the
    float64 path's to float32 rounding, and the outputs agree."""
    model, structure, masks, calib = _setup(build)
    fast, rec_fast = repair_model(model, structure, masks, calib, method=method)
    with monkeypatch.context() as m:
        _float64_path(m)
        slow, rec_slow = repair_model(model, structure, masks, calib, method=method)
    assert rec_fast.passes == rec_slow.passes
    assert_same_initializers(fast, slow, 2e-6)
    np.testing.assert_allclose(_logits(fast, calib), _logits(slow, calib), rtol=1e-5,
                               atol=1e-5)


def test_dense_moments_cache_is_shared_by_repairs():
    """A cache given to repair_model is filled once: a second repair (another method,
    another mask) runs no dense pass and gives the model a fresh repair gives."""
    model, structure, masks, calib = _setup(conv_bn_folded)
    cache: dict = {}
    _, first = repair_model(model, structure, masks, calib, method="cr+bn", dense=cache)
    assert first.passes["dense"] == 1 and cache
    model2, structure2, masks2, _ = _setup(conv_bn_folded, S=0.8)
    cached, second = repair_model(model2, structure2, masks2, calib, method="cr", dense=cache)
    fresh, _ = repair_model(model2, structure2, masks2, calib, method="cr")
    assert second.passes["dense"] == 0
    for t, u in zip(cached.graph.initializer, fresh.graph.initializer):
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(t),
                                      onnx.numpy_helper.to_array(u))


def test_split_batches_cuts_runs_by_input_values_and_the_repair_ignores_the_split():
    """split_batches: runs of at most max_values input values (≥ 1 sample), in order, all
    samples once; a repair on 12 samples in one batch equals the repair on 4 + 4 + 4."""
    from onnxdiag.sparsity.segments import split_batches

    feeds = [{"x": np.arange(5 * 6, dtype=np.float32).reshape(5, 6), "y": np.arange(5)}]
    runs = split_batches(feeds, max_values=15)  # 7 values per sample: 2 per run
    assert [len(r["y"]) for r in runs] == [2, 2, 1]
    np.testing.assert_array_equal(np.concatenate([r["x"] for r in runs]), feeds[0]["x"])
    assert [len(r["y"]) for r in split_batches(feeds, max_values=1)] == [1] * 5
    model, structure, masks, calib = _setup(residual_block)
    whole = [{k: np.concatenate([f[k] for f in calib]) for k in calib[0]}]
    a, _ = repair_model(model, structure, masks, whole, method="cr+bn")
    b, _ = repair_model(model, structure, masks, calib, method="cr+bn")
    for t, u in zip(a.graph.initializer, b.graph.initializer):
        x, y = onnx.numpy_helper.to_array(t), onnx.numpy_helper.to_array(u)
        assert np.abs(x.astype(np.float64) - y).max() <= 1e-6 * max(np.abs(y).max(), 1e-3)


@pytest.mark.parametrize("method", ["cr+bn", "cr", "layer-cr+bn"])
def test_pruned_moments_folded_during_the_pass_equal_those_folded_after(method, monkeypatch):
    """The sequential pass folds each measured layer's batches into its pruned moments on
    worker threads as the segment runs on; the repair then never folds them itself, and
    the repaired model is bit for bit the one whose moments are folded after each segment
    (the early fold turned off). With one batch the fold stays after the segment."""
    from onnxdiag.sparsity import fold, sequential

    model, structure, masks, calib = _setup(residual_block)
    late_calls = []
    real = fold.batch_moments
    monkeypatch.setattr(fold, "batch_moments",
                        lambda layer, arrays: late_calls.append(layer) or real(layer, arrays))
    early, record = repair_model(model, structure, masks, calib, method=method)
    assert record.layers and late_calls == []  # every layer: its moments came from the pass
    real_early = sequential._fold_early
    monkeypatch.setattr(sequential, "_fold_early", lambda *args: None)
    late, record_late = repair_model(model, structure, masks, calib, method=method)
    assert len(late_calls) == len(record_late.layers)  # each folded after its segment
    for t, u in zip(early.graph.initializer, late.graph.initializer):
        assert t.name == u.name
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(t),
                                      onnx.numpy_helper.to_array(u))
    for name, rep in record.layers.items():
        np.testing.assert_array_equal(rep.alpha, record_late.layers[name].alpha)
    # one batch: nothing to overlap, so each layer is folded after its segment
    monkeypatch.setattr(sequential, "_fold_early", real_early)
    late_calls.clear()
    whole = [{k: np.concatenate([f[k] for f in calib]) for k in calib[0]}]
    _, record_one = repair_model(model, structure, masks, whole, method=method)
    assert len(late_calls) == len(record_one.layers)


def test_pass_logits_equal_a_fresh_run_of_the_repaired_model():
    """A sweep cell's agreement comes from the repair pass's logits: they equal a fresh
    ONNX Runtime run of the repaired model to float32 rounding, with the same top-1."""
    from onnxdiag.data.source import open_data
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model
    from onnxdiag.sparsity.sweep import Pruner, materialize

    m = load_model(ROOT_MODEL := "models/sample/model.onnx")
    specs = get_input_specs(m)
    name = specs[0].name if hasattr(specs[0], "name") else next(iter(specs))
    with np.load("models/sample/calib.npz") as z:
        x = z["input"][:128].astype(np.float32)
    p = Pruner(m, analyze_structure(m), materialize(open_data({name: x}, specs, batch_size=64)))
    for method in ("cr+bn", "bn", "shrunk-cr"):
        pruned, record = p.prune(p.allocate("uniform", 0.9), method)
        from_pass, fresh = p.pass_logits_of(record), p.logits(pruned)
        assert from_pass is not None, ROOT_MODEL
        assert np.abs(from_pass - fresh).max() <= 1e-5 * np.abs(fresh).max()
        assert (from_pass.argmax(1) == fresh.argmax(1)).all()
    pruned, record = p.prune(p.allocate("uniform", 0.9), "none")
    assert p.pass_logits_of(record) is None  # no pass: measure() runs a fresh session


@pytest.mark.parametrize("build", [residual_block, conv_bn_folded])
def test_rr_capture_output_moments_replace_the_repairs_dense_pass(build):
    """compute_rr_curves(output_moments=True) folds every non-head layer's dense output
    moments in its capture pass: they equal the repairs' own dense pass to float32
    rounding, the curves are unchanged, and a repair given them runs no dense pass and
    writes the same model."""
    from onnxdiag.sparsity import compute_rr_curves
    from onnxdiag.sparsity.fold import dense_moments

    model, structure, masks, calib = _setup(build, S=0.7)
    layers = find_prunable(structure)
    plain = compute_rr_curves(model, layers, calib, n_images=12)
    both = compute_rr_curves(model, layers, calib, n_images=12, output_moments=True)
    assert plain.output_moments is None
    np.testing.assert_allclose(both.rr, plain.rr, rtol=1e-4, atol=1e-7)
    want = dense_moments(model, [la for la in layers if not la.is_head], calib, None, None)
    assert set(both.output_moments) == set(want) and want
    for name, m in want.items():
        got = both.output_moments[name]
        assert got.n == m.n
        sigma = np.sqrt(m.var())
        np.testing.assert_allclose(got.mean, m.mean, rtol=0, atol=1e-5 * sigma.max())
        np.testing.assert_allclose(got.var(), m.var(), rtol=1e-5, atol=1e-12)
    cache = dict(both.output_moments)
    seeded, record = repair_model(model, structure, masks, calib, dense=cache)
    fresh, own = repair_model(model, structure, masks, calib)
    assert record.passes["dense"] == 0 and own.passes["dense"] == 1
    for t, u in zip(seeded.graph.initializer, fresh.graph.initializer):
        x, y = onnx.numpy_helper.to_array(t), onnx.numpy_helper.to_array(u)
        assert np.abs(x.astype(np.float64) - y).max() <= 1e-5 * max(np.abs(y).max(), 1e-3)
    np.testing.assert_allclose(_logits(seeded, calib), _logits(fresh, calib), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("sizes", [[5, 5, 2], [1, 7], [4]])
def test_batch_moments_merge_each_batch_in_order(sizes, monkeypatch):
    """The repairs' per-batch moments (each batch folded on a thread, merged in order)
    equal the float64 moments of all the batches to float32 rounding, and do not depend
    on the number of threads, bit for bit."""
    from types import SimpleNamespace

    from onnxdiag.runtime import pool
    from onnxdiag.sparsity.fold import batch_moments

    rng = np.random.default_rng(5)
    batches = [(rng.normal(size=(n, 6, 9, 9)) * rng.uniform(0.2, 4, (1, 6, 1, 1)) + 30
                ).astype(np.float32) for n in sizes]
    conv = SimpleNamespace(op_type="Conv")
    ref = np.moveaxis(np.concatenate(batches), 1, -1).reshape(-1, 6).astype(np.float64)
    results = []
    for threads in (1, 3):
        monkeypatch.setattr(pool, "THREADS", threads)
        m = batch_moments(conv, [b.copy() for b in batches])
        assert m.n == ref.shape[0]
        assert np.abs(m.mean - ref.mean(axis=0)).max() <= 1e-6 * ref.std(axis=0).min()
        np.testing.assert_allclose(m.var(), ref.var(axis=0, ddof=1), rtol=2e-6)
        results.append((m.mean, m.var()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_bn_stand_in_is_the_bn_of_the_scaled_input():
    """The BN a segment runs on an unpatched conv output y (recal.bn_stand_in) gives, in
    ONNX Runtime, what the model's BN gives for α₃₂·y, to float32 rounding, a zero α
    included; deferred_bn offers it only for a BN that alone reads the tensor."""
    from onnx import helper

    from onnxdiag.model.edit import ModelEditor
    from onnxdiag.sparsity.recal import bn_stand_in, deferred_bn

    model = conv_bn_chain()
    editor = ModelEditor(model)
    bn = editor.index.get_node("bn0")
    assert deferred_bn(editor, "conv0", ()) is bn
    assert deferred_bn(editor, "conv0", ("conv0",)) is None  # the pass returns it
    alpha = np.random.default_rng(2).uniform(0.3, 3.0, 8)
    alpha[3] = 0.0
    stand_in, inits = bn_stand_in(editor, bn, alpha)
    assert (stand_in.name, list(stand_in.output)) == ("bn0", list(bn.output))

    def run_bn(node, initializers, y):
        graph = helper.make_graph(
            [node], "bn", [helper.make_tensor_value_info("conv0", onnx.TensorProto.FLOAT,
                                                         ["N", 8, 5, 5])],
            [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT,
                                           ["N", 8, 5, 5])],
            initializers)
        m = helper.make_model(graph, opset_imports=list(model.opset_import))
        m.ir_version = model.ir_version
        onnx.checker.check_model(m, full_check=True)
        return OrtRunner(m).run({"conv0": y})[node.output[0]]

    y = np.random.default_rng(3).normal(0.5, 2.0, (4, 8, 5, 5)).astype(np.float32)
    own = [t for t in model.graph.initializer if t.name in bn.input]
    want = run_bn(bn, own, y * alpha.astype(np.float32)[None, :, None, None])
    got = run_bn(stand_in, inits, y)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    shared = onnx.ModelProto()
    shared.CopyFrom(model)
    shared.graph.output.append(helper.make_tensor_value_info("conv0", onnx.TensorProto.FLOAT,
                                                             None))
    assert deferred_bn(ModelEditor(shared), "conv0", ()) is None  # a second reader
