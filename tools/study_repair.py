#!/usr/bin/env python3
"""Repairability study on the zoo (METHODS §C3/C4), issue 18's design.

    python tools/study_repair.py --zoo /work/zoo        # measure what is new, print tables
    python tools/study_repair.py --from-results         # the tables from docs/studies only

Per model (the last checkpoint of the cosine runs of ``--archs``, training seeds below
``--seeds``), through the objects the ``sweep`` verb uses (``onnxdiag.commands.pruning``:
``open_inputs``, ``compute_curves``, ``make_pruner``; allocation, masks and CR+BN repair are
the verb's), with every pruned model's predictions on eval.npz kept per image so that
allocations can be compared on the same images:

1. ``coarse``: S in COARSE for erk, lamp and rr: the label-free agreement band (Agr_CR+BN
   on calib.npz from 0.9 to 0.5) of each, and their union;
2. ``fine``: ``--fine-points`` sparsities evenly over that union (chosen without labels, per
   model), all five allocations;
3. ablations at the band's 25 / 50 / 75 % points for erk, lamp and rr: the head kept dense
   (``keep_dense``), ``force_projection``, and 16 / 32 / 64 / 128 calibration images (the
   repair's and the RR curves' images both).

Raw results: ``docs/studies/repair/RUN.csv``, one row per (phase, S, allocation) with the
accuracy, the agreement and the per-image correctness (packed bits, base64).
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_common import (  # noqa: E402
    BOOT,
    emit,
    load_runs,
    pm,
    read_json,
    read_rows,
    results_arg,
    run_meta,
    study_start,
    table,
    write_json,
    write_rows,
)

SUB = "repair"
ALLOCS = ("global", "uniform", "erk", "lamp", "rr")
BAND_ALLOCS = ("erk", "lamp", "rr")
COARSE = (0.5, 0.7, 0.8, 0.85, 0.9, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99)
CALIB_SIZES = (16, 32, 64, 128)
REPAIR = "cr+bn"


# ----------------------------------------------------------------------------------- measure

class Setting:
    """One pruner (dense model, calibration images, RR curves, options) and the eval set."""

    def __init__(self, model: Path, calib: Path, x_eval, y_eval, *, limit=None, **options):
        from onnxdiag import DataRequest
        from onnxdiag.commands.pruning import (
            PrunerOptions,
            compute_curves,
            make_pruner,
            open_inputs,
        )

        self.options = PrunerOptions(**options)
        inputs = open_inputs(str(model), DataRequest(str(calib), limit=limit),
                             keep_dense=self.options.keep_dense)
        curves = compute_curves(inputs, self.options, seed=0)
        self.pruner = make_pruner(inputs, self.options, curves)
        self.head = inputs.structure.head.node_name
        self.x_eval, self.y_eval = x_eval, y_eval

    def cell(self, S: float, rule: str) -> dict:
        from onnxdiag.errors import OnnxDiagError
        from onnxdiag.sparsity.masks import make_masks

        t = time.time()
        try:
            alloc = self.pruner.allocate(rule, S)
        except OnnxDiagError as exc:
            return {"sparsity": S, "allocation": rule, "error": str(exc)}
        model, _ = self.pruner.prune(alloc, REPAIR, masks=make_masks(alloc, self.pruner.weights))
        agreement, _ = self.pruner.measure(model)
        correct = predict(model, self.x_eval) == self.y_eval
        return {"sparsity": S, "allocation": rule, "agreement": agreement,
                "accuracy": 100.0 * float(correct.mean()),
                "correct": base64.b64encode(np.packbits(correct).tobytes()).decode(),
                "seconds": round(time.time() - t, 2), "error": None}


def predict(model, x) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: x[i:i + 500]})[0].argmax(1)
                           for i in range(0, len(x), 500)])


def union_band(rows: list[dict]) -> tuple[float, float]:
    """The union over erk, lamp, rr of the agreement bands (0.9 -> 0.5) on the coarse grid."""
    from onnxdiag.sparsity.transition import transition_band

    lo, hi = [], []
    for rule in BAND_ALLOCS:
        pts = sorted((r["sparsity"], r["agreement"]) for r in rows
                     if r["allocation"] == rule and r.get("agreement") is not None)
        b = transition_band([p[0] for p in pts], [p[1] for p in pts]).to_dict()
        lo.append(b["start"] if b["start"] is not None else pts[0][0])
        hi.append(b["end"] if b["end"] is not None else pts[-1][0])
    return float(min(lo)), float(max(hi))


def measure_model(name: str, model: Path, zoo: Path, out: Path, fine_points: int,
                  ablations: bool) -> None:
    with np.load(zoo / "eval.npz") as f:
        x_eval, y_eval = f["input"], f["labels"]
    calib = zoo / "calib.npz"
    t0 = time.time()
    base = Setting(model, calib, x_eval, y_eval)
    rows = [{"phase": "coarse", **base.cell(S, r)} for S in COARSE for r in BAND_ALLOCS]
    lo, hi = union_band(rows)
    fine = [round(float(s), 4) for s in np.linspace(lo, hi, fine_points)]
    rows += [{"phase": "fine", **base.cell(S, r)} for S in fine for r in ALLOCS]
    print(f"  repair {name}: band {lo:.3f}-{hi:.3f}, {len(rows)} cells in "
          f"{time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    if ablations:
        points = [round(lo + q * (hi - lo), 4) for q in (0.25, 0.5, 0.75)]
        variants = {"head_dense": dict(keep_dense=(base.head,)),
                    "force_projection": dict(force_projection=True),
                    **{f"calib{n}": dict(limit=n, rr_images=n) for n in CALIB_SIZES}}
        rows += [{"phase": "default", **base.cell(S, r)} for S in points for r in BAND_ALLOCS]
        for phase, kw in variants.items():
            st = Setting(model, calib, x_eval, y_eval, **kw)
            rows += [{"phase": phase, **st.cell(S, r)} for S in points for r in BAND_ALLOCS]
            print(f"  repair {name} {phase}: {time.time() - t0:.0f}s", file=sys.stderr,
                  flush=True)
    write_rows(out, rows)


def measure(a) -> None:
    runs = load_runs(a.zoo)
    base = a.results / SUB
    for name, m in runs.items():
        if m["schedule"] != "cosine" or m["arch"] not in a.archs.split(",") \
                or m["seed"] >= a.seeds:
            continue
        out = base / f"{name}.csv"
        lock = out.with_suffix(".lock")  # another process measures it now
        if (out.is_file() and not a.again) or lock.exists():
            continue
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
        try:
            last = m["dir"] / "checkpoints" / m["checkpoints"][-1]["path"]
            measure_model(name, last, a.zoo, out, a.fine_points, not a.no_ablations)
        finally:
            lock.unlink()
        meta = read_json(base / "runs.json", {})
        meta[name] = run_meta(m)
        write_json(base / "runs.json", meta)


# ---------------------------------------------------------------------------------- tables

def bits(row: dict) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(row["correct"]), dtype=np.uint8)
    return np.unpackbits(raw)[:2000].astype(float)


def paired_ci(a: np.ndarray, b: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """100 x mean(a − b) with its 95 % bootstrap interval over the images (paired)."""
    d = a - b
    rng = np.random.default_rng(seed)
    boots = np.array([d[rng.integers(0, d.size, d.size)].mean() for _ in range(BOOT)])
    return 100 * d.mean(), 100 * np.quantile(boots, 0.025), 100 * np.quantile(boots, 0.975)


def cells(rows: list[dict], phase: str) -> dict:
    return {(r["sparsity"], r["allocation"]): r for r in rows
            if r["phase"] == phase and not r.get("error")}


def model_tables(results: Path, meta: dict) -> list[str]:
    base = results / SUB
    out, band_rows = [], []
    for n in _names(base, meta):
        rows = read_rows(base / f"{n}.csv")
        fine = cells(rows, "fine")
        grid = sorted({s for s, _ in fine})
        lo, hi = union_band(cells_list(rows, "coarse"))
        trows = []
        for S in grid:
            row = [f"{S:.4f}", *[_acc(fine.get((S, al))) for al in ALLOCS],
                   f"{fine[(S, 'rr')]['agreement']:.3f}" if (S, "rr") in fine else "–"]
            for other in ("erk", "lamp"):
                if (S, "rr") in fine and (S, other) in fine:
                    d, a_, b_ = paired_ci(bits(fine[(S, "rr")]), bits(fine[(S, other)]))
                    row.append(f"{d:+.2f} [{a_:+.2f}, {b_:+.2f}]")
                else:
                    row.append("–")
            trows.append(row)
        m = meta[n]
        out.append(f"**{m['arch']} seed {m['seed']}** (`{n}` last checkpoint, "
                   f"{m['n_parameters']:,} params, dense {m['last']['test_acc']:.2f} %): fine "
                   f"grid over the label-free agreement band {lo:.3f}–{hi:.3f} (union of erk, "
                   f"lamp, rr; Agr_CR+BN 0.9 → 0.5 on calib.npz). Top-1 % after CR+BN; rr − erk "
                   f"and rr − lamp in pp with 95 % paired bootstrap intervals over the 2,000 "
                   f"eval images\n\n"
                   + table(["S", *ALLOCS, "agr rr", "rr − erk [95 % CI]", "rr − lamp [95 % CI]"],
                           trows))
        band_rows.append((m["arch"], n, fine, grid))
    return out + [band_summary(band_rows)]


def cells_list(rows, phase):
    return [r for r in rows if r["phase"] == phase and not r.get("error")]


def _acc(c) -> str:
    return "–" if c is None else f"{c['accuracy']:.2f}"


def _names(base: Path, meta: dict) -> list[str]:
    return [n for n in sorted(meta, key=lambda n: (meta[n]["arch"], meta[n]["seed"]))
            if (base / f"{n}.csv").is_file()]


def band_summary(models) -> str:
    """Per architecture over training seeds: the band-mean rr − prior difference and where
    its per-S interval is above / below zero."""
    by_arch: dict[str, list] = {}
    for arch, n, fine, grid in models:
        by_arch.setdefault(arch, []).append((n, fine, grid))
    rows = []
    for arch, ms in by_arch.items():
        for other in ("erk", "lamp"):
            means, pos, neg, best = [], 0, 0, []
            for _, fine, grid in ms:
                ds = []
                for S in grid:
                    if (S, "rr") not in fine or (S, other) not in fine:
                        continue
                    d, lo, hi = paired_ci(bits(fine[(S, "rr")]), bits(fine[(S, other)]))
                    ds.append(d)
                    pos += lo > 0
                    neg += hi < 0
                a = np.mean([bits(fine[(S, "rr")]).mean() - bits(fine[(S, other)]).mean()
                             for S in grid if (S, "rr") in fine and (S, other) in fine])
                means.append(100 * a)
                best.append(max(ds))
            n_pts = sum(len(g) for _, _, g in ms)
            rows.append([arch, f"rr − {other}", len(ms), pm(means, n=False), pm(best, n=False),
                         f"{pos}/{n_pts}", f"{neg}/{n_pts}"])
    return ("**RR vs its prior and LAMP over each model's band** (CR+BN; per training seed the "
            "mean over the fine grid of the paired difference, then mean ± sd over training "
            "seeds, n = seeds column; S points whose 95 % paired interval over images lies "
            "above / below 0, of all fine-grid points of all seeds). Published (CIFAR-100 "
            "ResNet-18): rr beats erk over 94.0–95.5 % (+2.5 pp at 95 %) and lamp over "
            "95.0–95.5 % (+1.1 pp)\n\n"
            + table(["arch", "difference", "seeds", "band mean pp", "max over band pp",
                     "CI > 0", "CI < 0"], rows))


def ablation_table(results: Path, meta: dict) -> str | None:
    base = results / SUB
    phases = ("default", "head_dense", "force_projection",
              *[f"calib{n}" for n in CALIB_SIZES])
    rows = []
    by_arch: dict[str, list] = {}
    for n in _names(base, meta):
        rs = read_rows(base / f"{n}.csv")
        if any(r["phase"] == "default" for r in rs):
            by_arch.setdefault(meta[n]["arch"], []).append(rs)
    if not by_arch:
        return None
    for arch, models in by_arch.items():
        for phase in phases:
            acc = {al: [] for al in BAND_ALLOCS}
            d_erk, d_lamp = [], []
            for rs in models:
                c = cells(rs, phase)
                for al in BAND_ALLOCS:  # mean over the three band points of one model
                    acc[al].append(np.mean([v["accuracy"] for (s, a), v in c.items() if a == al]))
                pts = sorted({s for s, _ in c})
                d_erk.append(np.mean([c[(s, "rr")]["accuracy"] - c[(s, "erk")]["accuracy"]
                                      for s in pts]))
                d_lamp.append(np.mean([c[(s, "rr")]["accuracy"] - c[(s, "lamp")]["accuracy"]
                                       for s in pts]))
            rows.append([arch, phase, len(models), *[pm(acc[al], n=False) for al in BAND_ALLOCS],
                         pm(d_erk, n=False), pm(d_lamp, n=False)])
    return ("**Ablations at each model's band points (25 / 50 / 75 % of the band)**: top-1 % "
            "after CR+BN averaged over the three points, then mean ± sd over training seeds "
            "(n = seeds column). default: head pruned, ERK without force-projection, 1,000 "
            "calibration images (RR curves on 64); head_dense: the head Gemm kept dense; "
            "force_projection: ERK (and rr's ERK prior) set 1×1 shortcuts to S; calibN: N "
            "calibration images for the repair and the RR curves. Published: rr stable for "
            "16–128 calibration images\n\n"
            + table(["arch", "setting", "seeds", *BAND_ALLOCS, "rr − erk pp", "rr − lamp pp"],
                    rows))


def tables(results: Path, only: str | None = None) -> list[str]:
    """Every table from the raw results (``only``: comma list of models, bands,
    ablations)."""
    meta = read_json(results / SUB / "runs.json", {})
    if not meta:
        raise SystemExit(f"error: no raw results in {results / SUB}; measure with --zoo first")
    keys = set(only.split(",")) if only else {"models", "bands", "ablations"}
    per_model = model_tables(results, meta)
    parts = per_model[:-1] if "models" in keys else []
    if "bands" in keys:
        parts.append(per_model[-1])
    abl = ablation_table(results, meta) if "ablations" in keys else None
    if abl:
        parts.append(abl)
    return parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zoo", type=Path, default=Path("/work/zoo"))
    p.add_argument("--archs", default="resnet18,vgg16_bn")
    p.add_argument("--seeds", type=int, default=3, help="training seeds per architecture")
    p.add_argument("--fine-points", type=int, default=9)
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--again", action="store_true", help="re-measure what is in --results")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    results_arg(p)
    a = p.parse_args(argv)
    if a.from_results:
        return emit(tables(a.results, a.tables), a.out)
    measure(a)
    parts = study_start("study_repair.py", "Repairability: RR band, paired intervals, "
                        "ablations", a.zoo, argv, load_runs(a.zoo), only="cosine")
    return emit(parts + tables(a.results), a.out)


if __name__ == "__main__":
    sys.exit(main())
