#!/usr/bin/env python3
"""Aggregate `onnxdiag prune-sweep` reports over seeds into the RESULTS.md tables (issue 6).

    python benchmarks/bench_prune_sweep.py SWEEP_DIR [SWEEP_DIR ...]

Each SWEEP_DIR is a prune-sweep report folder (report.json), one per --seed, all with the
same ratios and scores. Prints, per score, the top-1 accuracy (%) at each kept-channel
fraction before / after recovery (mean over the reports), the normalised AUC before and
after (mean ± sd over the reports), and per report the best local-axis (ix, peer) minus
best target-axis (relevance) AUC in points. "After" is whatever recovery the sweeps
applied (--recalibrate-bn and/or --finetune; the report's "recovery").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    folders = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not folders:
        print(__doc__)
        return 2
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
