"""Load, check, hash and save ONNX models.

Contracts:
- :func:`load_model` always returns a new ModelProto; it never modifies what it
  was given (ARCHITECTURE invariant 1).
- :func:`save_model` writes to a temporary name in the destination folder and
  renames it into place, so a failure leaves no partial file (invariant 4), and
  it refuses to overwrite any path listed in ``protect`` (the inputs).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError, EncodeError

from ..errors import ModelLoadError, OutputError

#: Protobuf cannot serialise a message of 2 GiB or more; above this size the
#: model is saved with its initializers in an external data file.
PROTOBUF_LIMIT = 2**31 - 2**20

ModelSource = "str | os.PathLike | bytes | onnx.ModelProto"


def serialized(model: onnx.ModelProto) -> bytes | None:
    """``model``'s bytes, or None at ``PROTOBUF_LIMIT`` or more: one encoding (upb's
    ``ByteSize()`` encodes the whole model too, so a size test before serialising
    doubles the cost: 0.16 s on a 100 MB model)."""
    try:
        data = model.SerializeToString()
    except (EncodeError, ValueError):  # protobuf refuses 2 GiB and more
        return None
    return data if len(data) < PROTOBUF_LIMIT else None


def load_model(source, *, infer_shapes: bool = True, check: bool = True) -> onnx.ModelProto:
    """Load a model from a path, bytes or a ModelProto, checked and normalised.

    Normalisation (on a copy): initializers that are also listed as graph
    inputs (IR < 4 / opset 9 exports) are removed from the inputs, every node
    gets a unique non-empty name, and shapes are inferred.

    Raises:
        ModelLoadError: missing file, not ONNX, truncated or invalid model.
    """
    model = _read(source)
    if not model.graph.node:
        raise ModelLoadError(
            f"Model {_describe(source)} has an empty graph (no nodes): the file is truncated "
            "or not an ONNX model; re-export it."
        )
    if check:
        _check(model, source)
    _drop_initializer_inputs(model)
    _name_nodes(model)
    if infer_shapes:
        model = _infer_shapes(model)
    return model


def _describe(source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return f"'{os.fspath(source)}'"
    if isinstance(source, (bytes, bytearray)):
        return f"<{len(source)} bytes>"
    return "<ModelProto>"


def _read(source) -> onnx.ModelProto:
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        return model
    if isinstance(source, (bytes, bytearray)):
        return _parse(bytes(source), source)
    if not isinstance(source, (str, os.PathLike)):
        raise ModelLoadError(
            f"Cannot load a model from a {type(source).__name__}; pass a path, bytes or an "
            "onnx.ModelProto."
        )
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"Model file '{path}' does not exist; check the path.")
    if path.is_dir():
        raise ModelLoadError(f"Model path '{path}' is a folder; pass the .onnx file inside it.")
    try:
        model = _parse(path.read_bytes(), source)
        onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
    except (FileNotFoundError, OSError) as exc:
        raise ModelLoadError(
            f"Model '{path}' refers to external data that cannot be read ({exc}); keep the "
            "data file next to the model."
        ) from exc
    return model


def _parse(data: bytes, source) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"Model {_describe(source)} is not a valid ONNX file ({type(exc).__name__}: the "
            "bytes do not parse as an ONNX ModelProto); check it is an .onnx file and not "
            "truncated."
        ) from exc
    if not model.HasField("graph") or not model.opset_import:
        raise ModelLoadError(
            f"Model {_describe(source)} is not a valid ONNX model (no graph or no opset); "
            "check it is an .onnx file and not truncated."
        )
    return model


def _check(model: onnx.ModelProto, source) -> None:
    try:
        if model.ByteSize() < PROTOBUF_LIMIT:
            onnx.checker.check_model(model)
        elif isinstance(source, (str, os.PathLike)):
            onnx.checker.check_model(os.fspath(source))
    except onnx.checker.ValidationError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise ModelLoadError(
            f"Model {_describe(source)} fails the ONNX checker: {first}; the file is truncated "
            "or was exported incorrectly."
        ) from exc


def _drop_initializer_inputs(model: onnx.ModelProto) -> None:
    """Old exports (IR < 4) list every initializer as a graph input too."""
    init_names = {t.name for t in model.graph.initializer}
    keep = [i for i in model.graph.input if i.name not in init_names]
    if len(keep) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(keep)
        model.ir_version = max(model.ir_version, 4)


def _name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a unique, non-empty name (results are keyed by it)."""
    counts = Counter(n.name for n in model.graph.node if n.name)
    taken = set(counts)
    for i, node in enumerate(model.graph.node):
        if node.name and counts[node.name] == 1:
            continue
        base = node.name or f"{node.op_type}_{i}"
        name, k = base, 1
        while name in taken and not (node.name == name and counts[name] == 1):
            name = f"{base}_{k}"
            k += 1
        if node.name:
            counts[node.name] -= 1
        node.name = name
        taken.add(name)
        counts[name] = 1


