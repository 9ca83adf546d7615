"""Models exported by real converters, for the pruning tests (each skips without its
converter)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest


def digits_mlp(d):
    """A real skl2onnx export: MLPClassifier (64 → 16 → 10) on sklearn's digits, with its
    calibration data; MatMul 'MatMul' (1,024 weights) is hidden, 'MatMul1' (160) the head."""
    pytest.importorskip("skl2onnx")
    from skl2onnx import to_onnx
    from sklearn.datasets import load_digits
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32) / 16
    clf = MLPClassifier(hidden_layer_sizes=(16,), max_iter=30, random_state=0)
    with pytest.warns(Warning):  # ConvergenceWarning: 30 iterations keep the test fast
        clf.fit(x[:400], y[:400])
    onnx.save(to_onnx(clf, x[:1], options={id(clf): {"zipmap": False}}, target_opset=17),
              d / "mlp.onnx")
    np.savez(d / "digits.npz", X=x[400:464], labels=y[400:464])
    return d / "mlp.onnx", d / "digits.npz"
