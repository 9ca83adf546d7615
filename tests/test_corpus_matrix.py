"""The corpus matrix (tools/export_corpus.py): every verb on real converter exports works
or refuses with one line — no traceback, no internal error, every emitted model checked.

By default a representative subset runs (``--smoke``: a torch.onnx CNN, an HF GPT-2
classifier and an int8 QDQ model × inspect, prune, prune-channels), each cell a fresh
``python -m onnxdiag`` process; the
full matrix (every export × every verb, docs/CORPUS.md) is ``-m slow``. The classifier
itself is checked on real outcomes: a one-line refusal, a traceback, a two-line stderr,
an emitted model the checker rejects.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "export_corpus.py"


def _tool():
    if "export_corpus" not in sys.modules:
        spec = importlib.util.spec_from_file_location("export_corpus", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["export_corpus"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["export_corpus"]


def _cells(doc: str) -> dict[tuple[str, str], str]:
    """(model, verb) -> 'ok' / 'refused (n)' / 'FAIL (n)' from the Markdown table."""
    rows = [line for line in doc.splitlines() if line.startswith("| ")]
    verbs = [v.strip() for v in rows[0].strip("|").split("|")][1:]
    out = {}
    for row in rows[1:]:
        name, *marks = [v.strip() for v in row.strip("|").split("|")]
        out.update({(name, verb): mark for verb, mark in zip(verbs, marks)})
    return out


def _run_matrix(tmp_path, *args, timeout):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime.quantization")
    doc = tmp_path / "corpus.md"
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--doc", str(doc),
                             "--work", str(tmp_path / "work")], capture_output=True,
                            text=True, timeout=timeout, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    text = doc.read_text()
    cells = _cells(text)
    assert cells and not [k for k, v in cells.items() if v.startswith("FAIL")], text
    return text, cells


def test_smoke_matrix_has_no_failing_cell(tmp_path):
    text, cells = _run_matrix(tmp_path, "--smoke", timeout=600)
    tool = _tool()
    assert set(cells) == {(m, v) for m in tool.SMOKE_MODELS for v in tool.SMOKE_VERBS}
    assert cells["torch_resnet", "prune"] == "ok"
    assert cells["hf_gpt2", "prune-channels"] == "ok"
    # an int8 QDQ model has no float weight to prune: a one-line refusal naming the fix
    assert cells["qdq_int8", "prune"].startswith("refused")
    assert "`onnxdiag inspect MODEL` shows its layers" in text
    assert "0 FAIL" in text and "2026-12-02" in text


@pytest.mark.slow
def test_full_matrix_has_no_failing_cell(tmp_path):
    tool = _tool()
    _, cells = _run_matrix(tmp_path, "--jobs", "2", timeout=3000)
    assert len(cells) == (len(tool.VERBS) + len(tool.VARIANTS)) * 9


def test_the_matrix_covers_every_verb_of_the_cli():
    from onnxdiag.cli import COMMANDS

    assert set(_tool().VERBS) == set(COMMANDS)


def test_committed_corpus_table_has_every_cell_and_no_fail():
    tool = _tool()
    text = (ROOT / "docs" / "CORPUS.md").read_text()
    cells = _cells(text)
    assert {v for _, v in cells} == set(tool.VERBS + tool.VARIANTS)
    assert not [k for k, v in cells.items() if v.startswith("FAIL")]
    assert re.search(r"\*\*\d+ ok, \d+ refused, 0 FAIL\.\*\*", text)


# -- the classifier on real outcomes ------------------------------------------------------------
def _bad_model(path: Path) -> Path:
    """Loads as a protobuf, but a Gemm of mismatched widths: the full checker rejects it."""
    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_classify_tells_refusals_from_failures(tmp_path):
    tool = _tool()
    assert tool.classify(1, "", "error: no head found\n", []) == ("refused", "no head found")
    assert tool.classify(1, "", "warning: x\nerror: no head\n", [])[0] == "FAIL"
    assert tool.classify(3, "", "internal error: KeyError: 'a' (please report it)\n",
                         [])[0] == "FAIL"
    assert tool.classify(1, "", "Traceback (most recent call last):\nerror: x\n", [])[0] == \
        "FAIL"
    assert tool.classify(0, "Traceback (most recent call last):", "", [])[0] == "FAIL"
    status, reason = tool.classify(0, "done", "", [_bad_model(tmp_path / "bad.onnx")])
    assert status == "FAIL" and reason.startswith("emitted bad.onnx: ")


def test_a_real_refusal_through_the_cli_is_one_line(tmp_path):
    """A real refusal (data of the wrong shape) classifies as refused, in a fresh process."""
    pytest.importorskip("torch")
    import exports

    tool = _tool()
    export = exports.tf_softmax_constants(tmp_path)
    np.savez(tmp_path / "wrong.npz", x=np.zeros((4, 7), np.float32), labels=np.zeros(4, int))
    proc = subprocess.run([sys.executable, "-m", "onnxdiag", "readouts", str(export.path),
                           "--data", str(tmp_path / "wrong.npz"), "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=None)
    status, reason = tool.classify(proc.returncode, proc.stdout, proc.stderr, [])
    assert status == "refused", (proc.returncode, proc.stderr)
    assert "x" in reason


def test_a_sparse_stored_model_is_checked_through_its_densified_copy(tmp_path):
    """prune --sparse-initializers: the full checker rejects the file (ONNX shape inference
    types a sparse initializer as sparse_tensor), so the corpus checks it structurally and
    its densified copy fully; that copy holds exactly the dense-stored run's weights."""
    from cli_helpers import run
    from corpus import conv_bn_folded

    tool = _tool()
    model = tmp_path / "m.onnx"
    onnx.save(conv_bn_folded(), model)
    np.savez(tmp_path / "d.npz",
             x=np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32))
    paths = {}
    for kind, extra in (("dense", []), ("sparse", ["--sparse-initializers"])):
        paths[kind] = tmp_path / f"{kind}.onnx"
        result = run("prune", model, "--sparsity", 0.9, "--allocation", "uniform",
                     "--data", tmp_path / "d.npz", "-o", paths[kind], "--out",
                     tmp_path / f"r-{kind}", *extra)
        assert result.exit_code == 0, result.output
    sparse = onnx.load(paths["sparse"])
    assert sparse.graph.sparse_initializer
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.checker.check_model(sparse, full_check=True)
    assert tool.check_emitted([paths["sparse"], paths["dense"]]) == ""
    weights = {t.name: numpy_helper.to_array(t)
               for t in tool._densified(sparse).graph.initializer}
    for t in onnx.load(paths["dense"]).graph.initializer:
        np.testing.assert_array_equal(weights[t.name], numpy_helper.to_array(t))
