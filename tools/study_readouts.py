#!/usr/bin/env python3
"""Readout study on the zoo (METHODS §A2/A3): one command, Markdown tables on stdout.

    python tools/study_readouts.py --zoo /work/zoo > readouts.md

Per run (every checkpoint of a tools/train_zoo.py run, probe = the zoo's calib.npz, accuracy =
its eval.npz) through ``onnxdiag.select_report(..., report=ReportTarget(write=False))``, the
API of ``onnxdiag select``:

1. Spearman rho and Pearson r of every readout vs top-1 accuracy across the run's checkpoints;
2. the selection gap (pp below the best checkpoint in the tail window, K = 5, and below the best
   overall) of each readout's pick, next to the "last checkpoint" and "random checkpoint"
   baselines;

and screening: the final and the best checkpoint of every run ranked together (one
``select_report`` call over checkpoints of different architectures, which onnxdiag treats as a
zoo), Spearman / Kendall of each readout vs accuracy next to the parameter-count baseline.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_common import (  # noqa: E402
    ckpt_paths,
    emit,
    load_runs,
    study_start,
    table,
)

SELECT_READOUTS = ("head_grad_feature", "head_grad", "head_grad_head", "loss", "confidence",
                   "entropy", "prob_margin", "logit_margin", "curvature")
SHORT = {"head_grad_feature": "hg_feat", "head_grad": "hg_raw", "head_grad_head": "hg_head",
         "loss": "loss", "confidence": "conf", "entropy": "entropy", "prob_margin": "p_margin",
         "logit_margin": "l_margin", "curvature": "curv", "weight_norm": "‖W‖"}


def per_run(runs: dict, zoo: Path, window: int, jobs: int | None, targets: str) -> dict:
    import onnxdiag
    from onnxdiag import ReportTarget, Runtime, SelectOptions

    out = {}
    for name, m in runs.items():
        t = time.time()
        res = onnxdiag.select_report(str(m["dir"] / "checkpoints" / "checkpoints.json"),
                                     data=str(zoo / "calib.npz"), eval_data=str(zoo / "eval.npz"),
                                     options=SelectOptions(window=window, targets=targets),
                                     runtime=Runtime(jobs=jobs, progress=False),
                                     report=ReportTarget(write=False))
        sec = res.report["selection"]
        # the accuracies onnxdiag measured through ONNX Runtime must be the manifest's (torch)
        for acc, rec in zip(sec["accuracy"], m["checkpoints"], strict=True):
            if abs(100 * acc - rec["test_acc"]) > 0.051:
                raise SystemExit(f"{name} {rec['path']}: onnxdiag accuracy {100 * acc:.2f} != "
                                 f"manifest {rec['test_acc']}")
        out[name] = sec
        print(f"  scored {name}: {sec['n_scored']} checkpoints in {time.time() - t:.0f}s",
              file=sys.stderr, flush=True)
    return out


def correlation_tables(runs: dict, secs: dict) -> str:
    names = list(runs)
    blocks = []
    for stat in ("spearman", "pearson"):
        rows = []
        for r in (*SELECT_READOUTS, "weight_norm"):
            row = [SHORT[r]]
            for n in names:
                ev = secs[n]["evaluation"]["readouts"].get(r)
                row.append(None if ev is None else ev["vs_accuracy"][stat])
            rows.append(row)
        blocks.append(f"**{stat.capitalize()} of each readout vs top-1 across a run's "
                      f"checkpoints** (sign expected: negative for hg_*, loss, entropy, curv; "
                      f"positive for conf, p_margin, l_margin)\n\n"
                      + table(["readout", *names], rows))
    return "\n\n".join(blocks)


def gap_table(runs: dict, secs: dict, window: int) -> str:
    rows = []
    for n, m in runs.items():
        ev = secs[n]["evaluation"]
        row = [n, len(m["checkpoints"]), f"{m['results']['best']['test_acc']:.2f}",
               f"{m['results']['last']['test_acc']:.2f}",
               f"{100 * ev['oracle_window']['accuracy']:.2f}"]
        for r in SELECT_READOUTS:
            sel = ev["readouts"][r].get("selected") or {}
            row.append(_gap(sel))
        row += [_gap(ev["last"]), _gap(ev["random"])]
        rows.append(row)
    header = ["run", "ckpts", "best %", "last %", "best in window %",
              *[SHORT[r] for r in SELECT_READOUTS], "last", "random"]
    return (f"**Selection gap in pp (tail window K = {window}): below the best checkpoint in the "
            f"window / below the best overall**\n\n" + table(header, rows))


def _gap(sel: dict) -> str:
    if not sel or sel.get("gap_window_pp") is None:
        return "–"
    return f"{sel['gap_window_pp']:.2f} / {sel['gap_overall_pp']:.2f}"


def screening(runs: dict, zoo: Path, jobs: int | None, targets: str) -> tuple[str, list[str]]:
    import onnxdiag
    from onnxdiag import ReportTarget, Runtime, SelectOptions

    paths, labels = [], []
    for n, m in runs.items():
        for which in ("best", "last"):
            p = m["dir"] / "checkpoints" / m["results"][which]["path"]
            if str(p) not in paths:
                paths.append(str(p))
                labels.append(f"{n}:{which}")
    res = onnxdiag.select_report(paths, data=str(zoo / "calib.npz"),
                                 eval_data=str(zoo / "eval.npz"),
                                 options=SelectOptions(targets=targets),
                                 runtime=Runtime(jobs=jobs, progress=False),
                                 report=ReportTarget(write=False))
    sec = res.report["selection"]
    if not sec.get("zoo"):
        raise SystemExit("select_report did not treat the screening set as a zoo")
    rows = [[SHORT.get(r, r), s["direction"], s["spearman"], s["kendall"], s["pearson"],
             s["baseline_spearman"], s["baseline_kendall"], "WRONG" if s["wrong_sign"] else "ok"]
            for r, s in sec["screening"].items()]
    txt = (f"**Screening: {len(paths)} models (the best and the last checkpoint of each run; one "
           f"when they coincide) ranked together**\n\n"
           + table(["readout", "better", "spearman", "kendall", "pearson", "params spearman",
                    "params kendall", "sign"], rows))
    accs = "; ".join(f"{lab} {100 * a:.2f}" for lab, a in zip(labels, sec["accuracy"],
                                                                strict=True))
    return txt + f"\n\nmodels (top-1 %): {accs}", labels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zoo", type=Path, default=Path("/work/zoo"))
    p.add_argument("--runs", default=None, help="comma-separated run names (default: all done)")
    p.add_argument("--window", default="5", help="tail window K, or 'all'")
    p.add_argument("--targets", default="auto",
                   help="head-gradient targets (onnxdiag select --targets): auto = the probe's "
                        "labels; expected = label-free")
    p.add_argument("--jobs", type=int, default=None, help="onnxdiag worker processes")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    a = p.parse_args(argv)
    window = a.window if a.window == "all" else int(a.window)
    runs = load_runs(a.zoo, a.runs.split(",") if a.runs else None)
    if not runs:
        raise SystemExit(f"error: no complete run in {a.zoo}; train with tools/train_zoo.py")
    parts = study_start("study_readouts.py", "Readouts: correlation with accuracy, selection, "
                        "screening", a.zoo, argv, runs)
    parts.append("runs: " + "; ".join(
        f"{n} ({m['arch']}, {m['schedule']}, seed {m['seed']}, {m['n_parameters']:,} params, "
        f"{len(ckpt_paths(m))} ckpts)" for n, m in runs.items()))
    parts.append(f"probe: {a.zoo / 'calib.npz'} (1,000 held-out training images), head-gradient "
                 f"targets: {a.targets}; accuracy: {a.zoo / 'eval.npz'} (2,000 test images)")
    secs = per_run(runs, a.zoo, window, a.jobs, a.targets)
    parts += [correlation_tables(runs, secs), gap_table(runs, secs, window)]
    if len({m["arch"] for m in runs.values()}) > 1:
        parts.append(screening(runs, a.zoo, a.jobs, a.targets)[0])
    else:
        parts.append("screening: not run (needs runs of at least two architectures)")
    return emit(parts, a.out)


if __name__ == "__main__":
    sys.exit(main())
