"""instrument.expose_tensors and the runner: equivalence of exposed graphs, providers."""

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto, numpy_helper

from onnxdiag.errors import OnnxDiagError
from onnxdiag.model import io as model_io
from onnxdiag.model.expose import expose_tensors
from onnxdiag.runtime.runner import OrtRunner, ort_info, resolve_providers


def _conv_bn_model():
    """x → Conv(4→8, 3×3) → BatchNormalization → Relu → GAP → Flatten → Gemm."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(8, 4, 3, 3)).astype(np.float32), "cw"),
        numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "cb"),
        numpy_helper.from_array(rng.uniform(0.5, 2, 8).astype(np.float32), "g"),
        numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "be"),
        numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "m"),
        numpy_helper.from_array(rng.uniform(0.5, 2, 8).astype(np.float32), "v"),
        numpy_helper.from_array(rng.normal(size=(5, 8)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(size=5).astype(np.float32), "b"),
    ]
    nodes = [
        oh.make_node("Conv", ["x", "cw", "cb"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        oh.make_node("BatchNormalization", ["c", "g", "be", "m", "v"], ["n"], name="bn"),
        oh.make_node("Relu", ["n"], ["r"], name="relu"),
        oh.make_node("GlobalAveragePool", ["r"], ["p"], name="gap"),
        oh.make_node("Flatten", ["p"], ["f"], name="flat"),
        oh.make_node("Gemm", ["f", "W", "b"], ["logits"], transB=1, name="fc"),
    ]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
        [oh.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])], inits)
    return model_io.load_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))


@pytest.fixture(scope="module")
def model():
    return _conv_bn_model()


def _x(n=7):
    return np.random.default_rng(3).normal(size=(n, 4, 6, 6)).astype(np.float32)


def test_expose_keeps_original_outputs_bit_identical(model):
    """Same graph computations → bit-identical outputs (no optimiser rewrites)."""
    exposed = expose_tensors(model, ["c", "f"])
    assert [o.name for o in exposed.graph.output] == ["logits", "c", "f"]
    onnx.checker.check_model(exposed, full_check=True)
    plain = OrtRunner(model, optimization="disabled").run({"x": _x()})
    more = OrtRunner(exposed, optimization="disabled").run({"x": _x()})
    np.testing.assert_array_equal(plain["logits"], more["logits"])
    assert more["c"].shape == (7, 8, 6, 6)


def test_expose_changes_outputs_only_by_fusion_rounding_when_optimised(model):
    """With ORT's Conv+BN fusion, exposing the Conv output keeps it unfused: float32
    rounding differences only (documented in the README)."""
    exposed = expose_tensors(model, ["c"])
    plain = OrtRunner(model).run({"x": _x()})["logits"]
    more = OrtRunner(exposed).run({"x": _x()})["logits"]
    np.testing.assert_allclose(plain, more, rtol=1e-5, atol=1e-5)
    exposed_head = expose_tensors(model, ["f"])  # nothing fused across 'f'
    np.testing.assert_array_equal(plain, OrtRunner(exposed_head).run({"x": _x()})["logits"])


def test_exposed_conv_output_is_pre_bn_under_full_optimisation(model):
    """Invariant 6: ORT must not fuse Conv+BN when the Conv output is exposed."""
    exposed = expose_tensors(model, ["c"])
    fast = OrtRunner(exposed, optimization="all").run({"x": _x()}, ["c"])["c"]
    ref = OrtRunner(exposed, optimization="disabled").run({"x": _x()}, ["c"])["c"]
    np.testing.assert_allclose(fast, ref, rtol=1e-5, atol=1e-5)
    # and it is the convolution itself, not the normalised tensor
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    x = _x().astype(np.float64)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    patches = np.stack([xp[:, :, i:i + 6, j:j + 6] for i in range(3) for j in range(3)], -1)
    w = init["cw"].astype(np.float64).reshape(8, 4, 9)
    direct = np.einsum("ncijk,ock->noij", patches, w) + init["cb"][None, :, None, None]
    np.testing.assert_allclose(fast, direct, rtol=1e-4, atol=1e-4)


def test_expose_does_not_modify_input_and_rejects_unknown(model):
    before = model.SerializeToString()
    expose_tensors(model, ["c"])
    assert model.SerializeToString() == before
    with pytest.raises(OnnxDiagError, match="not in the model"):
        expose_tensors(model, ["no_such_tensor"])
    with pytest.raises(OnnxDiagError, match="constant"):
        expose_tensors(model, ["cw"])


def test_providers_default_to_cpu_here_and_unknown_is_refused():
    info = ort_info()
    assert "CPUExecutionProvider" in info["available_providers"]
    chosen = resolve_providers(None)
    assert chosen[-1] == "CPUExecutionProvider"
    if "CUDAExecutionProvider" not in info["available_providers"]:
        assert chosen == ["CPUExecutionProvider"]
        with pytest.raises(OnnxDiagError, match="not available"):
            resolve_providers("cuda")


def test_runner_turns_bad_feeds_into_data_error(model):
    from onnxdiag.errors import DataError

    with pytest.raises(DataError, match="rejected the data"):
        OrtRunner(model).run({"x": np.zeros((2, 3, 6, 6), np.float32)})


def test_exposing_never_modifies_the_model_or_its_hash():
    """graphsurgeon's import writes into the proto it reads; expose works on a copy (the
    ViT sample's Constant nodes used to change the caller's model hash)."""
    from pathlib import Path

    from onnxdiag.model.expose import expose_tensors
    from onnxdiag.model.io import load_model, model_hash

    vit = Path(__file__).resolve().parents[1] / "models" / "vit" / "model.onnx"
    model = load_model(vit)
    before, data = model_hash(model), model.SerializeToString()
    expose_tensors(model, [model.graph.node[3].output[0]])
    assert model_hash(model) == before and model.SerializeToString() == data


def test_appended_outputs_equal_the_graphsurgeon_round_trip(model, monkeypatch):
    """Node outputs and graph inputs are appended to a copy directly (no graphsurgeon round
    trip): the same outputs, in the same order and types, and the same values in ONNX
    Runtime as the round trip gives."""
    from onnxdiag.model import expose

    names = ["n", "c", "x", "logits", "c", "f"]
    fast = expose_tensors(model, names)
    monkeypatch.setattr(expose, "_appended", lambda *a: None)
    slow = expose_tensors(model, names)
    assert ([o.name for o in fast.graph.output] == [o.name for o in slow.graph.output]
            == ["logits", "n", "c", "x", "f"])
    for a, b in zip(fast.graph.output, slow.graph.output):
        assert a.type.tensor_type.elem_type == b.type.tensor_type.elem_type
    out = [OrtRunner(m).run({"x": _x()}) for m in (fast, slow)]
    for name in out[1]:
        np.testing.assert_array_equal(out[0][name], out[1][name])
