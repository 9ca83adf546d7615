"""tools/study_*.py --from-results: the tables of docs/STUDIES.md come from the committed raw
results alone (no zoo, no models), and the selection arithmetic they print is the method's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import study_common  # noqa: E402
import study_readouts  # noqa: E402

READOUT_COLUMNS = study_readouts.READOUTS


def _fake_run(folder: Path, name: str, arch: str, seed: int, acc, hg, loss) -> dict:
    """A raw result file of one run: three probes with the same values."""
    rows = []
    for probe in study_readouts.PROBES:
        for i, (a, h, lo) in enumerate(zip(acc, hg, loss, strict=True)):
            row = {"run": name, "probe": probe, "index": i, "epoch": i, "step": 10 * i,
                   "flagged": i == 0, "test_acc": a, "train_acc": a, "train_loss_noisy": lo,
                   "ort_acc": a if probe == "train" else None, "seconds_per_ckpt": 0.5}
            row.update({r: float(i) for r in READOUT_COLUMNS})  # rising: "higher" picks last
            row.update({"head_grad_feature": h, "head_grad": h, "head_grad_head": h,
                        "loss": lo})
            rows.append(row)
    study_common.write_rows(folder / "readouts" / f"{name}.csv", rows)
    return {"arch": arch, "schedule": "tail", "seed": seed, "width": 1.0, "batchnorm": True,
            "n_parameters": 1000 * (seed + 1), "n_checkpoints": len(acc), "noise": 0.15,
            "n_train": 2000, "best": {"test_acc": max(acc)}, "last": {"test_acc": acc[-1]},
            "train_s_per_epoch": 10.0}


def test_gap_table_from_synthetic_results(tmp_path, capsys):
    # 8 checkpoints; the tail window K = 5 is indices 3..7; accuracy peaks at index 4
    acc = [10.0, 50.0, 60.0, 70.0, 80.0, 78.0, 75.0, 72.0]
    meta = {
        # hg_feat lowest at the peak: gap 0; train loss falls to the end: picks the last
        "a-tail": _fake_run(tmp_path, "a-tail", "resnet18", 0, acc,
                            hg=[9, 8, 7, 6, 1, 2, 3, 4], loss=[9, 8, 7, 6, 5, 4, 3, 2]),
        # hg_feat lowest at index 6 (75 %): gap 5
        "a-tail-s1": _fake_run(tmp_path, "a-tail-s1", "resnet18", 1, acc,
                               hg=[9, 8, 7, 6, 5, 4, 0.5, 4], loss=[9, 8, 7, 6, 5, 4, 3, 2]),
    }
    (tmp_path / "readouts" / "runs.json").write_text(json.dumps(meta))
    assert study_readouts.main(["--from-results", "--results", str(tmp_path),
                                "--tables", "gap"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| resnet18 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # arch, seeds, hg_feat, hg_raw, hg_head, loss, l_margin, conf, entropy, curv, last, random,
    # best in window
    assert cells[1] == "2"
    assert cells[2] == f"2.50 ± {np.std([0, 5], ddof=1):.2f}"  # gaps 0 and 5
    assert cells[5] == "8.00 ± 0.00"  # train loss picks the last checkpoint (72 %)
    assert cells[10] == "8.00 ± 0.00"  # last
    random = np.mean([80 - a for a in acc[3:]])
    assert cells[11] == f"{random:.2f} ± 0.00"
    assert cells[12] == "0.00 ± 0.00"


def test_tuned_leaves_the_seed_out(tmp_path):
    acc = [10.0, 50.0, 60.0, 70.0, 80.0, 78.0, 75.0, 72.0]
    meta = {f"r-s{s}": _fake_run(tmp_path, f"r-s{s}", "resnet18", s, acc,
                                 hg=[9, 8, 7, 6, 1, 2, 3, 4], loss=list(range(8, 0, -1)))
            for s in range(3)}
    (tmp_path / "readouts" / "runs.json").write_text(json.dumps(meta))
    meta, series = study_readouts.load_series(tmp_path)
    _, gaps = study_readouts.tuned(meta, series, "tail", "train")
    assert gaps["tuned"] == [0.0, 0.0, 0.0] and gaps["universal"] == [0.0, 0.0, 0.0]


def test_bootstrap_and_mean_sd():
    m, sd, n = study_common.mean_sd([1.0, 2.0, 3.0, float("nan"), None])
    assert (m, n) == (2.0, 3) and sd == pytest.approx(1.0)
    v = np.arange(50.0)
    lo, hi = study_common.bootstrap_ci(50, lambda i: float(v[i].mean()), reps=500)
    assert lo < v.mean() < hi and hi - lo < 20


@pytest.mark.skipif(not (study_common.RESULTS / "readouts" / "runs.json").is_file(),
                    reason="no committed raw results")
def test_committed_results_reproduce_a_table_of_studies_md(capsys):
    """The smoke of issue 18: one table of docs/STUDIES.md regenerated without models."""
    assert study_readouts.main(["--from-results", "--tables", "gap"]) == 0
    first = capsys.readouterr().out.split("\n\n")[0:2]
    doc = (ROOT / "docs" / "STUDIES.md").read_text()
    for block in first:
        assert block.strip() and block.strip() in doc


def test_select_pruned_study_tables_from_raw_results(tmp_path):
    """Study 5's arithmetic: the gap of a criterion is the oracle pruned top-1 minus the
    pruned top-1 of its pick; "best dense then prune" picks the best dense checkpoint."""
    import study_select_pruned as ssp

    folder = tmp_path / ssp.FOLDER
    rows = []
    for i, (dense, pruned, agr) in enumerate([(0.80, 0.60, 0.70), (0.78, 0.66, 0.80),
                                              (0.79, 0.62, 0.75)]):
        row = {"S": 0.9, "checkpoint": f"ckpt_{i}.onnx", "dense_top1": dense,
               "pruned_top1": pruned, "manifest_test": dense, "seconds": 1.0,
               "agreement": agr, "combined": [1.5, 0.5, 1.0][i]}
        row.update({n: float(i) for n in ssp.CRITERIA if n not in row})
        rows.append(row)
    study_common.write_rows(folder / "r0.csv", rows)
    study_common.write_json(folder / "runs.json", {"r0": {"arch": "resnet18"}})
    (case,) = ssp.cases(tmp_path)
    assert case["differs"] and case["gaps"][ssp.BASELINE] == pytest.approx(6.0)
    assert case["gaps"]["agreement"] == pytest.approx(0.0)
    assert case["gaps"]["combined"] == pytest.approx(0.0)
    assert case["gaps"]["dense:confidence"] == pytest.approx(4.0)  # higher: picks #2
    assert ssp.main(["--from-results", "--results", str(tmp_path)]) == 0
