"""Study 5: which checkpoint to keep when it will be pruned (docs/METHODS.md §A5).

For every complete run of the zoo (tools/train_zoo.py) with the given schedule, the last K
checkpoints go through ``onnxdiag select --prune S`` at a few S inside the model's
transition band (erk allocation, CR+BN repair, head-gradient targets ``expected`` so the
head-gradient readouts are label-free). Per (run, S) the window is those K checkpoints;
each criterion's pick is scored on the *pruned* top-1 against the oracle pruned
checkpoint (gap in pp), next to "best dense then prune" (the checkpoint of best dense
top-1, labelled). Across runs: how often best-dense-then-prune misses the oracle pruned
checkpoint, each gap's mean with a bootstrap interval over runs, and each label-free
criterion's paired difference with best-dense-then-prune.

Measure phase (needs the zoo; one raw file per run under docs/studies/select_pruned/):
    python tools/study_select_pruned.py --zoo /work/zoo
Tables only (no models): python tools/study_select_pruned.py --from-results
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import study_common as sc  # noqa: E402

FOLDER = "select_pruned"
#: S per architecture, inside the label-free agreement band (docs/STUDIES.md study 3 for
#: ResNet-18 / VGG-16-BN; `onnxdiag rr --allocation erk` on vit-tail's last checkpoint).
SPARSITIES = {"resnet18": (0.8, 0.9, 0.95), "vgg16_bn": (0.8, 0.9, 0.95),
              "vit": (0.15, 0.25, 0.35)}
#: The criteria shown (label-free ones; `dense:accuracy` is the labelled baseline).
CRITERIA = ("dense:head_grad_feature", "dense:confidence", "dense:entropy",
            "pruned:head_grad_feature", "pruned:confidence", "pruned:entropy", "agreement",
            "combined")
BASELINE = "dense:accuracy"


def measure_run(name: str, m: dict, a) -> list[dict]:
    """Rows (S × checkpoint) of one run: dense / pruned top-1, every criterion value."""
    import onnxdiag
    from onnxdiag import DataRequest, ReportTarget, Runtime, SelectOptions
    from onnxdiag.commands.select_prune_unit import PruneSelectOptions

    ckpts = sc.ckpt_paths(m)[-a.last:]
    rows = []
    for S in SPARSITIES.get(m["arch"], (0.9,)):
        t0 = time.time()
        res = onnxdiag.select_report(
            [str(p) for p in ckpts],
            data=DataRequest(str(a.zoo / "calib.npz"), limit=a.calib, seed=0),
            eval_data=DataRequest(str(a.zoo / "eval.npz")),
            options=SelectOptions(targets="expected", window="all"),
            prune=PruneSelectOptions(sparsity=S, allocation=a.allocation),
            runtime=Runtime(jobs=1, progress=False), report=ReportTarget(write=False))
        sec = res.report["pruned_selection"]
        ok = [u for u in sec["checkpoints"] if u["error"] is None]
        for i, u in enumerate(ok):
            row = {"S": S, "checkpoint": Path(u["path"]).name, "dense_top1":
                   sec["dense_accuracy"][i], "pruned_top1": sec["pruned_accuracy"][i],
                   "manifest_test": next(c["test_acc"] for c in m["checkpoints"]
                                         if c["path"] == Path(u["path"]).name) / 100,
                   "seconds": (time.time() - t0) / len(ok)}
            row.update({n: c["values"][i] for n, c in sec["criteria"].items()})
            rows.append(row)
        print(f"[{name}] S={S:g}: {len(ok)} checkpoints in {time.time() - t0:.0f} s",
              file=sys.stderr, flush=True)
    return rows


def measure_channels(name: str, m: dict, a) -> list[dict]:
    """Rows (mode × checkpoint) of one run at channel ratio ``a.channels`` (magnitude score,
    BN recalibration): a plan per checkpoint, and one fixed plan made on the run's last
    checkpoint and transferred to the others (same topology hash)."""
    import tempfile

    import onnxdiag
    from onnxdiag import ChannelPruneOptions, DataRequest, ReportTarget, Runtime, SelectOptions
    from onnxdiag.commands.select_prune_unit import PruneSelectOptions

    ckpts = [str(p) for p in sc.ckpt_paths(m)[-a.last:]]
    calib = DataRequest(str(a.zoo / "calib.npz"), limit=a.calib, seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        onnxdiag.prune_channels_report(
            ckpts[-1], output=str(Path(tmp) / "last.onnx"), data=calib,
            options=ChannelPruneOptions(ratio=a.channels, score="magnitude",
                                        plan_out=str(plan)),
            runtime=Runtime(progress=False), report=ReportTarget(write=False))
        for mode, prune in (("per_checkpoint", PruneSelectOptions(channels=a.channels,
                                                                   score="magnitude")),
                            ("fixed_plan", PruneSelectOptions(plan=str(plan)))):
            t0 = time.time()
            res = onnxdiag.select_report(
                ckpts, data=calib, eval_data=DataRequest(str(a.zoo / "eval.npz")),
                options=SelectOptions(targets="expected", window="all"), prune=prune,
                runtime=Runtime(jobs=1, progress=False), report=ReportTarget(write=False))
            sec = res.report["pruned_selection"]
            for i, u in enumerate(sec["checkpoints"]):
                rows.append({"mode": mode, "S": a.channels, "checkpoint": Path(u["path"]).name,
                             "dense_top1": sec["dense_accuracy"][i],
                             "pruned_top1": sec["pruned_accuracy"][i],
                             "seconds": (time.time() - t0) / len(ckpts),
                             **{n: c["values"][i] for n, c in sec["criteria"].items()}})
            print(f"[{name}] channels {a.channels:g} {mode}: {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    return rows


def measure(a) -> None:
    runs = {n: m for n, m in sc.load_runs(a.zoo).items()
            if m["schedule"] == a.schedule and m["arch"] in a.archs.split(",")}
    out = a.results / FOLDER
    if a.channels:
        return measure_all_channels(runs, out / "channels", a)
    for name, m in runs.items():
        path = out / f"{name}.csv"
        if path.is_file() and not a.again:
            continue
        sc.write_rows(path, measure_run(name, m, a))
        meta = sc.read_json(out / "runs.json", {})  # read again: another process may add
        meta[name] = {**sc.run_meta(m), "last_k": a.last, "calib": a.calib,
                      "allocation": a.allocation}
        sc.write_json(out / "runs.json", meta)


def measure_all_channels(runs: dict, out: Path, a) -> None:
    for name, m in runs.items():
        path = out / f"{name}.csv"
        if not path.is_file() or a.again:
            sc.write_rows(path, measure_channels(name, m, a))


# ------------------------------------------------------------------------------ tables

def _direction(name: str) -> str:
    from onnxdiag.selection.readouts import READOUTS

    if name in ("agreement", BASELINE):
        return "higher"
    if name == "combined":
        return "lower"
    return READOUTS[name.split(":", 1)[1]].direction


def pick(rows: list[dict], name: str) -> int:
    """Index of the criterion's choice (ties to the later checkpoint, as select does)."""
    sign = 1.0 if _direction(name) == "higher" else -1.0
    vals = [sign * r[name] for r in rows]
    best = max(vals)
    return max(i for i, v in enumerate(vals) if v == best)


