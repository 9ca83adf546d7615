"""The segmented pass (sparsity/segments.py) on a Paddle-style export: every weight, BN
statistic and head parameter held by a Constant node instead of an initializer.

Equivalence oracles: (1) running the segments with an edit between them gives what one
ONNX Runtime session gives on the model edited up front; (2) repairing the Constant-node
model gives the same model outputs and repair record as repairing its initializer twin.
"""

from __future__ import annotations

import corpus
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiag.graph import analyze_structure
from onnxdiag.model.edit import ModelEditor
from onnxdiag.model.expose import expose_tensors
from onnxdiag.model.io import load_model
from onnxdiag.sparsity import (
    allocate_sparsity,
    describe_layers,
    find_prunable,
    make_masks,
    read_weights,
    repair_model,
)
from onnxdiag.sparsity.segments import SegmentedPass


def _paddle_style(constants: bool = True, seed: int = 0) -> onnx.ModelProto:
    """x (N,3,8,8) → Conv "conv0" (8) → BatchNormalization "bn0" → Relu → Conv "conv1" (16,
    stride 2) → BatchNormalization "bn1" → Relu → GlobalAveragePool → Flatten → Gemm "head"
    (16 → 5) → logits.  With ``constants`` every parameter is the output of a Constant node
    placed where Paddle puts it, right before its reader; else the same values are
    initializers."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def param(name, value):
        tensor = numpy_helper.from_array(np.asarray(value, np.float32), name)
        if constants:
            nodes.append(helper.make_node("Constant", [], [name], name=f"{name}.const",
                                          value=tensor))
        else:
            inits.append(tensor)
        return name

    def conv_bn(x, name, c_in, c_out, stride):
        w = param(f"{name}.w", rng.normal(0, 1 / np.sqrt(9 * c_in), (c_out, c_in, 3, 3)))
        nodes.append(helper.make_node("Conv", [x, w], [name], name=name, kernel_shape=[3, 3],
                                      pads=[1] * 4, strides=[stride] * 2))
        bn = [param(f"{name}.bn.{k}", v) for k, v in (
            ("scale", rng.uniform(0.5, 1.5, c_out)), ("bias", rng.normal(0, 0.1, c_out)),
            ("mean", rng.normal(0, 0.1, c_out)), ("var", rng.uniform(0.5, 1.5, c_out)))]
        nodes.append(helper.make_node("BatchNormalization", [name, *bn], [f"bn{name[-1]}"],
                                      name=f"bn{name[-1]}", epsilon=1e-5))
        nodes.append(helper.make_node("Relu", [f"bn{name[-1]}"], [f"{name}.relu"],
                                      name=f"{name}.relu"))
        return f"{name}.relu"

    h = conv_bn(conv_bn("x", "conv0", 3, 8, 1), "conv1", 8, 16, 2)
    nodes.append(helper.make_node("GlobalAveragePool", [h], ["pool"], name="pool"))
    nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], name="flat"))
    w, b = param("head.w", rng.normal(0, 0.25, (5, 16))), param("head.b", rng.normal(0, .1, 5))
    nodes.append(helper.make_node("Gemm", ["flat", w, b], ["logits"], name="head", transB=1))
    graph = helper.make_graph(
        nodes, "paddle_style", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                              ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _calib(model, n=3):
    return [corpus.random_feeds(model, batch=4, seed=10 + i) for i in range(n)]


def test_edits_between_segments_reach_constant_node_readers():
    """Rewire bn1's mean and var (Constant nodes) to new initializers after the first
    segment: the segments' logits equal one session on the model edited up front."""
    model = load_model(_paddle_style())
    calib = _calib(model)
    new_mean, new_var = np.linspace(-1, 1, 16), np.linspace(0.5, 2, 16)

    def edit(editor):  # as the repairs do: through the editor whose model the pass runs
        editor.set_input("bn1", 3, new_mean.astype(np.float32))
        editor.set_input("bn1", 4, new_var.astype(np.float32))

    editor = ModelEditor(model)
    seg = SegmentedPass(editor.model, calib, providers="cpu")
    seg.run_to(seg.position("conv1"), keep=["conv1"])
    edit(editor)
    seg.run_to(seg.position("logits"), keep=["logits"])
    assert seg.n_segments == 2
    reference = ModelEditor(load_model(_paddle_style()))
    edit(reference)
    edited = reference.finish()
    for i, feeds in enumerate(calib):
        want = corpus.run_ort(edited, feeds)["logits"]
        np.testing.assert_allclose(seg.frontier["logits"][i], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["cr+bn", "bn", "cr"])