def _infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    if model.ByteSize() >= PROTOBUF_LIMIT:
        return model  # in-memory inference cannot serialise it; shapes stay as exported
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False,
                                                 data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a convenience; the graph is still valid
        return model


def model_hash(model: onnx.ModelProto) -> str:
    """SHA-256 of the model's content (graph structure and every initializer).

    Works for models over 2 GiB: initializers are hashed one at a time.
    """
    h = hashlib.sha256()
    h.update(f"ir{model.ir_version}".encode())
    graph = model.graph
    for part in (*model.opset_import, *graph.input, *graph.output, *graph.node,
                 *graph.sparse_initializer):
        h.update(part.SerializeToString(deterministic=True))
    for init in model.graph.initializer:
        h.update(init.name.encode())
        h.update(np.ascontiguousarray(onnx.numpy_helper.to_array(init)).tobytes())
    return h.hexdigest()


def file_hash(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_output_path(path: str | os.PathLike, *, protect=()) -> Path:
    """Validate an output file path before any work is done.

    Raises:
        OutputError: the path is one of ``protect`` (an input), is a folder, or its
            folder cannot be created or written.
    """
    out = Path(path)
    for p in protect:
        if p is not None and isinstance(p, (str, os.PathLike)) and _same_file(out, Path(p)):
            raise OutputError(
                f"Output '{out}' is the input file '{p}'; onnxdiag never overwrites an input. "
                "Choose another output name with -o."
            )
    if out.is_dir():
        raise OutputError(f"Output '{out}' is a folder; give a file name such as {out}/model.onnx.")
    ensure_writable_dir(out.parent)
    return out


def ensure_writable_dir(folder: str | os.PathLike) -> Path:
    """Create ``folder`` if needed and check it is writable; raise OutputError if not."""
    folder = Path(folder) if str(folder) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"Cannot create output folder '{folder}' ({exc.strerror}); choose a writable location."
        ) from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"Output folder '{folder}' is not writable; choose a writable location.")
    return folder


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def save_model(model: onnx.ModelProto, path: str | os.PathLike, *, protect=(),
               external_data: bool | None = None,
               size_threshold: int = PROTOBUF_LIMIT) -> Path:
    """Save ``model`` atomically to ``path``; never overwrite a path in ``protect``.

    With ``external_data=None`` the initializers go to ``<name>.data`` beside the
    model when the model is at least ``size_threshold`` bytes (protobuf's 2 GiB
    limit by default). ``model`` is not modified.
    """
    out = check_output_path(path, protect=protect)
    if external_data is None:
        external_data = model.ByteSize() >= size_threshold
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        tmp_model = Path(tmp) / out.name
        if external_data:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            onnx.save_model(copy, tmp_model, save_as_external_data=True,
                            all_tensors_to_one_file=True, location=f"{out.name}.data",
                            size_threshold=0)
            os.replace(Path(tmp) / f"{out.name}.data", out.parent / f"{out.name}.data")
        else:
            with open(tmp_model, "wb") as f:
                f.write(model.SerializeToString())
        os.replace(tmp_model, out)
    return out


def _default_mode() -> int:
    """The permissions ``open(path, "w")`` would give a new file (0666 minus the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write text to ``path`` via a temporary file and rename (no partial files)."""
    out = Path(path)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, _default_mode())  # mkstemp creates 0600; a written file is 0666 & ~umask
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def get_input_specs(model: onnx.ModelProto):
    """The model's graph inputs as :class:`onnxdiag.data.InputSpec` (None = dynamic dim)."""
    from ..data.source import InputSpec

    init_names = {t.name for t in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in init_names:
            continue
        ttype = value.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                      for d in ttype.shape.dim)
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type))
        specs.append(InputSpec(name=value.name, shape=shape, dtype=dtype))
    return specs


def remove_file_quietly(path: str | os.PathLike) -> None:
    """Delete a file or folder if it exists (cleanup after a failed run)."""
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)
