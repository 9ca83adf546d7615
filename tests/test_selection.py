"""Tests for onnxdiag.selection (METHODS §A3) on hand-checkable series."""

import json
import math

import numpy as np
import pytest

from onnxdiag.errors import DataError, OnnxDiagError
from onnxdiag.selection.series import (
    correlate_series,
    early_stop,
    evaluate_selection,
    natural_sort_key,
    rank_models,
    select_checkpoint,
    window_indices,
)

# Eight checkpoints.  Checkpoint 0 is the init trap (tiny head gradient, flagged degenerate);
# the overall oracle (2) lies outside the default window (3..7), whose oracle is 6.
ACC = [0.10, 0.50, 0.90, 0.80, 0.85, 0.83, 0.86, 0.84]
HEAD_GRAD = [0.01, 0.9, 0.2, 0.4, 0.25, 0.35, 0.3, 0.32]
LOSS = [2.3, 1.5, 0.4, 0.6, 0.5, 0.55, 0.45, 0.52]


def test_natural_sort_key():
    names = ["ckpt_10.onnx", "ckpt_2.onnx", "Ckpt_3.onnx", "ckpt_1.onnx", "ckpt_1b.onnx"]
    assert sorted(names, key=natural_sort_key) == [
        "ckpt_1.onnx", "ckpt_1b.onnx", "ckpt_2.onnx", "Ckpt_3.onnx", "ckpt_10.onnx"]
    assert sorted(["e1_s20", "e1_s3", "e10_s1", "e2_s1"], key=natural_sort_key) == [
        "e1_s3", "e1_s20", "e2_s1", "e10_s1"]


def test_window_and_direction():
    values = [0.0, 5.0, 4.0, 3.0]
    assert select_checkpoint(values, "lower", window=2) == 3
    assert select_checkpoint(values, "lower", window="all") == 0
    assert select_checkpoint(values, "higher", window=3) == 1
    assert select_checkpoint(values, "higher", window=100) == 1
    assert list(window_indices(8)) == [3, 4, 5, 6, 7]
    for bad in (0, -1, "5", True, 2.5):
        with pytest.raises(OnnxDiagError, match="Invalid window"):
            select_checkpoint(values, "lower", window=bad)
    with pytest.raises(OnnxDiagError, match="'context'"):
        select_checkpoint(values, "context")


def test_ties_go_to_the_later_checkpoint():
    assert select_checkpoint([3.0, 1.0, 2.0, 1.0], "lower", window="all") == 3
    assert select_checkpoint([1.0, 1.0], "higher", window="all") == 1


def test_flagged_and_nan_are_never_selected():
    assert select_checkpoint(HEAD_GRAD, "lower", window="all") == 0  # the trap
    assert select_checkpoint(HEAD_GRAD, "lower", window="all", flagged=[0]) == 2
    mask = [True] + [False] * 7
    assert select_checkpoint(HEAD_GRAD, "lower", window="all", flagged=mask) == 2
    assert select_checkpoint([1.0, math.nan, 3.0], "higher", window="all") == 2
    with pytest.raises(OnnxDiagError, match="--window all"):
        select_checkpoint([1.0, 2.0, 3.0], "lower", window=2, flagged=[1, 2])
    with pytest.raises(OnnxDiagError, match="Every checkpoint is: select needs trained") as err:
        select_checkpoint([1.0, 2.0], "lower", window="all", flagged=[0, 1])
    assert "--window all" not in str(err.value)  # the window holds every checkpoint already
    with pytest.raises(DataError, match="flagged"):
        select_checkpoint([1.0, 2.0], "lower", flagged=[5])