def test_repair_of_constant_node_weights_equals_the_initializer_twin(method):
    results = []
    for constants in (True, False):
        model = load_model(_paddle_style(constants))
        structure = analyze_structure(model)
        layers = find_prunable(structure)
        weights = read_weights(model, layers)
        alloc = allocate_sparsity("uniform", describe_layers(model, layers), 0.6,
                                  weights=weights)
        repaired, record = repair_model(model, structure, make_masks(alloc, weights),
                                        _calib(model), method=method)
        onnx.checker.check_model(repaired, full_check=True)
        results.append((repaired, record))
    (a, rec_a), (b, rec_b) = results
    assert set(rec_a.layers) == set(rec_b.layers) and set(rec_a.bns) == set(rec_b.bns)
    assert rec_a.layers or rec_a.bns
    for name in rec_a.layers:
        np.testing.assert_allclose(rec_a.layers[name].alpha, rec_b.layers[name].alpha,
                                   rtol=1e-6)
    for name in rec_a.bns:
        np.testing.assert_allclose(rec_a.bns[name].var, rec_b.bns[name].var, rtol=1e-6)
    feeds = corpus.random_feeds(a, batch=5, seed=3)
    np.testing.assert_allclose(corpus.run_ort(a, feeds)["logits"],
                               corpus.run_ort(b, feeds)["logits"], rtol=1e-5, atol=1e-6)


def test_shared_arena_segments_equal_own_arenas_and_one_session():
    """The bundled torch export measured at every conv output, its segments' sessions
    sharing one CPU arena (runtime/arena.py) or each with its own: the same arrays bit
    for bit, and one session's values of the same tensors to float rounding."""
    model = load_model("models/sample/model.onnx")
    layers = find_prunable(analyze_structure(model))
    name = model.graph.input[0].name
    x = np.random.default_rng(0).random((40, 1, 28, 28), np.float32)
    calib = [{name: x[:24]}, {name: x[24:]}]
    runs = []
    for shared in (True, False):
        seg = SegmentedPass(model, calib, providers="cpu", shared_arena=shared)
        seen = {}
        for la in layers:
            seg.run_to(seg.position(la.output), keep=[la.output])
            seen[la.output] = [a.copy() for a in seg.frontier[la.output]]
        assert seg.n_segments == len(layers)
        runs.append(seen)
    outputs = [la.output for la in layers]
    for t in outputs:
        for a, b in zip(runs[0][t], runs[1][t]):
            np.testing.assert_array_equal(a, b)
    exposed = expose_tensors(model, outputs)
    for i, feeds in enumerate(calib):
        want = corpus.run_ort(exposed, feeds)
        for t in outputs:
            np.testing.assert_allclose(runs[0][t][i], want[t], rtol=1e-4, atol=1e-5)


def test_shared_arena_is_set_for_cpu_sessions_only():
    import onnxruntime as ort

    from onnxdiag.runtime.arena import shared_cpu_arena, use_shared_arena

    assert shared_cpu_arena() and shared_cpu_arena()  # registered once, then reused
    options = ort.SessionOptions()
    assert use_shared_arena(options, ["CPUExecutionProvider"])
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    other = ort.SessionOptions()
    assert not use_shared_arena(other, ["CUDAExecutionProvider", "CPUExecutionProvider"])
