"""model_io: loading (paths, bytes, old IR, external data), names, hashing, atomic saving."""

import os

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto, numpy_helper

from onnxdiag.errors import ModelLoadError, OutputError
from onnxdiag.model import io as model_io
from onnxdiag.runtime.runner import OrtRunner


def _gemm_model(*, opset=17, ir=None, init_as_inputs=False, names=("", "")):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(3, 4)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.normal(size=3).astype(np.float32), "b")
    nodes = [oh.make_node("Gemm", ["x", "W", "b"], ["u"], transB=1, name=names[0]),
             oh.make_node("Softmax", ["u"], ["p"], axis=1, name=names[1])]
    inputs = [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])]
    if init_as_inputs:
        inputs += [oh.make_tensor_value_info("W", TensorProto.FLOAT, [3, 4]),
                   oh.make_tensor_value_info("b", TensorProto.FLOAT, [3])]
    graph = oh.make_graph(nodes, "g", inputs,
                          [oh.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 3])], [w, b])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    if ir is not None:
        model.ir_version = ir
    return model


def test_load_from_path_bytes_and_proto_agree(tmp_path):
    model = _gemm_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    hashes = {model_io.model_hash(model_io.load_model(src))
              for src in (path, str(path), path.read_bytes(), model)}
    assert len(hashes) == 1


def test_load_never_modifies_the_given_proto():
    model = _gemm_model()
    before = model.SerializeToString()
    loaded = model_io.load_model(model)
    assert model.SerializeToString() == before
    assert [n.name for n in loaded.graph.node] == ["Gemm_0", "Softmax_1"]


def test_unique_node_names_for_empty_and_duplicate_names():
    loaded = model_io.load_model(_gemm_model(names=("dup", "dup")))
    names = [n.name for n in loaded.graph.node]
    assert len(set(names)) == 2 and all(names)


def test_opset9_initializers_listed_as_inputs_are_dropped_from_inputs():
    model = _gemm_model(opset=9, ir=3, init_as_inputs=True)
    loaded = model_io.load_model(model)
    assert [i.name for i in loaded.graph.input] == ["x"]
    x = np.ones((2, 4), np.float32)
    ref = OrtRunner(model).run({"x": x})["p"]
    got = OrtRunner(loaded).run({"x": x})["p"]
    np.testing.assert_array_equal(ref, got)


def test_shapes_are_inferred():
    loaded = model_io.load_model(_gemm_model())
    assert "u" in {v.name for v in loaded.graph.value_info}


@pytest.mark.parametrize("data, fragment", [
    (b"", "not a valid ONNX model"),
    (b"this is not onnx", "not a valid ONNX file"),
])
def test_bad_bytes_raise_model_load_error(data, fragment):
    with pytest.raises(ModelLoadError, match=fragment):
        model_io.load_model(data)


def test_truncated_file_is_refused(tmp_path):
    data = _gemm_model().SerializeToString()
    for cut in (len(data) // 3, len(data) - 7):
        path = tmp_path / f"t{cut}.onnx"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError):
            model_io.load_model(path)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_io.load_model(tmp_path / "nope.onnx")
    with pytest.raises(ModelLoadError, match="is a folder"):
        model_io.load_model(tmp_path)


def test_external_data_roundtrip_with_small_threshold(tmp_path):
    model = model_io.load_model(_gemm_model())
    out = model_io.save_model(model, tmp_path / "ext.onnx", size_threshold=16)
    assert (tmp_path / "ext.onnx.data").is_file()
    stored = onnx.load(out, load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in stored.graph.initializer)
    reloaded = model_io.load_model(out)
    assert model_io.model_hash(reloaded) == model_io.model_hash(model)
    x = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)
    np.testing.assert_array_equal(OrtRunner(model).run({"x": x})["p"],
                                  OrtRunner(reloaded).run({"x": x})["p"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_hash_changes_with_weights():
    a = model_io.load_model(_gemm_model())
    b = onnx.ModelProto()
    b.CopyFrom(a)
    arr = numpy_helper.to_array(b.graph.initializer[0]).copy()
    arr[0, 0] += 1
    b.graph.initializer[0].CopyFrom(numpy_helper.from_array(arr, "W"))
    assert model_io.model_hash(a) != model_io.model_hash(b)


def test_save_refuses_to_overwrite_input(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_gemm_model(), path)
    before = path.read_bytes()
    with pytest.raises(OutputError, match="never overwrites an input"):
        model_io.save_model(model_io.load_model(path), path, protect=[path])
    assert path.read_bytes() == before


def test_save_to_unwritable_folder(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("x")
        target = blocker / "sub" / "m.onnx"  # parent is a file: cannot be created
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "m.onnx"
    with pytest.raises(OutputError):
        model_io.save_model(model_io.load_model(_gemm_model()), target)


def test_a_session_over_the_protobuf_limit_runs_from_an_external_data_file(monkeypatch):
    """serialized() gives the model's bytes below PROTOBUF_LIMIT and None at it or above;
    an OrtRunner then loads the model from a file with external data: same outputs (the
    limit is lowered to this model's size to take that path without a 2 GiB model)."""
    model = _gemm_model()
    data = model_io.serialized(model)
    assert data == model.SerializeToString()
    x = {"x": np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)}
    ref = OrtRunner(model).run(x)["p"]
    monkeypatch.setattr(model_io, "PROTOBUF_LIMIT", len(data))
    assert model_io.serialized(model) is None
    runner = OrtRunner(model)
    assert runner._tmp is not None  # the external-data file path was taken
    np.testing.assert_array_equal(runner.run(x)["p"], ref)
