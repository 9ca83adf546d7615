"""METHODS §C4 label-free transition detection on synthetic agreement curves."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiag.errors import OnnxDiagError
from onnxdiag.sparsity import agreement, cts, cts_band, transition_band
from onnxdiag.sparsity.transition import cts_members

GRID = [0.90, 0.91, 0.92, 0.93, 0.94, 0.95, 0.96, 0.97]


def test_agreement_from_labels_or_logits():
    a = np.array([0, 1, 2, 2])
    logits = np.eye(3)[[0, 1, 1, 2]] * 5.0
    assert agreement(a, a) == 1.0
    assert agreement(a, logits) == 0.75
    with pytest.raises(OnnxDiagError, match="same"):
        agreement(a, a[:3])


def test_transition_band_interpolates_both_crossings():
    agr = [1.0, 0.95, 0.92, 0.85, 0.70, 0.55, 0.45, 0.20]
    band = transition_band(GRID, agr)
    assert band.start == pytest.approx(0.92 + 0.02 / 0.07 * 0.01)
    assert band.end == pytest.approx(0.95 + 0.05 / 0.10 * 0.01)
    assert not band.censored_start and band.rule == "agreement"
    assert band.to_dict()["hi"] == 0.9


def test_transition_band_censored_and_open_ended():
    band = transition_band(GRID, [0.8, 0.8, 0.7, 0.7, 0.6, 0.6, 0.6, 0.55])
    assert band.censored_start and band.start == 0.90 and band.end is None
    band = transition_band(GRID, [1.0] * 8)
    assert band.start is None and band.end is None
    # the first downward crossing counts even if the curve recovers later
    assert transition_band(GRID, [1, 0.8, 0.95, 0.7, 0.6, 0.4, 0.3, 0.2]).start == \
        pytest.approx(0.905)
    with pytest.raises(OnnxDiagError, match="lo < hi"):
        transition_band(GRID, [1.0] * 8, hi=0.5, lo=0.9)
    with pytest.raises(OnnxDiagError, match="differ"):
        transition_band(GRID, [1.0] * 7)


def test_cts_and_its_half_max_band():
    crbn = np.array([1.0, 0.98, 0.95, 0.90, 0.70, 0.40, 0.20, 0.10])
    bn = np.array([1.0, 0.98, 0.90, 0.70, 0.50, 0.35, 0.20, 0.10])
    values = cts(crbn, bn)
    np.testing.assert_allclose(values, (crbn - bn) / (1 - bn + 1e-8))
    assert values[0] == 0.0 and values.argmax() == 3
    members = cts_members(GRID, values)
    assert np.all(values[np.isin(GRID, members)] >= 0.5 * values.max())
    band = cts_band(GRID, values)
    assert (band.start, band.end) == (members[0], members[-1])
    assert cts_band(GRID, np.zeros(8)).start is None  # BN-present models: CTS ~ 0, no band
