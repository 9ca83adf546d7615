"""Checkpoint selection on the bundled series over disjoint probe batches (issue 3).

Splits the probe set (default: the sample's 1,000 held-out calibration images) into K
disjoint batches (seeded permutation), runs ``onnxdiag select`` on each through the public
API, and prints a Markdown table: per readout the Pearson/Spearman correlation with test
accuracy over all checkpoints and without the initial one (mean ± sd over batches), the
checkpoint each batch picks, and the selection gap (window and whole series), next to the
"last checkpoint" and "random checkpoint" baselines.

    python benchmarks/bench_selection.py --batches 4 --targets labels expected
    python benchmarks/bench_selection.py --smoke   # 9 checkpoints, 3 batches of 32, seconds

Consistency checks (every run): on each probe batch the readouts of every checkpoint are
the same for window 5 and window all (only the choice differs), and the accuracies and
baselines are the same for every probe batch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import SAMPLE, check  # noqa: E402
from onnxdiag import DataRequest, ReportTarget, Runtime, SelectOptions  # noqa: E402
from onnxdiag.commands.select import select_report  # noqa: E402
from onnxdiag.selection.series import correlate_series  # noqa: E402

SHOWN = ["head_grad", "head_grad_feature", "head_grad_head", "loss", "logit_margin",
         "confidence", "entropy", "prob_margin", "curvature", "weight_norm"]


def split_probe(path: Path, k: int, seed: int, folder: Path,
                n_used: int | None = None) -> list[Path]:
    """Write K disjoint, equally sized, seeded subsets of an .npz probe set (of its first
    ``n_used`` images of a seeded permutation when given)."""
    data = np.load(path)
    n = len(data["labels"])
    order = np.random.default_rng(seed).permutation(n)
    size = min(n, n_used or n) // k
    out = []
    for b in range(k):
        idx = np.sort(order[b * size:(b + 1) * size])
        p = folder / f"probe_{b}.npz"
        np.savez(p, **{key: data[key][idx] for key in data.files})
        out.append(p)
    return out


def run_batch(probe: Path, targets: str, window, args) -> dict:
    res = select_report(args.checkpoints, data=str(probe),
                        eval_data=DataRequest(args.eval_data, limit=args.eval_limit),
                        options=SelectOptions(targets=targets, window=window),
                        runtime=Runtime(jobs=args.jobs, progress=False),
                        report=ReportTarget(write=False))
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
    names = [Path(p).stem for p in sel["paths"]]
    window_names = [names[i] for i in ev["window_indices"]]
    return dict(rows=rows, base=base, flagged=sel["flagged"], acc=acc, values=values,
                names=names, window=f"{window_names[0]}–{window_names[-1][-3:]}")


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
    names = runs[0]["names"]
    lines = [f"Targets: `{label}`; {len(runs)} disjoint probe batches. Correlations are over the "
             f"{len(names)} checkpoints (all) and without {names[0]} (w/o init); picks and gaps "
             f"use window 5 ({runs[0]['window']}) and the whole series.", "",
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
    ap.add_argument("--probe-n", type=int, default=None,
                    help="split only this many probe images (default: all)")
    ap.add_argument("--eval-limit", type=int, default=None,
                    help="evaluation images (a seeded subset; default: all)")
    ap.add_argument("--smoke", action="store_true",
                    help="9 of the 16 checkpoints, 3 batches of 32 probe images, 100 "
                         "evaluation images, in-process")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.probe_n, args.eval_limit, args.jobs = 3, 96, 100, 1
        args.checkpoints = [str(SAMPLE / "checkpoints" / f"ckpt_{i:03d}.onnx")
                            for i in (0, 3, 6, 9, 11, 12, 13, 14, 15)]
    if args.batches < 3:
        ap.error("--batches must be at least 3")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        probes = split_probe(Path(args.probe), args.batches, args.seed, Path(tmp), args.probe_n)
        for targets in args.targets:
            runs = [run_batch(p, targets, 5, args) for p in probes]
            runs_all = [run_batch(p, targets, "all", args) for p in probes]
            print(table(runs, runs_all, targets))
            print()
            consistency(runs, runs_all, targets)
    print(f"({args.batches} batches × {len(args.targets)} target kinds × 2 windows in "
          f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


def consistency(runs: list[dict], runs_all: list[dict], targets: str) -> None:
    same_values = all(np.array_equal(a["values"][n], b["values"][n], equal_nan=True)
                      for a, b in zip(runs, runs_all) for n in SHOWN)
    check(same_values, f"targets {targets}: every checkpoint's readouts are the same for "
                       "window 5 and window all on each probe batch")
    first = runs[0]
    same_base = all(np.array_equal(r["acc"], first["acc"]) and r["base"] == first["base"]
                    for r in runs[1:]) and all(r["base"] == runs_all[0]["base"]
                                               for r in runs_all[1:])
    check(same_base, f"targets {targets}: accuracies and baselines are the same for every "
                     "probe batch")


if __name__ == "__main__":
    sys.exit(main())
