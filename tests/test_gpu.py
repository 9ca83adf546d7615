"""The CUDA path: with ``--providers cuda`` the passes run on the GPU and give CPU's numbers.

Marked ``gpu``: ``python -m pytest -m gpu`` (what benchmarks/gpu_check.sh runs in an
environment with the ``[gpu]`` extra). Skipped where ONNX Runtime has no
CUDAExecutionProvider; ``ONNXDIAG_REQUIRE_CUDA=1`` (set by gpu_check.sh on a CUDA machine)
makes that a failure instead.

Tolerances, CUDA against CPU on the bundled sample: readouts within 1e-2 relative, channel
moments within 2e-2 of each column's standard deviation, RR curves within 1e-2 absolute.
CUDA convolutions and GEMMs may run in TF32 (a 10-bit mantissa, relative rounding ~5e-4 per
product) on Ampere and newer GPUs, so float32 agreement (~1e-6) is not expected; a real
difference (another sample, a layer missing, a wrong tap) is of order 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SAMPLE = Path(__file__).resolve().parents[1] / "models" / "sample"
CUDA = "CUDAExecutionProvider"
READOUT_RTOL, MOMENTS_TOL, RR_ATOL = 1e-2, 2e-2, 1e-2


@pytest.fixture(scope="module", autouse=True)
def cuda_available():
    import onnxruntime as ort

    if CUDA not in ort.get_available_providers():
        message = (f"needs {CUDA} (onnxruntime-gpu on a CUDA machine); this ONNX Runtime "
                   f"{ort.__version__} has {', '.join(ort.get_available_providers())}")
        if os.environ.get("ONNXDIAG_REQUIRE_CUDA") == "1":
            pytest.fail(f"ONNXDIAG_REQUIRE_CUDA=1 but {message}")
        pytest.skip(message)


def _calib(limit=512):
    from onnxdiag import DataRequest

    return DataRequest(str(SAMPLE / "calib.npz"), limit=limit)


def test_a_cuda_session_runs_on_cuda():
    """No silent fallback: ORT loads the CUDA provider (CUDA and cuDNN libraries found)."""
    from onnxdiag.runtime.runner import OrtRunner

    runner = OrtRunner(SAMPLE / "model.onnx", providers="cuda")
    assert runner.providers[0] == CUDA, runner.providers


def test_readouts_on_cuda_equal_cpu():
    """The readouts verb with providers cuda runs its pass on CUDA and reports CPU's values."""
    from onnxdiag import ReportTarget, Runtime, readouts_report

    def values(providers):
        rep = readouts_report(str(SAMPLE / "model.onnx"), data=_calib(),
                              runtime=Runtime(providers=providers, progress=False),
                              report=ReportTarget(write=False)).report
        return rep["metadata"]["providers"], rep["readouts"]["readouts"]["values"]

    cpu_providers, cpu = values("cpu")
    cuda_providers, cuda = values("cuda")
    assert cpu_providers[0] == "CPUExecutionProvider" and cuda_providers[0] == CUDA
    assert cpu.keys() == cuda.keys()
    for name, a in cpu.items():
        if a is None:
            assert cuda[name] is None, name
            continue
        assert np.isclose(cuda[name], a, rtol=READOUT_RTOL, atol=1e-9), (name, a, cuda[name])


def _moments_difference(a, b) -> float:
    worst = 0.0
    for name, la in a.layers.items():
        lb = b.layers[name]
        assert la.task.n == lb.task.n, name
        scale = np.sqrt(np.maximum(np.diag(la.task.cov()), 1e-30))
        worst = max(worst, float((np.abs(la.task.mean - lb.task.mean) / scale).max()),
                    float((np.abs(la.task.cov() - lb.task.cov())
                           / np.outer(scale, scale)).max()))
    return worst


def test_channel_statistics_on_cuda_equal_cpu():
    """The statistics pass on CUDA accumulates CPU's moments (same samples, same taps), and
    the channels verb runs with providers cuda (CUDA in use, where its report says)."""
    from onnxdiag import ReportTarget, Runtime, channels_report
    from onnxdiag.channels.collect import collect_channel_moments
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model

    model = load_model(SAMPLE / "model.onnx")
    structure = analyze_structure(model)
    source = _calib().open(get_input_specs(model))
    by = {p: collect_channel_moments(model, structure, source, providers=p)
          for p in ("cpu", "cuda")}
    assert by["cpu"].layers.keys() == by["cuda"].layers.keys()
    assert by["cpu"].taps == by["cuda"].taps
    assert _moments_difference(by["cpu"], by["cuda"]) <= MOMENTS_TOL
    rep = channels_report(str(SAMPLE / "model.onnx"), data=_calib(256),
                          runtime=Runtime(providers="cuda", progress=False),
                          report=ReportTarget(write=False)).report
    assert rep["metadata"]["parameters"]["providers"] == "cuda"
    assert rep["metadata"].get("providers", [CUDA])[0] == CUDA


def test_rr_curves_on_cuda_equal_cpu():
    """The RR curves' capture pass on CUDA gives CPU's curves."""
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model
    from onnxdiag.sparsity import compute_rr_curves, find_prunable

    model = load_model(SAMPLE / "model.onnx")
    layers = find_prunable(analyze_structure(model))
    source = _calib(128).open(get_input_specs(model))
    cpu, cuda = (compute_rr_curves(model, layers, source, providers=p).rr
                 for p in ("cpu", "cuda"))
    assert cpu.shape == cuda.shape
    assert np.abs(cpu - cuda).max() <= RR_ATOL
