"""Finalize edited models: clear stale shapes, re-infer, check in full, save with a sidecar.

Invariant: every emitted model has stale intermediate shapes cleared, shapes re-inferred,
passes ``onnx.checker.check_model(full_check=True)`` and is written atomically next to its
sidecar JSON; never over an input file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx

from ..report import to_json
from .io import PROTOBUF_LIMIT, check_output_path, model_hash, save_model, serialized


class EditError(RuntimeError):
    """An edited model is invalid (fails the ONNX checker or ONNX Runtime): a bug in
    onnxdiag, never the user's doing, so it is not an OnnxDiagError."""


def finalize_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of an edited ``model`` with every value_info cleared, shapes re-inferred
    (strict, types checked, data propagated) and the full checker passed.  A model of
    2 GiB or more comes back cleared but unchecked (in-memory checking cannot serialise
    it).  Every edit ends here: :meth:`onnxdiag.model.edit.ModelEditor.finish` calls it.

    Raises:
        EditError: the edited model fails shape inference or the checker (a bug).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    data = serialized(out)  # one encoding, for the size test and shape inference
    if data is None:
        return out
    try:
        # the full checker is the structural one plus strict, type-checked shape
        # inference: both on the one encoding (the inference here also propagates data)
        out = onnx.shape_inference.infer_shapes(data, check_type=True, strict_mode=True,
                                                data_prop=True)
        onnx.checker.check_model(data)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise EditError(f"the edited model fails the ONNX checker: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                        ) from exc
    return out


def reload_check(model: onnx.ModelProto, feeds: dict | None = None) -> dict:
    """Serialize ``model``, parse it back, run the full checker and open an ONNX Runtime
    session on the bytes; with ``feeds``, its outputs must equal the in-memory model's.

    Returns {"full_checker": "passed", "onnxruntime_load": "passed",
    "max_abs_output_diff": float or None}. Raises EditError when any step fails.
    """
    from ..runtime.runner import OrtRunner

    data = model.SerializeToString()
    again = onnx.load_from_string(data)
    # ONNX shape inference does not type a sparse_initializer read by a Conv, so a
    # sparse-stored model gets the structural checker (its dense form had the full one).
    full = len(data) < PROTOBUF_LIMIT and not again.graph.sparse_initializer
    try:
        onnx.checker.check_model(again, full_check=full)
        reloaded = OrtRunner(again, providers="cpu")
    except Exception as exc:  # noqa: BLE001 - any failure here is an invalid edit
        raise EditError(f"the emitted model does not reload: {exc}") from exc
    diff = None
    if feeds is not None:
        a, b = OrtRunner(model, providers="cpu").run(feeds), reloaded.run(feeds)
        diff = max((output_diff(a[k], b[k]) for k in a), default=0.0)
    return {"full_checker" if full else "structural_checker": "passed",
            "onnxruntime_load": "passed", "max_abs_output_diff": diff}


def output_diff(a, b) -> float:
    """Max |a − b| of two outputs: tensors elementwise; a sequence of maps (a ZipMap's
    probabilities) key by key."""
    if isinstance(a, list):
        if len(a) != len(b):
            return float("inf")
        return max((output_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return float("inf")
        return max((abs(float(a[k]) - float(b[k])) for k in a), default=0.0)
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)),
                        initial=0.0))


def emit_model(model: onnx.ModelProto, path, *, source_path=None, sidecar: dict,
               protect=(), verify_feeds: dict | None = None, complete=None) -> dict:
    """Save ``model`` to ``path`` atomically with ``<path>.json`` beside it.

    Before anything is written the model goes through :func:`reload_check` (with
    ``verify_feeds``: its outputs on them are compared with the in-memory model), recorded
    as ``checks`` in the sidecar. The sidecar's ``emitted`` record (the caller's facts:
    params, FLOPs, …) gets the file's path, sha256 and size, and its ``source`` record the
    source file's size (``source_path``); ``complete(info)`` may then add what depends on
    them (e.g. a file-size ratio) before the sidecar is written. The input files in
    ``protect`` are never overwritten. Returns the sidecar dict.
    """
    checks = reload_check(model, verify_feeds)
    out = check_output_path(path, protect=protect)
    sidecar_path = out.with_name(out.name + ".json")
    check_output_path(sidecar_path, protect=protect)
    save_model(model, out, protect=protect)
    info = dict(sidecar)
    info.setdefault("checks", checks)
    info["emitted"] = {**(info.get("emitted") or {}), "path": str(out),
                       "sha256": model_hash(model), "file_bytes": os.path.getsize(out)}
    if source_path is not None and Path(source_path).is_file():
        info["source"] = {**(info.get("source") or {}),
                          "file_bytes": os.path.getsize(source_path)}
    if complete is not None:
        info = complete(info)
    from .io import write_text_atomic

    write_text_atomic(sidecar_path, to_json(info))
    os.chmod(sidecar_path, os.stat(out).st_mode & 0o777)  # same permissions as the model
    return info


def store_sparse(model: onnx.ModelProto, names) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` with the initializers ``names`` stored as ``sparse_initializer``
    where that is smaller (METHODS §C5): values (nnz) + int64 linear indices (nnz) against the
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
        EditError: the sparse copy fails the checker or differs from the dense one (a bug
            of :func:`store_sparse`; the message says how to emit without it).
    """
    from ..runtime.runner import OrtRunner

    try:
        onnx.checker.check_model(sparse)
    except onnx.checker.ValidationError as exc:
        raise EditError(f"the sparse-initializer copy fails the ONNX checker ({exc}); "
                            "emit without --sparse-initializers.") from exc
    a = OrtRunner(dense, providers="cpu").run(feeds)
    b = OrtRunner(sparse, providers="cpu").run(feeds)
    diff = max(float(np.max(np.abs(np.asarray(a[k], np.float64) - b[k]))) for k in a)
    if not diff <= 1e-4 * max(1.0, max(float(np.max(np.abs(v))) for v in a.values())):
        raise EditError(f"the sparse-initializer copy differs from the dense one by {diff}; "
                            "emit without --sparse-initializers.")
    return {"max_abs_output_diff": diff}