def test_early_stop_patience():
    stop = early_stop(HEAD_GRAD, "lower", patience=3)
    assert (stop.stopped_at, stop.best) == (3, 0)  # the trap stops training at once
    stop = early_stop(HEAD_GRAD, "lower", patience=3, flagged=[0])
    assert (stop.stopped_at, stop.best) == (5, 2)
    stop = early_stop([5.0, 4.0, 3.0, 2.0], "lower", patience=1)
    assert (stop.stopped_at, stop.best) == (None, 3)
    flat = early_stop([1.0] * 5, "higher", patience=3)  # a flat readout stops; ties keep later
    assert (flat.stopped_at, flat.best) == (3, 3)
    lead = early_stop([0.0, 0.0, 0.0, 5.0, 4.0], "lower", patience=2, flagged=[0, 1, 2])
    assert (lead.stopped_at, lead.best) == (None, 4)  # flagged lead-in does not use patience
    with pytest.raises(OnnxDiagError, match="patience"):
        early_stop([1.0], "lower", patience=0)


def test_early_stop_without_patience_limit_equals_selection():
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = np.round(rng.normal(size=9), 1)  # rounding makes ties likely
        flags = list(np.flatnonzero(rng.random(9) < 0.2))
        if len(flags) == 9:
            continue
        for direction in ("lower", "higher"):
            kept = early_stop(v, direction, patience=100, flagged=flags).best
            assert kept == select_checkpoint(v, direction, window="all", flagged=flags)


def test_correlations():
    c = correlate_series([1, 2, 3, 4], [1, 3, 2, 4])
    assert c.pearson == pytest.approx(0.8) and c.spearman == pytest.approx(0.8) and c.n == 4
    c = correlate_series([1, 2, math.nan, 4], [2, 4, 6, 8])
    assert c.pearson == pytest.approx(1.0) and c.n == 3
    with np.errstate(all="raise"):
        const = correlate_series([2, 2, 2, 2], [1, 2, 3, 4])
    assert math.isnan(const.pearson) and const.reason == "constant readout"
    assert correlate_series([1, 2, 3], [5, 5, 5]).reason == "constant reference"
    assert correlate_series([1, 2], [1, 2]).reason == "fewer than 3 finite pairs"


def test_evaluate_selection_gaps_and_baselines():
    conf = [a - 0.05 for a in ACC]  # higher is better, tracks accuracy
    report = evaluate_selection({"head_grad": HEAD_GRAD, "confidence": conf}, ACC, LOSS,
                                flagged=[0])
    assert report.window_indices == (3, 4, 5, 6, 7) and report.flagged == (0,)
    assert report.oracle_window.index == 6 and report.oracle_overall.index == 2
    hg = report.readouts["head_grad"]
    assert hg.selected.index == 4 and hg.selected.accuracy == pytest.approx(0.85)
    assert hg.selected.gap_window_pp == pytest.approx(1.0)
    assert hg.selected.gap_overall_pp == pytest.approx(5.0)
    assert (hg.early_stop.stopped_at, hg.early_stop.best) == (5, 2)
    assert hg.early_stop_pick.gap_window_pp == pytest.approx(-4.0)  # outside the window
    assert hg.vs_accuracy.pearson < -0.9 and hg.vs_loss.pearson > 0.9
    assert not hg.wrong_sign
    assert report.readouts["confidence"].selected.index == 6
    assert report.readouts["confidence"].selected.gap_window_pp == pytest.approx(0.0)
    assert report.last.index == 7 and report.last.gap_window_pp == pytest.approx(2.0)
    assert report.last.gap_overall_pp == pytest.approx(6.0)
    assert report.random.index is None
    assert report.random.accuracy == pytest.approx(0.836)
    assert report.random.gap_window_pp == pytest.approx(2.4)
    assert report.random.gap_overall_pp == pytest.approx(6.4)
    assert report.wrong_sign == []
    assert isinstance(hg.selected.gap_window_pp, float)


def test_unflagged_trap_flips_the_correlation_sign():
    report = evaluate_selection({"head_grad": HEAD_GRAD}, ACC, LOSS)  # nothing flagged
    hg = report.readouts["head_grad"]
    assert hg.vs_accuracy.pearson == pytest.approx(0.0862, abs=1e-4)
    assert report.wrong_sign == ["head_grad"]


