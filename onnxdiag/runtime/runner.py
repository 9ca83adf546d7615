"""ONNX Runtime sessions: provider choice, batched runs, streaming over data.

onnxruntime is imported lazily so that ``import onnxdiag`` and ``onnxdiag --help``
stay fast and work without it (ARCHITECTURE §2).
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx

from ..errors import DataError, MissingExtraError, OnnxDiagError

#: Short names accepted by ``--providers``.
PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "dml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
}
ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training",
                     "onnxruntime-training-cpu")
OPTIMIZATION_LEVELS = ("disabled", "basic", "extended", "all")


def import_ort():
    """Import onnxruntime or raise a MissingExtraError saying how to install it."""
    try:
        import onnxruntime
    except ImportError as exc:  # pragma: no cover - the default install has it
        raise MissingExtraError(
            "onnxruntime is not installed; install onnxdiag with one runtime: "
            "pip install 'onnxdiag[cpu]' (or [gpu], or [training])."
        ) from exc
    return onnxruntime


def ort_info() -> dict:
    """Which ONNX Runtime distribution and version is installed, and its providers."""
    ort = import_ort()
    dists = {}
    for name in ORT_DISTRIBUTIONS:
        try:
            dists[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "version": ort.__version__,
        "distributions": dists,
        "available_providers": list(ort.get_available_providers()),
    }


def resolve_providers(requested: Sequence[str] | str | None = None) -> list[str]:
    """Turn ``--providers`` into ORT provider names; None → CUDA when present, else CPU.

    CPU is always appended as the fallback. Raises OnnxDiagError for a provider that
    this ONNX Runtime build does not have, naming those it has.
    """
    available = import_ort().get_available_providers()
    if requested is None or requested == "auto" or requested == []:
        chosen = ["CUDAExecutionProvider"] if "CUDAExecutionProvider" in available else []
    else:
        if isinstance(requested, str):
            requested = [p for p in requested.split(",") if p.strip()]
        chosen = [PROVIDER_ALIASES.get(p.strip().lower(), p.strip()) for p in requested]
        missing = [p for p in chosen if p not in available]
        if missing:
            hint = (" Install onnxruntime-gpu in a fresh environment: pip install 'onnxdiag[gpu]'."
                    if "CUDAExecutionProvider" in missing else "")
            raise OnnxDiagError(
                f"Execution provider {', '.join(missing)} is not available in this ONNX Runtime "
                f"build; available: {', '.join(available)}.{hint}"
            )
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


class OrtRunner:
    """One ONNX Runtime inference session over a model (never modified).

    Args:
        model: ModelProto, serialized bytes or a path.
        providers: see :func:`resolve_providers`.
        optimization: graph optimisation level, one of ``OPTIMIZATION_LEVELS``.
        threads: intra-op threads (None: ORT's default, all cores).
    """

    def __init__(self, model, *, providers=None, optimization: str = "all",
                 threads: int | None = None, spinning: bool = True):
        ort = import_ort()
        options = ort.SessionOptions()
        options.graph_optimization_level = {
            "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[optimization]
        if threads:
            options.intra_op_num_threads = threads
        if not spinning:  # threads sleep between runs: leaves the cores to NumPy work
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        self.requested_providers = resolve_providers(providers)
        self._tmp = None
        self.session = ort.InferenceSession(self._session_source(model), options,
                                            providers=self.requested_providers)
        self.providers = list(self.session.get_providers())
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def _session_source(self, model):
        if isinstance(model, (str, os.PathLike)):
            return os.fspath(model)
        if isinstance(model, (bytes, bytearray)):
            return bytes(model)
        if model.ByteSize() < 2**31 - 2**20:
            return model.SerializeToString()
        # Over protobuf's limit: ORT needs a file with external data.
        from ..model.io import save_model

        self._tmp = tempfile.TemporaryDirectory(prefix="onnxdiag-")
        path = Path(self._tmp.name) / "model.onnx"
        save_model(model, path, external_data=True)
        return str(path)

    def run(self, feeds: dict[str, np.ndarray], output_names: Sequence[str] | None = None
            ) -> dict[str, np.ndarray]:
        """Run one batch; returns ``{output_name: array}`` for the requested outputs."""
        names = list(output_names) if output_names is not None else self.output_names
        try:
            values = self.session.run(names, feeds)
        except Exception as exc:  # ORT raises its own exception types for bad feeds
            if type(exc).__name__ in ("InvalidArgument", "Fail", "InvalidGraph",
                                      "RuntimeException"):
                msg = str(exc).strip().splitlines()[0][:300]
                raise DataError(
                    f"ONNX Runtime rejected the data ({msg}); check the data's input names, "
                    "shapes and dtypes against `onnxdiag inspect MODEL`."
                ) from exc
            raise
        return dict(zip(names, values))

    def stream(self, source, output_names: Sequence[str] | None = None, *,
               label: str | None = None) -> Iterator[tuple[object, dict[str, np.ndarray]]]:
        """Run every batch of a DataSource; yields ``(batch, outputs)``.

        Outputs are yielded batch by batch and not kept, so memory does not grow with
        the number of samples. A progress bar is shown on a terminal when ``label``.
        """
        from .progress import progress

        batches = source.batches()
        if label:
            batches = progress(batches, source_total_batches(source), label)
        for batch in batches:
            yield batch, self.run(batch.feeds, output_names)


def single_threaded_blas():
    """A context keeping BLAS on one thread (threadpoolctl, when installed).

    For passes that alternate ONNX Runtime runs with NumPy/BLAS work on the same cores:
    the per-batch products are small, and a multi-threaded BLAS's workers busy-wait on
    the cores ORT runs on next (measured: the readout pass of a MobileNetV2 with 320
    features went from 3.6x to 1.1x plain inference on 2 cores).
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: the passes are correct without it, only slower
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def source_total_batches(source) -> int | None:
    """Number of batches a DataSource will yield, when it is known."""
    n, size = getattr(source, "n_samples", None), getattr(source, "batch_size", None)
    if not n or not size:
        return None
    return -(-n // size)


def compare_outputs(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> dict:
    """Max absolute and relative differences per output (for emitted-model reports)."""
    out = {}
    for name, ref in reference.items():
        if name not in other:
            continue
        a, b = np.asarray(ref, dtype=np.float64), np.asarray(other[name], dtype=np.float64)
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(a))) if a.size else 0.0
        out[name] = {"max_abs_diff": diff, "max_rel_diff": diff / (scale + 1e-12)}
    return out


def model_outputs(model: onnx.ModelProto) -> list[str]:
    """Names of the model's graph outputs."""
    return [o.name for o in model.graph.output]
