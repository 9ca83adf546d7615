"""Graphs whose export baked the batch size in (a Concat with a tensor expanded to batch 2,
a Reshape to ``(2, -1)``), and ONNX Runtime's own log on stderr.

Equivalence: such a graph, run in pieces of its batch size, gives the outputs (and the
readouts) of the same graph with a dynamic batch, at any batch size. CLI: ONNX Runtime's
log lines reach the real stderr of the process (it writes them from C++) only with -v.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiag.data.source import DataWarning
from onnxdiag.errors import DataError
from onnxdiag.runtime.runner import OrtRunner

ROOT = Path(__file__).resolve().parents[1]


def _model(nodes, inits, x_shape, x_type=TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "fixed", [helper.make_tensor_value_info("x", x_type, x_shape)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def concat_model(fixed: int | None = 2, name: str = "cat") -> onnx.ModelProto:
    """x (N, 6) → Gemm → Relu → Concat with a learned token expanded to the batch → Gemm.
    ``fixed``: the token is expanded to a constant batch (what a trace with a Python int
    exports); None: to the input's batch (Shape → Slice → Concat)."""
    rng = np.random.default_rng(0)
    inits = {"w1": rng.normal(size=(8, 6)).astype(np.float32),
             "b1": rng.normal(size=8).astype(np.float32),
             "token": rng.normal(size=(1, 4)).astype(np.float32),
             "w2": rng.normal(size=(5, 12)).astype(np.float32),
             "b2": rng.normal(size=5).astype(np.float32),
             "width": np.array([4], np.int64), "zero": np.array([0], np.int64),
             "one": np.array([1], np.int64)}
    if fixed is None:
        shape = [helper.make_node("Shape", ["x"], ["xs"], name="shape"),
                 helper.make_node("Slice", ["xs", "zero", "one"], ["n"], name="slice"),
                 helper.make_node("Concat", ["n", "width"], ["tshape"], axis=0, name="tcat")]
    else:
        inits["tshape"] = np.array([fixed, 4], np.int64)
        shape = []
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1, name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"), *shape,
             helper.make_node("Expand", ["token", "tshape"], ["t"], name="expand"),
             helper.make_node("Concat", ["r", "t"], ["z"], axis=1, name=name),
             helper.make_node("Gemm", ["z", "w2", "b2"], ["logits"], transB=1, name="head")]
    return _model(nodes, inits, ["N", 6])


def reshape_model(fixed: bool = True) -> onnx.ModelProto:
    """x (N, 2, 3) → Reshape to (2, 6) (baked) or (-1, 6) → Gemm."""
    rng = np.random.default_rng(1)
    inits = {"shape": np.array([2 if fixed else -1, 6], np.int64),
             "w": rng.normal(size=(5, 6)).astype(np.float32),
             "b": rng.normal(size=5).astype(np.float32)}
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["flat"], name="flatten"),
             helper.make_node("Gemm", ["flat", "w", "b"], ["logits"], transB=1, name="head")]
    return _model(nodes, inits, ["N", 2, 3])


def gather_model() -> onnx.ModelProto:
    """idx (N,) int64 → Gather rows of a table → Gemm: an index out of range fails at any
    batch size (a data error, not a batch size)."""
    rng = np.random.default_rng(2)
    inits = {"table": rng.normal(size=(10, 4)).astype(np.float32),
             "w": rng.normal(size=(5, 4)).astype(np.float32),
             "b": rng.normal(size=5).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["table", "x"], ["rows"], axis=0, name="lookup"),
             helper.make_node("Gemm", ["rows", "w", "b"], ["logits"], transB=1, name="head")]
    return _model(nodes, inits, ["N"], TensorProto.INT64)


def _x(n, shape=(6,), seed=3):
    return np.random.default_rng(seed).normal(size=(n, *shape)).astype(np.float32)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10])
def test_a_baked_concat_runs_in_pieces_with_the_dynamic_graphs_outputs(n):
    fixed, dynamic = OrtRunner(concat_model(2, name=f"cat_{n}")), OrtRunner(concat_model(None))
    x = _x(n)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = fixed.run({"x": x})
    want = dynamic.run({"x": x})["logits"]
    assert got["logits"].shape == (n, 5)
    np.testing.assert_allclose(got["logits"], want, rtol=1e-6, atol=1e-6)
    if n == 2:  # runs as it is: nothing to find
        assert fixed.fixed_batch is None and not seen
        return
    assert fixed.fixed_batch == 2
    lines = [str(w.message) for w in seen if issubclass(w.category, DataWarning)]
    assert len(lines) == 1 and "only runs at batch size 2" in lines[0]
    assert f"Concat node 'cat_{n}'" in lines[0]
    np.testing.assert_allclose(fixed.run({"x": x[:1]})["logits"], want[:1], rtol=1e-6)