def cases(results: Path) -> list[dict]:
    """One record per (run, S): arch, the oracle pruned top-1 and each criterion's gap pp."""
    meta = sc.read_json(results / FOLDER / "runs.json", {})
    out = []
    for name, info in meta.items():
        rows = sc.read_rows(results / FOLDER / f"{name}.csv")
        for S in sorted({r["S"] for r in rows}):
            rs = [r for r in rows if r["S"] == S]
            rs = [{**r, BASELINE: r["dense_top1"]} for r in rs]
            best = max(r["pruned_top1"] for r in rs)
            gaps = {n: 100 * (best - rs[pick(rs, n)]["pruned_top1"])
                    for n in (BASELINE, *CRITERIA) if n in rs[0]}
            gaps["first"] = 100 * (best - rs[0]["pruned_top1"])  # trivial baselines
            gaps["last"] = 100 * (best - rs[-1]["pruned_top1"])
            out.append({"run": name, "arch": info["arch"], "S": S, "oracle": best,
                        "dense_gap_pp": 100 * (max(r["dense_top1"] for r in rs)
                                               - rs[pick(rs, BASELINE)]["dense_top1"]),
                        "differs": gaps[BASELINE] > 0, "gaps": gaps, "n": len(rs)})
    return out


def _ci(values) -> str:
    import numpy as np

    v = np.asarray(values, float)
    lo, hi = sc.bootstrap_ci(v.size, lambda i: float(v[i].mean()))
    return f"{v.mean():+.2f} [{lo:+.2f}, {hi:+.2f}]"


