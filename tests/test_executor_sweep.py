"""`sweep` with one unit of work per cell: local processes and Ray equal the in-process run."""

import numpy as np
import pytest

from onnxdiag.commands.sweep import sweep_report
from onnxdiag.data.sample import get_sample

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
    from onnxdiag.runtime.executor import RayExecutor

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


def _rr(executor=None, positions=16):
    from onnxdiag.data.source import open_data
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model
    from onnxdiag.sparsity import compute_rr_curves, find_prunable

    m = load_model(SAMPLE.model)
    layers = find_prunable(analyze_structure(m))
    source = open_data(str(SAMPLE.calibration), get_input_specs(m), limit=80, seed=0)
    return compute_rr_curves(m, layers, source, n_images=80, positions=positions,
                             executor=executor)


@pytest.mark.parametrize("positions", [16, "all"])
def test_rr_curves_one_unit_per_layer_equal_in_process(positions):
    from onnxdiag.runtime.executor import LocalExecutor

    a, b = _rr(positions=positions), _rr(LocalExecutor(2), positions)
    assert a.layers == b.layers and a.n_samples == b.n_samples
    np.testing.assert_array_equal(a.rr, b.rr)
    np.testing.assert_array_equal(a.d_raw, b.d_raw)


def test_rr_curves_on_ray_equal_in_process():
    ray = pytest.importorskip("ray")
    from onnxdiag.runtime.executor import RayExecutor

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        b = _rr(RayExecutor())
    finally:
        if started:
            ray.shutdown()
    a = _rr()
    # float32 Gram products per batch: BLAS thread counts differ between Ray workers and
    # this process, so sums may round differently (measured: 2e-8).
    np.testing.assert_allclose(b.rr, a.rr, rtol=0, atol=1e-6)