def test_wrong_sign_and_context_readouts():
    series = {"entropy": ACC, "confidence": [-a for a in ACC], "n_params": [1e6] * 8,
              "weight_norm": list(range(8))}
    report = evaluate_selection(series, ACC, window="all")
    assert report.wrong_sign == ["entropy", "confidence"]
    ctx = report.readouts["n_params"]
    assert ctx.selected is None and ctx.early_stop is None and not ctx.wrong_sign
    assert ctx.vs_accuracy.reason == "constant readout" and "context" in ctx.note
    assert report.readouts["weight_norm"].vs_accuracy.pearson > 0
    assert report.readouts["entropy"].vs_loss is None
    text = json.dumps(report.to_dict(), allow_nan=False)
    assert '"wrong_sign": true' in text


def test_evaluate_selection_user_errors():
    with pytest.raises(DataError, match="Divide percentages by 100"):
        evaluate_selection({"loss": LOSS}, [a * 100 for a in ACC])
    with pytest.raises(DataError, match="7 values for 8 checkpoints"):
        evaluate_selection({"loss": LOSS[:7]}, ACC)
    with pytest.raises(OnnxDiagError, match="Unknown readout 'flops'"):
        evaluate_selection({"flops": LOSS}, ACC)
    report = evaluate_selection({"flops": LOSS}, ACC, directions={"flops": "lower"})
    assert report.readouts["flops"].selected.index == 6


def test_all_flagged_window_is_reported_not_raised():
    report = evaluate_selection({"head_grad": HEAD_GRAD}, ACC, window=2, flagged=[6, 7])
    hg = report.readouts["head_grad"]
    assert hg.selected is None and "--window all" in hg.note
    assert report.random.accuracy == pytest.approx(0.85)  # all flagged: whole window


@pytest.mark.parametrize("flagged", [[4], [3, 6], [0, 3, 7]])
def test_random_baseline_skips_flagged_checkpoints_inside_the_window(flagged):
    """The random baseline is the accuracy of a uniform draw among the checkpoints a
    readout may select: the window's unflagged ones (brute force over the window)."""
    report = evaluate_selection({"head_grad": HEAD_GRAD}, ACC, flagged=flagged)
    eligible = [ACC[i] for i in range(3, 8) if i not in flagged]
    assert report.random.accuracy == pytest.approx(sum(eligible) / len(eligible), abs=1e-12)
    assert report.random.gap_window_pp == pytest.approx(100 * (0.86 - report.random.accuracy))
    with_flags = sum(ACC[3:8]) / 5  # what a baseline that ignored the flags would give
    assert abs(report.random.accuracy - with_flags) > 1e-3


def test_rank_models():
    acc = [0.1, 0.3, 0.2, 0.5, 0.4]
    grad = [-a for a in acc]  # lower is better, perfectly ranked
    ranking = rank_models(grad, acc, "lower", n_params=[1, 2, 3, 4, 5])
    assert ranking.spearman == pytest.approx(-1.0) and ranking.kendall == pytest.approx(-1.0)
    assert not ranking.wrong_sign and ranking.n_models == 5
    assert ranking.baseline_spearman == pytest.approx(0.8)
    assert ranking.baseline_kendall == pytest.approx(0.6)
    assert rank_models(grad, acc, "higher").wrong_sign
    no_base = rank_models(grad, acc, "lower")
    assert math.isnan(no_base.baseline_spearman)
    json.dumps(no_base.to_dict(), allow_nan=False)


def test_list_checkpoints_accepts_one_folder_or_listing_as_a_string(tmp_path):
    from onnxdiag.selection.checkpoints import list_checkpoints

    for name in ("ckpt_10.onnx", "ckpt_2.onnx", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    listing = tmp_path / "series.json"
    listing.write_text(json.dumps([{"path": "ckpt_2.onnx", "step": 2},
                                   {"path": "ckpt_10.onnx", "step": 10}]))
    from_folder = list_checkpoints(str(tmp_path))
    assert [p.path.rsplit("/", 1)[1] for p in from_folder] == ["ckpt_2.onnx", "ckpt_10.onnx"]
    assert [c.step for c in list_checkpoints(listing)] == [2, 10]
    with pytest.raises(OnnxDiagError, match="does not exist"):
        list_checkpoints(str(tmp_path / "missing.onnx"))
