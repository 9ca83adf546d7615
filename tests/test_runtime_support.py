"""A model the installed ONNX Runtime cannot run is one line naming the versions (session
creation in runtime/runner.py), not ORT's multi-line exception; other failures keep theirs."""

from __future__ import annotations

import re

import corpus
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxdiag.errors import ModelLoadError, OnnxDiagError
from onnxdiag.model.io import save_model
from onnxdiag.runtime.runner import OrtRunner


def _stamped(opset: int) -> onnx.ModelProto:
    model = corpus.conv_bn_chain()
    model.opset_import[0].version = opset
    return model


def _refusal(model) -> str:
    with pytest.raises(ModelLoadError) as info:
        OrtRunner(model, providers="cpu")
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    assert isinstance(info.value.__cause__, Exception)  # ORT's error, for --debug
    return message


def _opens(model) -> bool:
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.parametrize("as_path", [False, True])
def test_an_opset_newer_than_the_runtime_names_both_versions(tmp_path, as_path):
    model = _stamped(90)
    source = save_model(model, tmp_path / "new.onnx") if as_path else model
    message = _refusal(source)
    found = re.search(r"uses opset 90 of domain ai\.onnx, newer than the installed ONNX "
                      rf"Runtime {re.escape(ort.__version__)} supports \(up to opset (\d+)\)",
                      message)
    assert found, message
    top = int(found.group(1))
    assert f"re-export the model with opset {top} or lower" in message
    # the version named is this runtime's limit: it runs that opset, not the next one
    assert _opens(_stamped(top)) and not _opens(_stamped(top + 1))


def _tiny(node, elem=TensorProto.INT32, opsets=(("", 17),)) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, [2, 2])],
                              [helper.make_tensor_value_info("y", elem, [2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v)
                                                    for d, v in opsets])
    model.ir_version = 8
    return model


def test_an_operator_without_a_kernel_names_it_and_the_versions():
    message = _refusal(_tiny(helper.make_node("Gemm", ["x", "x"], ["y"], name="gemm_int")))
    assert f"ONNX Runtime {ort.__version__} has no kernel for Gemm (version 13, node " \
           "'gemm_int')" in message
    assert re.search(r"model opset ai\.onnx 17 \(runtime up to \d+\)", message), message


def test_an_unknown_operator_names_it():
    message = _refusal(_tiny(helper.make_node("FooBar", ["x"], ["y"], name="foo")))
    assert "does not know operator FooBar; model opset ai.onnx 17" in message
    custom = _tiny(helper.make_node("Relu", ["x"], ["y"], name="r", domain="com.example"),
                   opsets=(("", 17), ("com.example", 1)))
    assert "does not know operator com.example:Relu" in _refusal(custom)


def test_an_ir_version_or_an_old_opset_the_runtime_cannot_read():
    model = _tiny(helper.make_node("Relu", ["x"], ["y"], name="r"), TensorProto.FLOAT)
    model.ir_version = 99
    found = re.search(r"has IR version 99, newer than the installed ONNX Runtime \S+ reads "
                      r"\(up to IR version (\d+)\)", _refusal(model))
    assert found
    model.ir_version = int(found.group(1))
    assert _opens(model)
    old = _tiny(helper.make_node("Relu", ["x"], ["y"], name="r"), TensorProto.FLOAT,
                opsets=(("", 5),))
    message = _refusal(old)
    assert "no kernel for Relu (version 1, node 'r')" in message
    assert "model opset ai.onnx 5" in message and "runs opset 7 and later" in message


def test_other_session_failures_keep_their_exception():
    bad_type = _tiny(helper.make_node("Softplus", ["x"], ["y"], name="s"), TensorProto.BFLOAT16)
    with pytest.raises(Exception) as info:
        OrtRunner(bad_type, providers="cpu")
    assert not isinstance(info.value, OnnxDiagError)
