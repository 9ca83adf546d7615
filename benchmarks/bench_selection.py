"""Checkpoint selection on the bundled series over disjoint probe batches (issue 3).

Splits the probe set (default: the sample's 1,000 held-out calibration images) into K
disjoint batches (seeded permutation), runs ``onnxdiag select`` on each through the public
API, and prints a Markdown table: per readout the Pearson/Spearman correlation with test
accuracy over all checkpoints and without the initial one (mean ± sd over batches), the
checkpoint each batch picks, and the selection gap (window and whole series), next to the
"last checkpoint" and "random checkpoint" baselines.

    python benchmarks/bench_selection.py --batches 4 --targets labels expected
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from onnxdiag.commands.select import select_report
from onnxdiag.selection.series import correlate_series

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "models" / "sample"
SHOWN = ["head_grad", "head_grad_feature", "head_grad_head", "loss", "logit_margin",
         "confidence", "entropy", "prob_margin", "curvature", "weight_norm"]


def split_probe(path: Path, k: int, seed: int, folder: Path) -> list[Path]:
    """Write K disjoint, equally sized, seeded subsets of an .npz probe set."""
    data = np.load(path)
    n = len(data["labels"])
    order = np.random.default_rng(seed).permutation(n)
    size = n // k
    out = []
    for b in range(k):
        idx = np.sort(order[b * size:(b + 1) * size])
        p = folder / f"probe_{b}.npz"
        np.savez(p, **{key: data[key][idx] for key in data.files})
        out.append(p)
    return out


def run_batch(probe: Path, targets: str, window, args) -> dict:
    res = select_report(args.checkpoints, data=str(probe), eval_data=args.eval_data,
                        targets=targets, window=window, write=False, progress=False,
                        jobs=args.jobs)
    sel = res.report["selection"]
    values = {n: np.array([c["result"]["readouts"]["values"].get(n, np.nan)
                           for c in sel["checkpoints"]]) for n in SHOWN}
    acc = np.asarray(sel["accuracy"])
    ev = sel["evaluation"]
    rows = {}
    for n in SHOWN:
        r_all = correlate_series(values[n], acc)
        r_wo = correlate_series(values[n][1:], acc[1:])
        pick = ev["readouts"][n].get("selected") if n in ev["readouts"] else None
        rows[n] = dict(r_all=r_all.pearson, rho_all=r_all.spearman, r_wo=r_wo.pearson,
                       rho_wo=r_wo.spearman,
                       pick=None if pick is None else pick["index"],
                       gap_w=None if pick is None else pick["gap_window_pp"],
                       gap_o=None if pick is None else pick["gap_overall_pp"],
                       wrong=ev["readouts"].get(n, {}).get("wrong_sign", False))
    base = {k: ev[k] for k in ("last", "random", "oracle_window", "oracle_overall")}
    return dict(rows=rows, base=base, flagged=sel["flagged"], acc=acc)


def ms(xs) -> str:
    xs = np.array([np.nan if x is None else x for x in xs], float)
    if np.isnan(xs).all():
        return "–"
    return f"{np.nanmean(xs):+.2f} ± {np.nanstd(xs):.2f}"


def gap(xs) -> str:
    xs = np.array([np.nan if x is None else x for x in xs], float)
    if np.isnan(xs).all():
        return "–"
    return f"{np.nanmean(xs):.1f} ± {np.nanstd(xs):.1f}"


def table(runs: list[dict], runs_all: list[dict], label: str) -> str:
    lines = [f"Targets: `{label}`; {len(runs)} disjoint probe batches. Correlations are over the "
             "16 checkpoints (all) and without ckpt_000 (w/o init); picks and gaps use "
             "window 5 (ckpt_011–015) and the whole series.", "",
             "| readout | Pearson r (all) | Spearman ρ (all) | Pearson r (w/o init) | "
             "Spearman ρ (w/o init) | picks (window 5) | gap window 5 (pp) | "
             "picks (all) | gap vs best overall, window all (pp) |",
             "|---|---:|---:|---:|---:|---|---:|---|---:|"]
    for n in SHOWN:
        rs = [r["rows"][n] for r in runs]
        ra = [r["rows"][n] for r in runs_all]
        picks = ",".join("–" if x["pick"] is None else str(x["pick"]) for x in rs)
        picks_a = ",".join("–" if x["pick"] is None else str(x["pick"]) for x in ra)
        flag = " ⚠ wrong sign" if any(x["wrong"] for x in rs) else ""
        lines.append(f"| {n}{flag} | {ms(x['r_all'] for x in rs)} | "
                     f"{ms(x['rho_all'] for x in rs)} | {ms(x['r_wo'] for x in rs)} | "
                     f"{ms(x['rho_wo'] for x in rs)} | {picks} | "
                     f"{gap(x['gap_w'] for x in rs)} | {picks_a} | "
                     f"{gap(x['gap_o'] for x in ra)} |")
    b = runs[0]["base"]
    ba = runs_all[0]["base"]
    lines += ["", "Baselines (same for every probe batch): last checkpoint "
              f"(#{b['last']['index']}) "
              f"gap {b['last']['gap_window_pp']:.1f} pp in window 5 "
              f"({ba['last']['gap_overall_pp']:.1f} pp vs the best overall); random checkpoint "
              f"(expected) {b['random']['gap_window_pp']:.1f} pp in window 5, "
              f"{ba['random']['gap_overall_pp']:.1f} pp over the whole series; oracle in window "
              f"#{b['oracle_window']['index']} ({100 * b['oracle_window']['accuracy']:.2f} %), "
              f"overall #{b['oracle_overall']['index']} "
              f"({100 * b['oracle_overall']['accuracy']:.2f} %). Flagged as degenerate: "
              f"{sorted({i for r in runs for i in r['flagged']})}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", default=str(SAMPLE / "checkpoints" / "checkpoints.json"))
    ap.add_argument("--probe", default=str(SAMPLE / "calib.npz"))
    ap.add_argument("--eval-data", default=str(SAMPLE / "eval.npz"))
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--targets", nargs="+", default=["labels", "expected"])
    args = ap.parse_args(argv)
    if args.batches < 3:
        ap.error("--batches must be at least 3")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        probes = split_probe(Path(args.probe), args.batches, args.seed, Path(tmp))
        for targets in args.targets:
            runs = [run_batch(p, targets, 5, args) for p in probes]
            runs_all = [run_batch(p, targets, "all", args) for p in probes]
            print(table(runs, runs_all, targets))
            print()
    print(f"({args.batches} batches × {len(args.targets)} target kinds × 2 windows in "
          f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
