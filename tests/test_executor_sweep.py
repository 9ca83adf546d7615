"""`sweep` with one unit of work per cell: local processes and Ray equal the in-process run."""

import numpy as np
import pytest

from onnxdiag.commands.base import DataRequest, ReportTarget, Runtime
from onnxdiag.commands.sweep import SweepOptions, sweep_report
from onnxdiag.data.sample import get_sample

SAMPLE = get_sample()
ARGS = dict(options=SweepOptions(sparsity="0.5,0.7,0.9999", allocations="erk,lamp",
                                 repairs="cr+bn"),
            data=DataRequest(str(SAMPLE.calibration), limit=96),
            eval_data=str(SAMPLE.evaluation), report=ReportTarget(write=False))


def _sweep(executor=None, jobs=None):
    return sweep_report(str(SAMPLE.model), runtime=Runtime(executor=executor, jobs=jobs,
                                                           progress=False), **ARGS)


def _cells(result):
    return [(c["sparsity"], c["allocation"], c["repair"], c["agreement"], c["accuracy"],
             c["loss"], c["error"], c["layer_sparsity"]) for c in result.report["sweep"]["cells"]]


@pytest.fixture(scope="module")
def in_process():
    return _cells(_sweep())


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
    res = _sweep("local", 2)
    assert res.report["metadata"]["executor"] == {"kind": "local", "jobs": 2}
    _assert_same(in_process, _cells(res))


def test_ray_equals_in_process(in_process):
    ray = pytest.importorskip("ray")
    from onnxdiag.runtime.executor import RayExecutor

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        res = _sweep(RayExecutor())
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


def test_units_with_every_position_get_a_convs_input_not_its_columns():
    """--rr-positions all on units: a k×k conv's columns are its input × k² / stride², so
    its unit gets the input and cuts them itself; 1×1 convs and linear layers get their
    columns (no larger than the input). The curves are the in-process ones (above)."""
    from onnxdiag.runtime.executor import LocalExecutor

    class Recording(LocalExecutor):
        def map(self, fn, items, shared=(), **kw):
            self.items = list(items)
            return super().map(fn, self.items, shared, **kw)

    ex = Recording(2)
    _rr(ex, positions="all")
    wide = 0
    for plan, batches in ex.items:
        taps = int(np.prod(plan["kernel"])) if plan["op"].kind == "conv" else 1
        assert bool(plan.get("unit_cuts")) == (taps > 1)
        if taps > 1:
            wide += 1
            assert all(b.ndim == 4 for b in batches)  # (n, C, H, W): the input
            assert sum(len(b) for b in batches) == 80  # every image, once
        else:
            assert all(b.ndim == 3 for b in batches)  # (rows, groups, K): columns
    assert wide > 0


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


class _Failing:
    """An executor whose unit ``fail`` fails (a bug, or with ``user`` a user error)."""

    def __new__(cls, fail, user=False):
        from onnxdiag.runtime.executor import Executor, UnitError

        class Failing(Executor):
            name = "failing"

            def map(self, fn, items, shared=(), *, label=None, gpu=False):
                for i, item in enumerate(items):
                    if i == fail:
                        yield i, None, UnitError("boom", type_name="ValueError",
                                                 user_error=user)
                    else:
                        yield i, fn(item, *shared), None

        return Failing()


def test_a_failed_sweep_unit_is_a_failed_cell_and_the_others_are_kept(in_process):
    res = _sweep(_Failing(2))
    cells, sec = _cells(res), res.report["sweep"]
    assert cells[2][6] == "boom" and sec["cells"][2]["failed"] is True
    assert sec["failed"] == [{"sparsity": 0.7, "allocation": "erk", "repair": "cr+bn",
                              "error": "boom"}]
    kept = [i for i in range(6) if i != 2]
    _assert_same(in_process, [cells[i] if i in kept else in_process[2] for i in range(6)])
    assert "FAILED cell S=0.7 erk cr+bn: boom" in res.text


@pytest.mark.parametrize("user", [False, True])
def test_rr_curves_stop_on_a_failed_layer_unit(user):
    from onnxdiag.errors import OnnxDiagError
    from onnxdiag.runtime.executor import UnitFailure

    with pytest.raises(OnnxDiagError if user else UnitFailure, match="RR curves of layer .*: boom"):
        _rr(_Failing(1, user))
