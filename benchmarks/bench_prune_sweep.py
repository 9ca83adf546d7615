#!/usr/bin/env python3
"""Aggregate `onnxdiag prune-sweep` reports over seeds into the RESULTS.md tables (issue 6).

    python benchmarks/bench_prune_sweep.py SWEEP_DIR [SWEEP_DIR ...]
    python benchmarks/bench_prune_sweep.py --smoke   # two tiny sweeps made here, seconds

Each SWEEP_DIR is a prune-sweep report folder (report.json), one per --seed, all with the
same ratios and scores. Prints, per score, the top-1 accuracy (%) at each kept-channel
fraction before / after recovery (mean over the reports), the normalised AUC before and
after (mean ± sd over the reports), and per report the best local-axis (ix, peer) minus
best target-axis (relevance) AUC in points. "After" is whatever recovery the sweeps
applied (--recalibrate-bn and/or --finetune; the report's "recovery").

``--smoke`` first runs two tiny sweeps of the bundled sample through the Python API (seeds
0 and 1; 256 calibration / 300 evaluation images, ratios 0.25 and 0.5, scores magnitude,
ix and relevance, BN recalibration as the recovery) into a temporary folder and aggregates
those. Consistency checks (every run): each report's AUCs equal the trapezoid area under
its own accuracy rows (recomputed here), and the FLOPs are identical for every score.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import SAMPLE, check  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["--smoke"], ["-h"], ["--help"], []):
        if argv != ["--smoke"]:
            print(__doc__)
            return 0 if argv else 2
        with tempfile.TemporaryDirectory(prefix="bench-prune-sweep-") as tmp:
            return aggregate(smoke_sweeps(Path(tmp)))
    return aggregate([Path(p) for p in argv])


def smoke_sweeps(folder: Path) -> list[Path]:
    """Two tiny prune-sweep reports of the bundled sample (seeds 0, 1) under ``folder``."""
    from onnxdiag import (
        DataRequest,
        PruneSweepOptions,
        Recovery,
        ReportTarget,
        Runtime,
        prune_sweep_report,
    )

    out = []
    for seed in (0, 1):
        out.append(folder / f"sweep_s{seed}")
        prune_sweep_report(
            str(SAMPLE / "model.onnx"), data=DataRequest(str(SAMPLE / "calib.npz"), limit=256),
            eval_data=DataRequest(str(SAMPLE / "eval.npz"), limit=300),
            options=PruneSweepOptions(ratios=(0.25, 0.5), scores=("magnitude", "ix",
                                                                   "relevance"), seed=seed),
            recovery=Recovery(recalibrate_bn=True), runtime=Runtime(progress=False),
            report=ReportTarget(out=out[-1]))
    return out


def trapezoid_auc(rows: list, key: str, top: float) -> float:
    """Area under accuracy(kept fraction) with the dense point (1.0, top), over top × the
    kept range: the report's normalised AUC, recomputed."""
    pts = sorted([(1.0, top)] + [(r["kept_fraction"], r[key]) for r in rows])
    area = sum((k1 - k0) * (a0 + a1) / 2 for (k0, a0), (k1, a1) in zip(pts, pts[1:]))
    return area / (top * (pts[-1][0] - pts[0][0]))


def aggregate(folders: list[Path]) -> int:
    sweeps = [json.loads((f / "report.json").read_text())["prune_sweep"] for f in folders]
    scores = list(sweeps[0]["auc"])
    ratios = sorted({r["ratio"] for r in sweeps[0]["rows"]})
    recovery = sweeps[0].get("recovery") or ("fine-tuning" if sweeps[0]["finetune"] else None)
    fin = bool(recovery)
    dense = sweeps[0]["dense_accuracy"]
    top = [s.get("dense_accuracy_after_recovery") for s in sweeps]
    print(f"{len(sweeps)} report(s); dense top-1 {100 * dense:.1f} %"
          + ("" if top[0] is None else f", dense after the same {recovery} "
             + ", ".join(f"{100 * t:.1f}" for t in top) + " %"))
    head = "| score | " + " | ".join(f"kept {1 - r:.2f}" for r in ratios) + \
        " | AUC before | AUC after |"
    print(head)
    print("|---" * (len(ratios) + 3) + "|")
    for sc in scores:
        cells = []
        for r in ratios:
            rows = [x for s in sweeps for x in s["rows"] if x["score"] == sc and x["ratio"] == r]
            before = np.mean([x["accuracy_before"] for x in rows])
            cell = f"{100 * before:.1f}"
            if fin:
                cell += f" / {100 * np.mean([x['accuracy_after'] for x in rows]):.1f}"
            cells.append(cell)
        auc_b = [s["auc"][sc]["before"] for s in sweeps]
        auc_a = [s["auc"][sc].get("after") for s in sweeps] if fin else []
        fmt = lambda v: f"{np.mean(v):.3f} ± {np.std(v, ddof=1):.3f}" if len(v) > 1 \
            else f"{v[0]:.3f}"  # noqa: E731
        print(f"| {sc} | " + " | ".join(cells) + f" | {fmt(auc_b)} | "
              + (fmt(auc_a) if fin else "-") + " |")
    for phase in ("before", "after") if fin else ("before",):
        diffs = [s["local_vs_target"][phase] for s in sweeps if phase in s["local_vs_target"]]
        print(f"{phase} recovery, best local-axis minus best target-axis AUC (pp) per report: "
              + ", ".join(f"{d['local_minus_target_pp']:+.1f} ({d['best_local']})"
                          for d in diffs))
    flops = sweeps[0]["flops_matched"]
    print("FLOPs ratio per kept fraction (identical for every score: "
          f"{all(v['matched'] for s in sweeps for v in s['flops_matched'].values())}): "
          + ", ".join(f"{1 - float(r):.2f}: {v['flops_ratio_min']:.3f}" for r, v in flops.items()))
    check_aucs(sweeps, scores, fin)
    check(all(v["matched"] for s in sweeps for v in s["flops_matched"].values()),
          "FLOPs identical for every score at each kept fraction")
    return 0


def check_aucs(sweeps: list, scores: list, fin: bool) -> None:
    worst = 0.0
    for s in sweeps:
        dense = s["dense_accuracy"]
        after_top = s.get("dense_accuracy_after_recovery") or dense
        for sc in scores:
            rows = [r for r in s["rows"] if r["score"] == sc]
            for phase, key, top in (("before", "accuracy_before", dense),
                                    ("after", "accuracy_after", after_top))[:1 + fin]:
                reported = s["auc"][sc].get(phase)
                if reported is not None:
                    worst = max(worst, abs(reported - trapezoid_auc(rows, key, top)))
    check(worst < 1e-9, f"every AUC = the trapezoid area under its report's accuracy rows "
                        f"(max difference {worst:.1e})")


if __name__ == "__main__":
    sys.exit(main())
