"""ONNX Runtime sessions: provider choice, batched runs, streaming over data.

onnxruntime is imported lazily so that ``import onnxdiag`` and ``onnxdiag --help``
stay fast and work without it (docs/ARCHITECTURE.md, Rules).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx

from ..errors import DataError, MissingExtraError, ModelLoadError, OnnxDiagError
from .batching import (
    batch_candidates,
    batch_len,
    find_fixed_batch,
    run_in_pieces,
    warn_fixed_batch,
)

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
#: How much of ONNX Runtime's own log reaches stderr: 0 (default) nothing below fatal,
#: 1 warnings and errors, 2 or more everything (the CLI's -v / -vv set it).
VERBOSITY_VARIABLE = "ONNXDIAG_VERBOSE"


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


def cpu_only(providers) -> bool:
    """Whether a session for ``providers`` (as :func:`resolve_providers` takes them) runs on
    ONNX Runtime's CPU provider alone."""
    return resolve_providers(providers) == ["CPUExecutionProvider"]


class OrtRunner:
    """One ONNX Runtime inference session over a model (never modified).

    Args:
        model: ModelProto, serialized bytes or a path.
        providers: see :func:`resolve_providers`.
        optimization: graph optimisation level, one of ``OPTIMIZATION_LEVELS``.
        threads: intra-op threads (None: ORT's default, all cores).
        spinning: False: intra-op threads sleep between runs.
        shared_arena: draw CPU memory from the process's shared arena
            (:mod:`.arena`; CPU-only sessions), for the many short sessions of one pass.
    """

    def __init__(self, model, *, providers=None, optimization: str = "all",
                 threads: int | None = None, spinning: bool = True,
                 shared_arena: bool = False):
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
        self.requested_providers = resolve_providers(providers)
        self.threads = threads  # intra-op threads; None or 0: ORT's default, every core
        if shared_arena:
            from .arena import use_shared_arena

            use_shared_arena(options, self.requested_providers)
        self._tmp = None
        self._model = model  # a reference (no copy): read again only after a failed run
        self.session = open_session(self._session_source(model), options,
                                    self.requested_providers)
        self.providers = list(self.session.get_providers())
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        #: The one batch size the graph runs at, once a failed run found it (else None).
        self.fixed_batch: int | None = None
        self._probed = False

    def _session_source(self, model):
        if isinstance(model, (str, os.PathLike)):
            return os.fspath(model)
        if isinstance(model, (bytes, bytearray)):
            return bytes(model)
        from ..model.io import save_model, serialized

        data = serialized(model)
        if data is not None:
            return data
        # Over protobuf's limit: ORT needs a file with external data.
        self._tmp = tempfile.TemporaryDirectory(prefix="onnxdiag-")
        path = Path(self._tmp.name) / "model.onnx"
        save_model(model, path, external_data=True)
        return str(path)

    def run(self, feeds: dict[str, np.ndarray], output_names: Sequence[str] | None = None
            ) -> dict[str, np.ndarray]:
        """Run one batch; returns ``{output_name: array}`` for the requested outputs.

        A graph that runs at one batch size only (its export baked the batch in) is
        recognised on the first failed run and from then on run that many samples at a
        time (:mod:`.batching`; one DataWarning says so). Raises DataError when ONNX
        Runtime rejects the data.
        """
        names = list(output_names) if output_names is not None else self.output_names
        if self.fixed_batch is not None and batch_len(feeds) != self.fixed_batch:
            return run_in_pieces(self._run_once, feeds, names, self.fixed_batch)
        try:
            return self._run_once(feeds, names)
        except DataError as error:
            if self._probed:
                raise
            self._probed = True
            self.fixed_batch = self._find_fixed_batch(feeds, names, error)
            if self.fixed_batch is None:
                raise
        return run_in_pieces(self._run_once, feeds, names, self.fixed_batch)

    def _run_once(self, feeds: dict, names: list) -> dict:
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

    def _find_fixed_batch(self, feeds: dict, names: list, error: DataError) -> int | None:
        message = str(error.__cause__ or error)
        dims = {i.name: (i.shape[0] if i.shape else None) for i in self.session.get_inputs()}
        candidates = batch_candidates(self._model, list(dims.values()), message,
                                      batch_len(feeds))
        k = find_fixed_batch(self._run_once, feeds, names, candidates)
        if k is not None:
            warn_fixed_batch(k, message, next((n for n, d in dims.items() if d == k), None))
        return k

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


def ort_log_severity() -> int:
    """ONNX Runtime's log severity for the verbosity in ``$ONNXDIAG_VERBOSE`` (set by the
    CLI's ``-v``; worker processes inherit it): 0 or unset → 4 (fatal only: the errors
    ORT logs from C++ straight to stderr are silent, onnxdiag reports them itself),
    1 → 2 (warnings and errors), 2 or more → 0 (verbose)."""
    try:
        verbosity = int(os.environ.get(VERBOSITY_VARIABLE, "0") or 0)
    except ValueError:
        verbosity = 0
    return 4 if verbosity <= 0 else 2 if verbosity == 1 else 0