def test_a_baked_reshape_is_found_from_its_shape_constant():
    fixed, dynamic = OrtRunner(reshape_model(True)), OrtRunner(reshape_model(False))
    x = _x(5, (2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        got = fixed.run({"x": x})["logits"]
    np.testing.assert_allclose(got, dynamic.run({"x": x})["logits"], rtol=1e-6, atol=1e-6)
    assert fixed.fixed_batch == 2


def test_a_data_error_is_not_taken_for_a_fixed_batch():
    """The first sample repeated runs at every size: the failure is the data's, reported as
    it was, and the runner keeps running whole batches."""
    runner = OrtRunner(gather_model())
    with pytest.raises(DataError, match="ONNX Runtime rejected the data"):
        runner.run({"x": np.array([0, 3, 50, 1], np.int64)})
    assert runner.fixed_batch is None
    assert runner.run({"x": np.array([0, 3, 9], np.int64)})["logits"].shape == (3, 5)


def test_a_torch_export_that_baked_batch_2_into_a_concat():
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self, baked):
            super().__init__()
            self.baked = baked
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(16, 5)
            self.token = nn.Parameter(torch.randn(1, 8))

        def forward(self, x):
            y = torch.relu(self.conv(x)).mean((2, 3))
            batch = 2 if self.baked else x.shape[0]  # a config int, as in the issue
            return self.fc(torch.cat([y, self.token.expand(batch, 8)], 1))

    net = Net(True).eval()
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"onnxdiag-fixed-{os.getpid()}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 3, 8, 8),), str(path), dynamo=False,
                          input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}}, opset_version=17)
    reference = Net(False).eval()
    reference.load_state_dict(net.state_dict())
    x = torch.randn(9, 3, 8, 8)
    try:
        runner = OrtRunner(str(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DataWarning)
            got = runner.run({"x": x.numpy()})["logits"]
    finally:
        path.unlink(missing_ok=True)
    with torch.no_grad():
        want = reference(x).numpy()
    assert runner.fixed_batch == 2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- the CLI, in a subprocess: ONNX Runtime logs from C++ straight to the process's stderr
def _cli(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "ONNXDIAG_VERBOSE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "onnxdiag", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def _ort_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":onnxruntime:" in line]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fixed")
    rng = np.random.default_rng(0)
    onnx.save(concat_model(2), folder / "fixed.onnx")
    onnx.save(concat_model(None), folder / "dynamic.onnx")
    onnx.save(gather_model(), folder / "gather.onnx")
    np.savez(folder / "d.npz", x=_x(11), labels=rng.integers(0, 5, 11))
    np.savez(folder / "bad.npz", x=np.array([0, 1, 2, 50, 3], np.int64))
    return folder


def test_cli_runs_a_fixed_batch_export_with_one_warning_and_no_runtime_log(exports):
    import json

    runs = {}
    for name in ("fixed", "dynamic"):
        runs[name] = _cli("readouts", exports / f"{name}.onnx", "--data", exports / "d.npz",
                          "--out", exports / f"out-{name}", "--format", "json", cwd=exports)
        assert runs[name].returncode == 0, runs[name].stderr
    err = runs["fixed"].stderr
    assert not _ort_lines(err), err
    warning = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "only runs at batch size 2" in warning[0], err
    values = [json.loads(runs[n].stdout)["readouts"]["readouts"]["values"]
              for n in ("fixed", "dynamic")]
    assert values[0].keys() == values[1].keys()
    for key, value in values[1].items():
        assert values[0][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_runtime_log_lines_only_with_verbose(exports):
    """A model that makes ONNX Runtime log errors (a Gather index out of range): by
    default stderr holds onnxdiag's one error line only; -v shows ORT's [E:…] lines."""
    quiet = _cli("readouts", exports / "gather.onnx", "--data", exports / "bad.npz",
                 "--out", exports / "q", cwd=exports)
    assert quiet.returncode == 1
    assert not _ort_lines(quiet.stderr), quiet.stderr
    lines = quiet.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ONNX Runtime rejected the data")
    loud = _cli("-v", "readouts", exports / "gather.onnx", "--data", exports / "bad.npz",
                "--out", exports / "l", cwd=exports)
    assert loud.returncode == 1
    assert any("[E:onnxruntime:" in line for line in _ort_lines(loud.stderr)), loud.stderr


def test_verbose_shows_the_fixed_batch_probes_failures(exports):
    loud = _cli("-v", "readouts", exports / "fixed.onnx", "--data", exports / "d.npz",
                "--out", exports / "v", cwd=exports)
    assert loud.returncode == 0, loud.stderr
    assert any("Concat node" in line for line in _ort_lines(loud.stderr)), loud.stderr
