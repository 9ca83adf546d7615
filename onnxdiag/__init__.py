"""onnxdiag: diagnose, prune and repair trained ONNX classifiers.

The public API mirrors the CLI verbs.  Importing this package does not import
onnxruntime (the runner imports it lazily).
"""

__version__ = "0.1.0"