def open_session(source, options, providers: list[str]):
    """``onnxruntime.InferenceSession(source, options, providers=providers)``, with ONNX
    Runtime's own logging at :func:`ort_log_severity` (session and default logger).

    Raises:
        ModelLoadError: this ONNX Runtime cannot run the model: an opset newer than it
            supports, or an operator it has no kernel or schema for (one line naming the
            versions; the ORT exception is chained for ``--debug``).  Any other failure is
            re-raised as it is.
    """
    ort = import_ort()
    severity = ort_log_severity()
    options.log_severity_level = severity
    ort.set_default_logger_severity(severity)
    try:
        return ort.InferenceSession(source, options, providers=providers)
    except Exception as exc:  # ORT raises its own exception types
        reason = runtime_refusal(source, str(exc), providers)
        if reason is None:
            raise
        raise ModelLoadError(reason) from exc


_TOO_NEW = re.compile(r"Opset (\d+) is under development.*?support for domain (\S+) is till "
                      r"opset (\d+)", re.S)
_IR_TOO_NEW = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: "
                         r"(\d+)")
_NO_KERNEL = re.compile(r"Could not find an implementation for (\S+?)\((\d+)\) node with "
                        r"name '([^']*)'")
_NO_OP = re.compile(r"No Op registered for (\S+) with domain_version of (\d+)|"
                    r"(\S+?)\(-?\d+\) is not a registered function/op")


def runtime_refusal(source, message: str, providers=()) -> str | None:
    """Why ONNX Runtime refused ``source`` (a path or model bytes), as one line, when it
    is a version or operator-support limit of the installed runtime; else None."""
    version = import_ort().__version__
    if found := _TOO_NEW.search(message):
        model, domain, top = found.groups()
        return (f"The model uses opset {model} of domain {domain}, newer than the installed "
                f"ONNX Runtime {version} supports (up to opset {top}); upgrade onnxruntime "
                f"(pip install -U onnxruntime) or re-export the model with opset {top} or "
                "lower.")
    if found := _IR_TOO_NEW.search(message):
        model, top = found.groups()
        return (f"The model has IR version {model}, newer than the installed ONNX Runtime "
                f"{version} reads (up to IR version {top}); upgrade onnxruntime or re-export "
                "the model with an older exporter / onnx package.")
    stamp = _opset_stamp(source)
    if found := _NO_KERNEL.search(message):
        op, since, node = found.groups()
        return (f"The installed ONNX Runtime {version} has no kernel for {op} (version "
                f"{since}, node {node!r}) with these input types on {', '.join(providers)}; "
                f"{stamp}. Re-export the model with types or operators it supports, upgrade "
                "onnxruntime, or choose other --providers.")
    if found := _NO_OP.search(message):
        op = found.group(1) or found.group(3)
        return (f"The installed ONNX Runtime {version} does not know operator {op}; {stamp}. "
                "Re-export the model without it, upgrade onnxruntime, or register the "
                "custom-operator library that defines it.")
    return None


def _opset_stamp(source) -> str:
    """'model opset ai.onnx 17 (runtime up to 28)' for the model's standard domains."""
    model = onnx.ModelProto()
    try:
        if isinstance(source, (bytes, bytearray)):
            model.ParseFromString(bytes(source))
        else:
            model = onnx.load(os.fspath(source), load_external_data=False)
    except Exception:  # noqa: BLE001 - only a detail of the message
        return "model opset unknown"
    top = runtime_opsets()
    parts = [f"{o.domain or 'ai.onnx'} {o.version}"
             + (f" (runtime up to {top[d]})" if (d := _domain_key(o.domain)) in top else "")
             for o in model.opset_import if o.domain in ("", "ai.onnx", "ai.onnx.ml")]
    old = any(o.domain in ("", "ai.onnx") and o.version < 7 for o in model.opset_import)
    return "model opset " + (", ".join(parts) or "none") + (
        " (ONNX Runtime runs opset 7 and later: convert the model with "
        "onnx.version_converter)" if old else "")


def _domain_key(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def runtime_opsets() -> dict[str, int]:
    """{domain: newest opset} of the operator schemas the installed ONNX Runtime registers
    ("" is ai.onnx); empty when this build does not list them."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as state

        schemas = state.get_all_operator_schema()
    except Exception:  # noqa: BLE001 - an optional detail (not every build exposes it)
        return {}
    top: dict[str, int] = {}
    for schema in schemas:
        top[schema.domain] = max(top.get(schema.domain, 0), int(schema.since_version))
    return top


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