def gap_table(cs: list[dict]) -> str:
    """Per architecture and S: how often best-dense-then-prune misses the oracle pruned
    checkpoint, and every criterion's mean gap (bootstrap 95 % CI over runs)."""
    header = ["arch", "S", "runs", "best-dense ≠ oracle pruned", f"gap {BASELINE}",
              *[f"gap {n}" for n in CRITERIA]]
    rows = []
    for arch in sc.ARCH_ORDER:
        for S in sorted({c["S"] for c in cs if c["arch"] == arch}):
            sel = [c for c in cs if c["arch"] == arch and c["S"] == S]
            rows.append([arch, f"{S:g}", str(len(sel)),
                         f"{sum(c['differs'] for c in sel)} / {len(sel)}",
                         *[_ci([c["gaps"][n] for c in sel]) for n in (BASELINE, *CRITERIA)]])
    return sc.table(header, rows)


def _run_ci(sel: list[dict], values: list[float]) -> str:
    """Mean of ``values`` (one per case of ``sel``) with a bootstrap interval that
    resamples *runs* (all S of a run together: the cases of one run are not independent)."""
    import numpy as np

    runs = sorted({c["run"] for c in sel})
    by_run = [np.array([v for c, v in zip(sel, values) if c["run"] == r]) for r in runs]
    lo, hi = sc.bootstrap_ci(len(runs), lambda i: float(np.concatenate(
        [by_run[k] for k in i]).mean()))
    return f"{np.mean(values):+.2f} [{lo:+.2f}, {hi:+.2f}]"


def paired_table(cs: list[dict]) -> str:
    """All (run, S) cases pooled per architecture: criterion gap − best-dense gap (pp,
    negative = the label-free criterion closes part of the gap), bootstrap CI over runs,
    and the count of cases where it is better (↓) / worse (↑)."""
    header = ["arch", "runs × S", f"gap {BASELINE}", *CRITERIA]
    rows = []
    for arch in sc.ARCH_ORDER:
        sel = [c for c in cs if c["arch"] == arch]
        if not sel:
            continue
        cells = [_run_ci(sel, [c["gaps"][BASELINE] for c in sel])]
        for n in CRITERIA:
            d = [c["gaps"][n] - c["gaps"][BASELINE] for c in sel]
            cells.append(f"{_run_ci(sel, d)} ({sum(x < 0 for x in d)}↓ "
                         f"{sum(x > 0 for x in d)}↑)")
        n_runs = len({c["run"] for c in sel})
        rows.append([arch, f"{n_runs} × {len(sel) // max(n_runs, 1)}", *cells])
    return sc.table(header, rows)


