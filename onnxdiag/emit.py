"""Finalize edited models: check, load in ONNX Runtime, compare with the source, save.

ARCHITECTURE invariant 3: every emitted model has stale intermediate shapes cleared,
shapes re-inferred, passes ``onnx.checker.check_model(full_check=True)``, loads in
ONNX Runtime, and its outputs were compared with the source model on verification
data; the comparison goes into the sidecar JSON written next to it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnx

from .errors import OnnxDiagError
from .model_io import PROTOBUF_LIMIT, check_output_path, model_hash, save_model
from .report import to_json


def finalize_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Clear stale value_info, re-infer shapes, run the full checker (on a copy).

    Raises:
        OnnxDiagError: the edited model fails the checker (a bug or an unsupported edit).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    if out.ByteSize() < PROTOBUF_LIMIT:
        out = onnx.shape_inference.infer_shapes(out, strict_mode=True)
        try:
            onnx.checker.check_model(out, full_check=True)
        except onnx.checker.ValidationError as exc:
            raise OnnxDiagError(f"The edited model fails the ONNX checker ({exc}); this is a "
                                "bug: please report it with the command line.") from exc
    return out


def compare_models(source_runner, emitted_runner, source, head, *, max_batches: int = 8) -> dict:
    """Compare two models' head logits on verification data (a DataSource).

    Both runners must expose the head's features and logits (``probe.make_head_runner``).

    Returns max |Δlogit|, relative difference and the top-1 agreement, over at most
    ``max_batches`` batches.
    """
    from .probe import head_arrays

    names = [head.features, head.logits]
    diff = scale = 0.0
    agree = n = 0
    for i, batch in enumerate(source.batches()):
        if i >= max_batches:
            break
        _, ua = head_arrays(source_runner.run(batch.feeds, names), head)
        _, ub = head_arrays(emitted_runner.run(batch.feeds, names), head)
        diff = max(diff, float(np.max(np.abs(ua - ub))))
        scale = max(scale, float(np.max(np.abs(ua))))
        agree += int(np.sum(ua.argmax(1) == ub.argmax(1)))
        n += ua.shape[0]
    return {"n_samples": n, "max_abs_logit_diff": diff,
            "max_rel_logit_diff": diff / (scale + 1e-12),
            "top1_agreement": agree / n if n else None}


def cpu_conv_block(cpuinfo: str | None = None) -> int | None:
    """Channel block of ONNX Runtime's blocked (NCHWc) CPU convolutions on this machine:
    16 with AVX-512F, 8 with AVX2 (MLAS ``NchwcBlockSize``), None when unknown (not
    Linux x86-64, or neither). ``cpuinfo``: the text of /proc/cpuinfo (read when None)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return 16 if "avx512f" in flags else 8 if "avx2" in flags else None


def measure_latency(model, feeds_by_batch: dict[int, dict], *, repeats: int = 20,
                    threads: int | None = None) -> dict:
    """Median ONNX Runtime CPU latency (ms) per batch size: {batch: ms}."""
    from .runner import OrtRunner

    runner = OrtRunner(model, providers="cpu", threads=threads)
    out = {}
    for batch, feeds in feeds_by_batch.items():
        runner.run(feeds)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.run(feeds)
            times.append(time.perf_counter() - t0)
        out[str(batch)] = 1000 * float(np.median(times))
    return out


def emit_model(model: onnx.ModelProto, path, *, source_path=None, sidecar: dict,
               protect=()) -> dict:
    """Save ``model`` to ``path`` atomically with ``<path>.json`` beside it.

    ``sidecar`` gets the emitted model's hash, file size and the source's size; the
    input files in ``protect`` are never overwritten. Returns the sidecar dict.
    """
    out = check_output_path(path, protect=protect)
    sidecar_path = out.with_name(out.name + ".json")
    check_output_path(sidecar_path, protect=protect)
    save_model(model, out, protect=protect)
    info = dict(sidecar)
    info["emitted"] = {"path": str(out), "sha256": model_hash(model),
                       "file_bytes": os.path.getsize(out)}
    if source_path is not None and Path(source_path).is_file():
        info["source_file_bytes"] = os.path.getsize(source_path)
    from .model_io import write_text_atomic

    write_text_atomic(sidecar_path, to_json(info))
    os.chmod(sidecar_path, os.stat(out).st_mode & 0o777)  # same permissions as the model
    return info


def store_sparse(model: onnx.ModelProto, names) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` with the initializers ``names`` stored as ``sparse_initializer``
    where that is smaller (SPEC C5): values (nnz) + int64 linear indices (nnz) against the
    dense bytes.  Initializers that are also graph inputs stay dense.  Returns the copy and
    the names converted.

    ONNX's shape inference (and so ``check_model(full_check=True)``) does not type a sparse
    initializer read by a Conv; check the dense-stored model in full and this one with
    :func:`check_sparse_copy`.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inputs = {v.name for v in out.graph.input}
    wanted = set(names) - inputs
    converted = []
    for init in list(out.graph.initializer):
        if init.name not in wanted or init.data_location == onnx.TensorProto.EXTERNAL:
            continue
        w = onnx.numpy_helper.to_array(init)
        flat = np.flatnonzero(w)
        if flat.size * (w.itemsize + 8) >= w.size * w.itemsize:
            continue
        values = onnx.numpy_helper.from_array(w.ravel()[flat], init.name)
        indices = onnx.numpy_helper.from_array(flat.astype(np.int64), init.name + "_indices")
        out.graph.sparse_initializer.append(
            onnx.helper.make_sparse_tensor(values, indices, list(w.shape)))
        out.graph.initializer.remove(init)
        converted.append(init.name)
    return out, converted


def check_sparse_copy(sparse: onnx.ModelProto, dense: onnx.ModelProto, feeds: dict) -> dict:
    """Structural checker on ``sparse``, ONNX Runtime load, and its outputs against the
    dense-stored ``dense`` on ``feeds``: {"max_abs_output_diff": float}.

    Raises:
        OnnxDiagError: the sparse copy fails the checker or differs from the dense one.
    """
    from .runner import OrtRunner

    try:
        onnx.checker.check_model(sparse)
    except onnx.checker.ValidationError as exc:
        raise OnnxDiagError(f"The sparse-initializer copy fails the ONNX checker ({exc}); "
                            "emit without --sparse-initializers.") from exc
    a = OrtRunner(dense, providers="cpu").run(feeds)
    b = OrtRunner(sparse, providers="cpu").run(feeds)
    diff = max(float(np.max(np.abs(np.asarray(a[k], np.float64) - b[k]))) for k in a)
    if not diff <= 1e-4 * max(1.0, max(float(np.max(np.abs(v))) for v in a.values())):
        raise OnnxDiagError(f"The sparse-initializer copy differs from the dense one by {diff}; "
                            "emit without --sparse-initializers.")
    return {"max_abs_output_diff": diff}
