"""Executors: local processes and Ray give the same results; failures stay per item."""

import json
import math
import sys

import pytest
from click.testing import CliRunner

from onnxdiag.cli import cli
from onnxdiag.commands.base import DataRequest, ReportTarget, Runtime
from onnxdiag.commands.select import select_report
from onnxdiag.data.sample import get_sample
from onnxdiag.errors import MissingExtraError, OnnxDiagError
from onnxdiag.runtime.executor import ExecutorSpec, LocalExecutor, make_executor, parse_executor

SAMPLE = get_sample()
CKPTS = [SAMPLE.model.parent / "checkpoints" / f"ckpt_{i:03d}.onnx" for i in (0, 4, 8, 12, 15)]


def _reciprocal(x, scale):
    if x == 0:
        raise OnnxDiagError("zero has no reciprocal")
    if x == 3:
        raise ValueError("three is unlucky")
    return scale / x


@pytest.mark.parametrize("value, spec", [
    (None, ExecutorSpec("local")), ("local", ExecutorSpec("local")),
    ("ray", ExecutorSpec("ray")), ("RAY=10.0.0.1:6379", ExecutorSpec("ray", "10.0.0.1:6379")),
    ("ray=auto", ExecutorSpec("ray", "auto")),
])
def test_parse_executor(value, spec):
    assert parse_executor(value) == spec


@pytest.mark.parametrize("bad", ["dask", "local=host", ""])
def test_parse_executor_rejects_unknown(bad):
    with pytest.raises(OnnxDiagError, match="use local, ray, or ray=HOST:PORT"):
        parse_executor(bad)


@pytest.mark.parametrize("jobs", [1, 2])
def test_local_executor_reports_failures_per_item(jobs):
    out = {i: (r, e) for i, r, e in LocalExecutor(jobs).map(_reciprocal, [1, 0, 2, 3, 4], (12.0,))}
    assert out[0] == (12.0, None) and out[2] == (6.0, None) and out[4] == (3.0, None)
    assert out[1] == (None, "zero has no reciprocal")
    assert out[3] == (None, "ValueError: three is unlucky")


def test_ray_missing_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'onnxdiag\[ray\]'"):
        make_executor("ray")
    res = CliRunner().invoke(cli, ["select", str(CKPTS[0]), "--data", str(SAMPLE.calibration),
                                   "--executor", "ray", "--out", str(tmp_path / "r")])
    assert res.exit_code == 1 and "onnxdiag[ray]" in res.stderr
    assert not (tmp_path / "r").exists()


def _series(tmp_path):
    broken = tmp_path / "ckpt_broken.onnx"
    broken.write_bytes(b"not an onnx file")
    return [*map(str, CKPTS[:3]), str(broken), *map(str, CKPTS[3:])]


def test_select_on_ray_equals_local(ray_executor, tmp_path):
    series = _series(tmp_path)
    args = dict(data=DataRequest(str(SAMPLE.calibration), limit=150),
                eval_data=str(SAMPLE.evaluation), report=ReportTarget(write=False))
    local = select_report(series, runtime=Runtime(jobs=2, progress=False), **args).report
    on_ray = select_report(series, runtime=Runtime(executor=ray_executor, progress=False),
                           **args).report
    assert on_ray["metadata"]["executor"]["kind"] == "ray"
    a, b = local["selection"], on_ray["selection"]
    assert [f["path"] for f in a["failed"]] == [f["path"] for f in b["failed"]] == [series[3]]
    assert b["failed"][0]["error"] and a["failed"][0]["error"] == b["failed"][0]["error"]
    for ca, cb in zip(a["checkpoints"], b["checkpoints"]):
        if ca["result"] is None:
            continue
        va, vb = ca["result"]["readouts"]["values"], cb["result"]["readouts"]["values"]
        assert va.keys() == vb.keys()
        for k in va:
            assert math.isclose(va[k], vb[k], rel_tol=1e-12, abs_tol=1e-15), k
        assert ca["result"]["evaluation"] == cb["result"]["evaluation"]
        assert ca["result"]["data"] == cb["result"]["data"]  # same probe, described the same
    assert a["selected"] == b["selected"]
    assert json.dumps(a["evaluation"], sort_keys=True) == json.dumps(b["evaluation"],
                                                                     sort_keys=True)
