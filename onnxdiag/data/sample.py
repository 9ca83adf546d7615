"""The bundled real sample (models/sample): default model and data for every command."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import OnnxDiagError


@dataclass(frozen=True)
class Sample:
    """Paths of the bundled sample (see models/README.md for how it was made)."""

    folder: Path
    model: Path
    calibration: Path
    evaluation: Path
    checkpoints: Path


def get_sample() -> Sample:
    """Locate models/sample next to the package (editable install) or in the working folder.

    Raises:
        OnnxDiagError: the sample is not present (e.g. a wheel install without the repo).
    """
    candidates = [Path(__file__).resolve().parents[2] / "models" / "sample",
                  Path.cwd() / "models" / "sample"]
    for folder in candidates:
        if (folder / "model.onnx").is_file():
            return Sample(folder=folder, model=folder / "model.onnx",
                          calibration=folder / "calib.npz", evaluation=folder / "eval.npz",
                          checkpoints=folder / "checkpoints")
    raise OnnxDiagError(
        "The bundled sample (models/sample/model.onnx) was not found; install onnxdiag from its "
        "source checkout with `pip install -e .` or pass MODEL and --data."
    )
