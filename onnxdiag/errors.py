"""Errors a user can fix.  No logic lives here.

A user error is an :class:`OnnxDiagError`: its message is one line saying what
failed, the offending value, what exists and what to do.  The CLI prints it as
``error: …`` and exits with status 1, without a traceback.  Anything else is a bug:
the CLI prints ``internal error: <Type>: <message> …`` and exits with status 3, and
``--debug`` (or ONNXDIAG_DEBUG=1) shows the traceback (for a failed unit of work,
:class:`onnxdiag.runtime.executor.UnitFailure`, also the worker's own).
"""


class OnnxDiagError(Exception):
    """An error the user can fix (bad file, bad data, bad option)."""


class ModelLoadError(OnnxDiagError):
    """The model file is missing, not ONNX, truncated or invalid."""


class HeadNotFoundError(OnnxDiagError):
    """No linear classifier head could be found or verified."""


class DataError(OnnxDiagError):
    """The data does not match the model or is unusable (empty, NaN, labels)."""


class OutputError(OnnxDiagError):
    """An output path cannot be written (unwritable, would overwrite an input)."""


class MissingExtraError(OnnxDiagError):
    """An optional dependency (extra) is needed for this feature."""