def pooled_table(cs: list[dict]) -> str:
    """All (run, S) cases of an architecture pooled: the mean gap (pp) of best dense then
    prune, of the label-free §A3 default (dense head gradient) then prune, of the agreement,
    of combined, of the first and the last of the K checkpoints, and agreement − dense head
    gradient; bootstrap CIs over runs."""
    hg = "dense:head_grad_feature"
    header = ["arch", "runs × S", "best-dense ≠ oracle", f"gap {BASELINE}", f"gap {hg}",
              "gap agreement", "gap combined", "gap first of K", "gap last",
              f"agreement − {hg}"]
    rows = []
    for arch in sc.ARCH_ORDER:
        sel = [c for c in cs if c["arch"] == arch]
        if not sel:
            continue
        n_runs = len({c["run"] for c in sel})
        rows.append([arch, f"{n_runs} × {len(sel) // max(n_runs, 1)}",
                     f"{sum(c['differs'] for c in sel)} / {len(sel)}",
                     *[_run_ci(sel, [c["gaps"][n] for c in sel])
                       for n in (BASELINE, hg, "agreement", "combined", "first", "last")],
                     _run_ci(sel, [c["gaps"]["agreement"] - c["gaps"][hg] for c in sel])])
    return sc.table(header, rows)


def channel_table(results: Path) -> str | None:
    """The structured form per mode (a plan per checkpoint / one fixed plan): how often
    best dense ≠ oracle pruned, and the mean gaps (pp, bootstrap CI over runs)."""
    folder = results / FOLDER / "channels"
    files = sorted(folder.glob("*.csv")) if folder.is_dir() else []
    if not files:
        return None
    header = ["arch", "mode", "R", "runs", "best-dense ≠ oracle", f"gap {BASELINE}",
              "gap agreement", "gap combined", "gap first of K", "gap last",
              "pruned top-1 % (mean)"]
    meta = sc.read_json(results / FOLDER / "runs.json", {})
    out = []
    for arch, mode in ((a, m) for a in sc.ARCH_ORDER for m in ("per_checkpoint", "fixed_plan")):
        sel, acc = [], []
        for f in (f for f in files if meta.get(f.stem, {}).get("arch") == arch):
            rs = [{**r, BASELINE: r["dense_top1"]} for r in sc.read_rows(f)
                  if r["mode"] == mode]
            best = max(r["pruned_top1"] for r in rs)
            g = {n: 100 * (best - rs[pick(rs, n)]["pruned_top1"])
                 for n in (BASELINE, "agreement", "combined")}
            g["first"], g["last"] = (100 * (best - rs[k]["pruned_top1"]) for k in (0, -1))
            sel.append({"run": f.stem, "gaps": g, "differs": g[BASELINE] > 0})
            acc += [r["pruned_top1"] for r in rs]
        if not sel:
            continue
        out.append([arch, mode, fmt_r(rs[0]["S"]), str(len(sel)),
                    f"{sum(c['differs'] for c in sel)} / {len(sel)}",
                    *[_run_ci(sel, [c["gaps"][n] for c in sel])
                      for n in (BASELINE, "agreement", "combined", "first", "last")],
                    f"{100 * sum(acc) / len(acc):.1f}"])
    return sc.table(header, out)


def fmt_r(x) -> str:
    return f"{x:g}"


def tables(results: Path, only: str | None = None) -> list[str]:
    cs = cases(results)
    if not cs:
        return ["(no raw results)"]
    parts = {"pooled": pooled_table(cs), "gap": gap_table(cs), "paired": paired_table(cs)}
    channels = channel_table(results)
    if channels:
        parts["channels"] = channels
    keys = only.split(",") if only else list(parts)
    return [parts[k] for k in keys]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zoo", type=Path, default=Path("/work/zoo"))
    p.add_argument("--schedule", default="tail")
    p.add_argument("--archs", default="resnet18,vgg16_bn,vit")
    p.add_argument("--last", type=int, default=5, help="the last K checkpoints of each run")
    p.add_argument("--calib", type=int, default=256, help="calibration images (--limit)")
    p.add_argument("--allocation", default="erk")
    p.add_argument("--channels", type=float, default=None,
                   help="instead: the structured form at this channel ratio (magnitude, BN "
                        "recalibration), a plan per checkpoint vs one fixed plan")
    p.add_argument("--again", action="store_true", help="re-measure what is in --results")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    sc.results_arg(p)
    a = p.parse_args(argv)
    if not a.from_results:
        measure(a)
    return sc.emit(tables(a.results, a.tables), a.out)


if __name__ == "__main__":
    raise SystemExit(main())
