"""`sweep` with one unit of work per cell: local processes and Ray equal the in-process run."""

import pytest

from onnxdiag.sample import get_sample
from onnxdiag.sparse_report import sweep_report

SAMPLE = get_sample()
ARGS = dict(sparsity="0.5,0.7,0.9999", allocations="erk,lamp", repairs="cr+bn",
            data=str(SAMPLE.calibration), eval_data=str(SAMPLE.evaluation), limit=96,
            write=False, progress=False)


def _cells(result):
    return [(c["sparsity"], c["allocation"], c["repair"], c["agreement"], c["accuracy"],
             c["loss"], c["error"], c["layer_sparsity"]) for c in result.report["sweep"]["cells"]]


@pytest.fixture(scope="module")
def in_process():
    return _cells(sweep_report(str(SAMPLE.model), **ARGS))


def _assert_same(a, b):
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert x[:3] == y[:3] and x[6] == y[6] and x[7] == y[7]
        for u, v in zip(x[3:6], y[3:6]):
            assert (u is None and v is None) or abs(u - v) <= 1e-9


def test_a_rule_that_cannot_meet_s_is_an_error_cell_not_a_failure(in_process):
    errors = [c for c in in_process if c[6]]
    assert [(c[0], c[1]) for c in errors] == [(0.9999, "lamp")]  # keeps each layer's max
    assert "LAMP keeps each layer's largest weight" in errors[0][6]
    assert all(c[3] is not None for c in in_process if not c[6])


def test_local_processes_equal_in_process(in_process):
    res = sweep_report(str(SAMPLE.model), executor="local", jobs=2, **ARGS)
    assert res.report["metadata"]["executor"] == {"kind": "local", "jobs": 2}
    _assert_same(in_process, _cells(res))


def test_ray_equals_in_process(in_process):
    ray = pytest.importorskip("ray")
    from onnxdiag.executor import RayExecutor

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        res = sweep_report(str(SAMPLE.model), executor=RayExecutor(), **ARGS)
    finally:
        if started:
            ray.shutdown()
    assert res.report["metadata"]["executor"]["kind"] == "ray"
    _assert_same(in_process, _cells(res))
