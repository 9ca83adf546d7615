#!/usr/bin/env python3
"""Readout study on the zoo (METHODS §A2/A3) in the method's setting (issue 18).

    python tools/study_readouts.py --zoo /work/zoo        # measure new runs, print the tables
    python tools/study_readouts.py --from-results         # the tables from docs/studies only

Measure (per complete run of the zoo, trained schedules only): three ``onnxdiag.select_report``
calls over the run's checkpoints, each writing its per-checkpoint readout values to
``docs/studies/readouts/RUN.csv``:

- ``train``: the probe is the run's own training images with the labels it was trained on
  (``RUN/probe_train.npz``: 1,000 images, 15 % of the labels wrong on the tail runs), the
  method's setting; the readouts' ``loss`` here is the training loss;
- ``heldout``: the zoo's ``calib.npz`` (1,000 held-out training images, clean labels), the
  control: its ``loss`` is a validation loss;
- ``train_expected``: the training images with label-free head-gradient targets.

Tables (from the raw results only): the zoo; the selection gap (pp below the best checkpoint
of the run) of the universal setting (hg_feat, K = 5) and of the tuned setting (norm x K
chosen on the other training seeds of the same architecture), mean ± sd over training seeds,
next to last, random and train loss; within-run correlations; across-architecture screening
with bootstrap intervals next to the parameter-count baseline.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_common import (  # noqa: E402
    bootstrap_ci,
    ci_text,
    emit,
    load_runs,
    mean_sd,
    pearson,
    pm,
    read_json,
    read_rows,
    results_arg,
    run_meta,
    spearman,
    study_start,
    table,
    write_json,
    write_rows,
)

READOUTS = ("head_grad_feature", "head_grad", "head_grad_head", "loss", "confidence",
            "entropy", "prob_margin", "logit_margin", "curvature", "weight_norm")
SHORT = {"head_grad_feature": "hg_feat", "head_grad": "hg_raw", "head_grad_head": "hg_head",
         "loss": "loss", "confidence": "conf", "entropy": "entropy", "prob_margin": "p_margin",
         "logit_margin": "l_margin", "curvature": "curv", "weight_norm": "‖W‖"}
DIRECTION = {"head_grad_feature": "lower", "head_grad": "lower", "head_grad_head": "lower",
             "loss": "lower", "confidence": "higher", "entropy": "lower",
             "prob_margin": "higher", "logit_margin": "higher", "curvature": "lower",
             "weight_norm": "higher"}
NORMS = {"raw": "head_grad", "feature": "head_grad_feature", "head": "head_grad_head"}
WINDOWS = (3, 4, 5, 6, 7, "all")
PROBES = ("train", "heldout", "train_expected")
TRAINED = ("tail", "cosine", "noisy")
SUB = "readouts"


# ----------------------------------------------------------------------------------- measure

def measure_run(name: str, m: dict, zoo: Path, results: Path, jobs: int) -> None:
    """The three select_report calls of one run -> results/readouts/RUN.csv."""
    import onnxdiag
    from onnxdiag import ReportTarget, Runtime, SelectOptions

    series = str(m["dir"] / "checkpoints" / "checkpoints.json")
    probes = {"train": (m["dir"] / "probe_train.npz", "auto"),
              "heldout": (zoo / "calib.npz", "auto"),
              "train_expected": (m["dir"] / "probe_train.npz", "expected")}
    rows = []
    for probe, (path, targets) in probes.items():
        t = time.time()
        res = onnxdiag.select_report(
            series, data=str(path), eval_data=str(zoo / "eval.npz") if probe == "train" else None,
            options=SelectOptions(window="all", targets=targets),
            runtime=Runtime(jobs=jobs, progress=False), report=ReportTarget(write=False))
        sec = res.report["selection"]
        if sec["failed"]:
            raise SystemExit(f"{name}: checkpoints failed: {sec['failed']}")
        seconds = time.time() - t
        for i, (ck, rec) in enumerate(zip(sec["checkpoints"], m["checkpoints"], strict=True)):
            vals = ck["result"]["readouts"]["values"]
            row = {"run": name, "probe": probe, "index": i, "epoch": rec["epoch"],
                   "step": rec["step"], "flagged": i in sec["flagged"],
                   "test_acc": rec["test_acc"], "train_acc": rec["train_acc"],
                   "train_loss_noisy": rec.get("train_loss_noisy", rec.get("train_loss")),
                   "ort_acc": (100 * ck["result"]["evaluation"]["accuracy"]
                               if probe == "train" else None),
                   "seconds_per_ckpt": seconds / len(m["checkpoints"])}
            if row["ort_acc"] is not None and abs(row["ort_acc"] - rec["test_acc"]) > 0.051:
                raise SystemExit(f"{name} {rec['path']}: onnxdiag accuracy {row['ort_acc']:.2f}"
                                 f" != manifest {rec['test_acc']}")
            row.update({r: vals.get(r) for r in READOUTS})
            rows.append(row)
        print(f"  {name} {probe}: {len(m['checkpoints'])} ckpts in {seconds:.0f}s",
              file=sys.stderr, flush=True)
    write_rows(results / SUB / f"{name}.csv", rows)
    meta = read_json(results / SUB / "runs.json", {})
    meta[name] = {**run_meta(m), "train_s_per_epoch": m["timing"]["train_s_per_epoch"]}
    write_json(results / SUB / "runs.json", meta)


def measure(zoo: Path, results: Path, names, jobs: int, again: bool) -> None:
    runs = load_runs(zoo, names)
    for name, m in runs.items():
        if m["schedule"] not in TRAINED or not (m["dir"] / "probe_train.npz").is_file():
            continue
        if (results / SUB / f"{name}.csv").is_file() and not again:
            continue
        measure_run(name, m, zoo, results, jobs)


# ------------------------------------------------------------------------------ the series

def load_series(results: Path) -> tuple[dict, dict]:
    """runs.json and {run: {probe: {column: np.array over checkpoints}}}."""
    meta = read_json(results / SUB / "runs.json", {})
    series = {}
    for name in meta:
        rows = read_rows(results / SUB / f"{name}.csv")
        by = {}
        for probe in PROBES:
            rs = sorted((r for r in rows if r["probe"] == probe), key=lambda r: r["index"])
            by[probe] = {k: np.array([np.nan if r[k] is None else float(r[k]) for r in rs])
                         for k in rs[0] if k not in ("run", "probe")}
        series[name] = by
    return meta, series


def pick(values, direction: str, window, flagged) -> int:
    from onnxdiag.selection.series import select_checkpoint

    return select_checkpoint(values, direction, window=window, flagged=flagged)


def gap(s: dict, idx: int) -> float:
    """pp below the best checkpoint of the run (test accuracy of the manifest)."""
    return float(np.nanmax(s["test_acc"]) - s["test_acc"][idx])


def window_of(n: int, window) -> np.ndarray:
    from onnxdiag.selection.series import window_indices

    return window_indices(n, window)


def selector_gap(s: dict, readout: str, window) -> float:
    flagged = s["flagged"].astype(bool)
    return gap(s, pick(s[readout], DIRECTION[readout], window, flagged))


def baseline_gaps(s: dict, window) -> dict:
    """last, random (expected over the window) and the best in the window."""
    idx = window_of(len(s["test_acc"]), window)
    n = len(s["test_acc"])
    return {"last": gap(s, n - 1), "random": float(np.mean([gap(s, i) for i in idx])),
            "oracle_window": float(min(gap(s, i) for i in idx))}


# ---------------------------------------------------------------------------------- tables

def zoo_table(meta: dict, series: dict) -> str:
    groups: dict[tuple, list] = {}
    for n, m in meta.items():
        groups.setdefault((m["schedule"], m["arch"]), []).append(n)
    rows = []
    for (sched, arch), names in sorted(groups.items(), key=lambda kv: _order(*kv[0])):
        best = [meta[n]["best"]["test_acc"] for n in names]
        last = [meta[n]["last"]["test_acc"] for n in names]
        drop = [b - a for b, a in zip(best, last, strict=True)]
        inside = sum(int(np.nanargmax(series[n]["train"]["test_acc"]))
                     >= meta[n]["n_checkpoints"] - 5 for n in names)
        spread = [float(np.ptp(series[n]["train"]["test_acc"][window_of(
            meta[n]["n_checkpoints"], 5)])) for n in names]
        m0 = meta[names[0]]
        rows.append([f"{arch} {sched}", len(names), f"{m0['n_parameters']:,}",
                     m0["n_checkpoints"], f"{m0['n_train']:,} / {100 * m0['noise']:.0f} %",
                     pm(best, n=False), pm(last, n=False), pm(drop, n=False),
                     f"{inside}/{len(names)}", pm(spread, n=False)])
    return ("**The zoo** (mean ± sd over training seeds; top-1 % on eval.npz, 2,000 test "
            "images)\n\n" + table(["runs", "seeds", "params", "ckpts", "train images / noise",
                                   "best %", "last %", "best − last pp",
                                   "best inside the last 5", "range in the last 5 pp"], rows))


def _order(sched: str, arch: str):
    from study_common import ARCH_ORDER

    return (TRAINED.index(sched) if sched in TRAINED else 9,
            ARCH_ORDER.index(arch) if arch in ARCH_ORDER else 9)


def arch_groups(meta: dict, schedule: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n, m in sorted(meta.items(), key=lambda kv: (_order(kv[1]["schedule"], kv[1]["arch"]),
                                                     kv[1]["seed"])):
        if m["schedule"] == schedule:
            out.setdefault(m["arch"], []).append(n)
    return out


def gap_table(meta: dict, series: dict, schedule: str, probe: str, window=5) -> str:
    """Universal setting: each readout at K = window, mean ± sd over seeds per architecture."""
    groups = arch_groups(meta, schedule)
    cols = ["head_grad_feature", "head_grad", "head_grad_head", "loss", "logit_margin",
            "confidence", "entropy", "curvature"]
    rows = []
    all_names = [n for ns in groups.values() for n in ns]
    for label, names in [*groups.items(), ("all", all_names)]:
        ss = [series[n][probe] for n in names]
        base = [baseline_gaps(s, window) for s in ss]
        rows.append([label, len(names),
                     *[pm([selector_gap(s, r, window) for s in ss], n=False) for r in cols],
                     *[pm([b[k] for b in base], n=False)
                       for k in ("last", "random", "oracle_window")]])
    loss_name = {"train": "loss = train loss", "heldout": "loss = validation loss",
                 "train_expected": "loss = train loss"}[probe]
    return (f"**Selection gap, pp below the run's best checkpoint** ({schedule} runs, probe "
            f"`{probe}`, K = {window}; mean ± sd over training seeds, n = seeds column; "
            f"{loss_name}; random = expected gap of a uniform pick in the window)\n\n"
            + table(["arch", "seeds", *[SHORT[c] for c in cols], "last", "random",
                     "best in window"], rows))


def paired_table(meta: dict, series: dict, schedule: str, probe: str, window=5) -> str:
    """Each selector's gap minus a baseline's, paired by run: mean with a 95 % bootstrap
    interval over the runs, and wins / ties / losses."""
    names = [n for ns in arch_groups(meta, schedule).values() for n in ns]
    ss = [series[n][probe] for n in names]
    base = {"last": [baseline_gaps(s, window)["last"] for s in ss],
            "random": [baseline_gaps(s, window)["random"] for s in ss],
            "train loss": [selector_gap(series[n]["train"], "loss", window) for n in names]}
    rows = []
    for r in ("head_grad_feature", "head_grad", "head_grad_head", "loss", "logit_margin"):
        g = np.array([selector_gap(s, r, window) for s in ss])
        row = [SHORT[r], pm(g, n=False)]
        for b in base.values():
            d = g - np.array(b)
            lo, hi = bootstrap_ci(len(d), lambda i, d=d: float(d[i].mean()), seed=4)
            row.append(f"{d.mean():+.2f} [{lo:+.2f}, {hi:+.2f}] "
                       f"({int((d < 0).sum())}/{int((d == 0).sum())}/{int((d > 0).sum())})")
        rows.append(row)
    return (f"**Paired by run: a readout's gap minus a baseline's** ({schedule} runs, probe "
            f"`{probe}`, K = {window}, n = {len(names)} runs of all architectures): mean pp "
            f"[95 % bootstrap interval over runs] (runs where the readout is better / equal / "
            f"worse); negative = the readout picks better. Train loss = the `loss` readout on "
            f"the training probe\n\n"
            + table(["readout", "gap pp", *[f"− {b}" for b in base]], rows))


def tuned(meta: dict, series: dict, schedule: str, probe: str) -> tuple[str, dict]:
    """Leave-one-seed-out per architecture: norm x K tuned on the other seeds."""
    groups = arch_groups(meta, schedule)
    grid = [(nm, k) for nm in NORMS for k in WINDOWS]
    rows, gaps_all, uni_all = [], [], []
    for arch, names in groups.items():
        cost = {n: {g: selector_gap(series[n][probe], NORMS[g[0]], g[1]) for g in grid}
                for n in names}
        gaps, chosen = [], []
        for held in names:
            others = [n for n in names if n != held] or [held]
            best = min(grid, key=lambda g: (np.mean([cost[o][g] for o in others]),
                                            grid.index(g)))
            gaps.append(cost[held][best])
            chosen.append(f"{best[0]}/{best[1]}")
        uni = [cost[n][("feature", 5)] for n in names]
        gaps_all += gaps
        uni_all += uni
        rows.append([arch, len(names), pm(uni, n=False), pm(gaps, n=False),
                     ", ".join(chosen)])
    rows.append(["all", len(gaps_all), pm(uni_all, n=False), pm(gaps_all, n=False), ""])
    txt = (f"**Universal vs tuned selection** ({schedule} runs, probe `{probe}`; gap in pp "
           f"below the run's best, mean ± sd over training seeds). Tuned: for each held-out "
           f"seed, the head-gradient norm (raw / feature / head) and window K ∈ "
           f"{{{', '.join(map(str, WINDOWS))}}} with the lowest mean gap on the other seeds "
           f"of the same architecture, applied to the held-out seed (chosen settings listed "
           f"in seed order)\n\n"
           + table(["arch", "seeds", "universal (hg_feat, K = 5)", "tuned (leave one seed out)",
                    "chosen norm/K"], rows))
    return txt, {"universal": uni_all, "tuned": gaps_all}


def correlation_table(meta: dict, series: dict, schedule: str, probe: str) -> str:
    groups = arch_groups(meta, schedule)
    rows = []
    for r in READOUTS:
        row = [SHORT[r]]
        for names in groups.values():
            vals = []
            for n in names:
                s = series[n][probe]
                ok = ~s["flagged"].astype(bool)
                vals.append(spearman(s[r][ok], s["test_acc"][ok]))
            row.append(pm(vals, n=False))
        rows.append(row)
    n_txt = ", ".join(f"{a} {len(v)}" for a, v in groups.items())
    return (f"**Spearman ρ of each readout vs top-1 across a run's checkpoints** ({schedule} "
            f"runs, probe `{probe}`, checkpoints flagged degenerate left out; mean ± sd over "
            f"training seeds: {n_txt})\n\n" + table(["readout", *groups], rows))


def screening_models(meta: dict, series: dict, probe: str, schedule=None) -> list[dict]:
    """The last checkpoint of every trained run (one model per run; ``schedule``: only
    those runs)."""
    out = []
    for n, m in meta.items():
        if schedule and m["schedule"] != schedule:
            continue
        s = series[n][probe]
        out.append({"run": n, "arch": m["arch"], "acc": s["test_acc"][-1],
                    "n_params": m["n_parameters"], **{r: s[r][-1] for r in READOUTS}})
    return out


def screening_table(meta: dict, series: dict, probe: str, schedule=None) -> str:
    models = screening_models(meta, series, probe, schedule)
    acc = np.array([x["acc"] for x in models])
    params = np.array([x["n_params"] for x in models], float)
    rows = []
    for r in READOUTS:
        v = np.array([x[r] for x in models], float)
        sp = spearman(v, acc)
        lo, hi = bootstrap_ci(len(models), lambda i, v=v: spearman(v[i], acc[i]), seed=1)
        pr = pearson(v, acc)
        plo, phi = bootstrap_ci(len(models), lambda i, v=v: pearson(v[i], acc[i]), seed=2)
        rows.append([SHORT[r], DIRECTION[r], ci_text(sp, lo, hi), ci_text(pr, plo, phi)])
    bp = spearman(params, acc)
    blo, bhi = bootstrap_ci(len(models), lambda i: spearman(params[i], acc[i]), seed=3)
    rows.append(["params (baseline)", "higher", ci_text(bp, blo, bhi), "–"])
    archs = sorted({x["arch"] for x in models})
    which = f"{schedule} schedule only" if schedule else "tail and cosine schedules"
    return (f"**Screening across architectures** (probe `{probe}`): the last checkpoint of "
            f"each of {len(models)} runs ({', '.join(archs)}; {which}) ranked "
            f"together; ρ / r vs top-1 with 95 % bootstrap intervals over models ({2000} "
            f"resamples of the {len(models)} models)\n\n"
            + table(["readout", "better", "Spearman ρ [95 % CI]", "Pearson r [95 % CI]"], rows))


def cost_line(meta: dict, series: dict) -> str:
    ratios = []
    for n, m in meta.items():
        per_epoch = m.get("train_s_per_epoch")
        sec = series[n]["train"]["seconds_per_ckpt"]
        if per_epoch:
            ratios.append(100 * float(np.nanmean(sec)) / per_epoch)
    mu, sd, k = mean_sd(ratios)
    return (f"Probe cost (wall time of one checkpoint's readouts on 1,000 images, with the "
            f"2,000-image accuracy evaluation, over one training epoch's wall time; both on "
            f"the shared 2-core machine): {mu:.0f} ± {sd:.0f} % of an epoch (n = {k} runs). "
            f"Published: < 0.1 % of an ImageNet epoch.")


def tables(results: Path, only: str | None = None) -> list[str]:
    """Every table, in order, from the raw results (``only``: comma list of keys among
    zoo, gap, paired, tuned, corr, screen, cost)."""
    meta, series = load_series(results)
    if not meta:
        raise SystemExit(f"error: no raw results in {results / SUB}; measure with --zoo first")
    keys = set(only.split(",")) if only else None
    parts = []

    def add(key, make):
        if keys is None or key in keys:
            parts.append(make())

    add("zoo", lambda: zoo_table(meta, series))
    for sched in ("tail", "cosine"):
        if not arch_groups(meta, sched):
            continue
        for probe in PROBES:
            add("gap", lambda sched=sched, probe=probe: gap_table(meta, series, sched, probe))
        for probe in ("train", "heldout"):
            add("paired", lambda sched=sched, probe=probe: paired_table(meta, series, sched,
                                                                        probe))
        for probe in ("train", "heldout"):
            add("tuned", lambda sched=sched, probe=probe: tuned(meta, series, sched, probe)[0])
        add("corr", lambda sched=sched: correlation_table(meta, series, sched, "train"))
    for schedule in (None, "cosine"):
        for probe in ("heldout", "train"):
            add("screen", lambda probe=probe, schedule=schedule: screening_table(
                meta, series, probe, schedule))
    add("cost", lambda: cost_line(meta, series))
    return parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zoo", type=Path, default=Path("/work/zoo"))
    p.add_argument("--runs", default=None, help="comma-separated run names (default: all done)")
    p.add_argument("--jobs", type=int, default=1, help="onnxdiag worker processes")
    p.add_argument("--again", action="store_true", help="re-measure runs already in --results")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    results_arg(p)
    a = p.parse_args(argv)
    if a.from_results:
        return emit(tables(a.results, a.tables), a.out)
    measure(a.zoo, a.results, a.runs.split(",") if a.runs else None, a.jobs, a.again)
    parts = study_start("study_readouts.py", "Readouts: selection and screening", a.zoo, argv,
                        load_runs(a.zoo), only="-")
    return emit(parts + tables(a.results), a.out)


if __name__ == "__main__":
    sys.exit(main())
