"""onnxdiag: diagnose, prune and repair trained ONNX classifiers.

The public API mirrors the CLI verbs and returns result records.  Importing this
package does not import onnxruntime (the runner imports it lazily).
"""

__version__ = "0.1.0"

__all__ = ["analyze", "inspect_model", "readouts_report", "select_report", "__version__"]


def __getattr__(name):
    # Lazy: `import onnxdiag` stays cheap; the verbs live in onnxdiag.analysis.
    if name in ("analyze", "inspect_model", "readouts_report", "select_report"):
        from . import analysis

        return getattr(analysis, name)
    raise AttributeError(f"module 'onnxdiag' has no attribute {name!r}")
