#!/usr/bin/env python3
"""Channel-axes study on the zoo (METHODS §B4–B6), issue 18's design.

    python tools/study_channels.py --zoo /work/zoo       # measure what is new, print tables
    python tools/study_channels.py --from-results        # the tables from docs/studies only

Three measurements, each written per model under ``docs/studies/channels/``:

1. ``coupling/RUN.csv``: ``onnxdiag.channels_report(model)`` on the zoo's calib.npz, per layer
   the Spearman rho of (I_X, I(T;Y)) and of (R_X, Syn) and the ARI, with a permutation null
   (the channels of every layer shuffled independently, ``--perms`` times, seeded): for the
   init-only runs (x1 / x4 / x8 width, with and without BN, 3 init seeds) and for the trained
   cosine runs' last checkpoints;
2. ``prune/RUN.csv``: ``onnxdiag.prune_sweep_report(last)`` with the local scores (ix, peer)
   and the target scores (relevance, synergy, redundancy) next to magnitude and random,
   FLOPs-matched uniform budget, top-1 before and after BN recalibration (no fine-tuning:
   this environment has no ONNX Runtime training extra);
3. ``lesion/RUN.csv``: ``onnxdiag.lesion_report(last)`` on the eval set: every channel of
   ``--lesion-layers`` layers spread over depth zeroed alone; its damage (loss increase) next
   to its R², I(T;Y), I_X. The tables give the within-layer Spearman rho with permutation
   p-values.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_common import (  # noqa: E402
    emit,
    load_runs,
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

SUB = "channels"
LOCAL, TARGET = ("ix", "peer"), ("relevance", "synergy", "redundancy")
SCORES = ("magnitude", "random", *LOCAL, *TARGET)
RATIOS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75)  # finer at the start: the narrow nets collapse early
ALIGN = {"ix_it": ("input_capture", "task_info"), "rx_syn": ("peer_overlap", "synergy")}
LESION_SCORES = {"peer_r2": "R²", "task_info": "I(T;Y)", "input_capture": "I_X"}


# ----------------------------------------------------------------------------------- measure

def perm_null(pairs: list[tuple[np.ndarray, np.ndarray]], perms: int, seed: int):
    """Per-layer permutation p-values (one-sided, rho >= observed) and the null of the
    median over layers: every layer's second score shuffled independently."""
    rng = np.random.default_rng(seed)
    obs = np.array([spearman(a, b) for a, b in pairs])
    null = np.empty((perms, len(pairs)))
    for k in range(perms):
        null[k] = [spearman(a, rng.permutation(b)) for a, b in pairs]
    p_layer = [(1 + np.sum(null[:, j] >= obs[j])) / (perms + 1) for j in range(len(pairs))]
    med, null_med = float(np.nanmedian(obs)), np.nanmedian(null, axis=1)
    return obs, p_layer, med, null_med


def measure_coupling(name: str, model: Path, calib: Path, out: Path, perms: int) -> None:
    import onnxdiag
    from onnxdiag import ReportTarget, Runtime

    t = time.time()
    res = onnxdiag.channels_report(str(model), data=str(calib),
                                   runtime=Runtime(progress=False),
                                   report=ReportTarget(write=False))
    layers = [r for r in res.report["channels"]["layers"] if "scores" in r]
    rows = []
    summary = {}
    for key, (a, b) in ALIGN.items():
        pairs = [(np.asarray(r["scores"]["scores"][a], float),
                  np.asarray(r["scores"]["scores"][b], float)) for r in layers]
        obs, p_layer, med, null_med = perm_null(pairs, perms, seed=0)
        summary[key] = {"median": med, "null_mean": float(np.nanmean(null_med)),
                        "null_sd": float(np.nanstd(null_med)),
                        "null_q95": float(np.nanquantile(null_med, 0.95)),
                        "p": float((1 + np.sum(null_med >= med)) / (perms + 1)),
                        "perms": perms}
        for r, o, pv in zip(layers, obs, p_layer, strict=True):
            rows.append({"layer": r["layer"], "n_channels": r["n_channels"], "stat": key,
                         "rho": o, "p_perm": pv, "ari": r.get("ari")})
    write_rows(out, rows)
    write_json(out.with_suffix(".json"), summary)
    print(f"  coupling {name}: {len(layers)} layers in {time.time() - t:.0f}s",
          file=sys.stderr, flush=True)


def measure_prune(name: str, model: Path, calib: Path, evl: Path, out: Path) -> None:
    import onnxdiag
    from onnxdiag import PruneSweepOptions, Recovery, ReportTarget, Runtime

    t = time.time()
    res = onnxdiag.prune_sweep_report(
        str(model), data=str(calib), eval_data=str(evl),
        options=PruneSweepOptions(ratios=RATIOS, scores=SCORES),
        recovery=Recovery(recalibrate_bn=True), runtime=Runtime(progress=False),
        report=ReportTarget(write=False))
    sw = res.report["prune_sweep"]
    rows = [{"score": r["score"], "ratio": r["ratio"], "kept_fraction": r["kept_fraction"],
             "flops_ratio": r["flops_ratio"], "accuracy_before": r["accuracy_before"],
             "accuracy_after": r.get("accuracy_after")} for r in sw["rows"]]
    rows.append({"score": "dense", "ratio": 0.0, "kept_fraction": 1.0, "flops_ratio": 1.0,
                 "accuracy_before": sw["dense_accuracy"],
                 "accuracy_after": sw.get("dense_accuracy_after_recovery")})
    write_rows(out, rows)
    write_json(out.with_suffix(".json"), sw["auc"])
    print(f"  prune-sweep {name}: {time.time() - t:.0f}s", file=sys.stderr, flush=True)


def lesion_layers(model: Path, n: int) -> list[str]:
    """``n`` convs spread evenly over depth (first and last analysed conv included)."""
    import onnxdiag

    structure, _ = onnxdiag.inspect_model(str(model))
    convs = [la.node_name for la in structure.layers
             if la.op_type == "Conv" and not la.is_head and la.n_out >= 8]
    idx = np.unique(np.round(np.linspace(0, len(convs) - 1, n)).astype(int))
    return [convs[i] for i in idx]


def measure_lesion(name: str, model: Path, calib: Path, evl: Path, out: Path, n: int) -> None:
    import onnxdiag
    from onnxdiag import LesionOptions, ReportTarget, Runtime

    t = time.time()
    layers = lesion_layers(model, n)
    res = onnxdiag.lesion_report(str(model), data=str(calib), eval_data=str(evl),
                                 options=LesionOptions(layers=tuple(layers)),
                                 runtime=Runtime(progress=False),
                                 report=ReportTarget(write=False))
    keep = ("layer", "channel", "damage", "acc_drop", "peer_r2", "task_info",
            "input_capture", "peer_overlap", "synergy", "redundancy")
    write_rows(out, [{k: r.get(k) for k in keep} for r in res.report["lesion"]["rows"]])
    print(f"  lesion {name}: {len(layers)} layers in {time.time() - t:.0f}s", file=sys.stderr,
          flush=True)


def jobs_of(name: str, m: dict, a) -> list[tuple]:
    """(kind, function, arguments after the output path) of one run."""
    calib, evl = a.zoo / "calib.npz", a.zoo / "eval.npz"
    ck = m["dir"] / "checkpoints"
    last = ck / m["checkpoints"][-1]["path"]
    if m["schedule"] == "init":
        return [("coupling", measure_coupling, (ck / "ckpt_000.onnx", calib, a.perms))]
    if m["schedule"] != "cosine":
        return []
    out = [("coupling", measure_coupling, (last, calib, a.perms))]
    if m["arch"] in a.prune_archs.split(",") and m["seed"] < a.seeds:
        out.append(("prune", measure_prune, (last, calib, evl)))
    if m["arch"] in a.lesion_archs.split(",") and m["seed"] < a.seeds:
        out.append(("lesion", measure_lesion, (last, calib, evl, a.lesion_layers)))
    return out


def measure(a) -> None:
    base = a.results / SUB
    meta = read_json(base / "runs.json", {})
    for name, m in load_runs(a.zoo).items():
        for kind, fn, args in jobs_of(name, m, a):
            out = base / kind / f"{name}.csv"
            if kind in a.skip.split(",") or (out.is_file() and not a.again):
                continue
            if kind == "coupling":
                fn(name, args[0], args[1], out, args[2])
            else:
                fn(name, args[0], args[1], args[2], out, *args[3:])
            meta[name] = run_meta(m)
            write_json(base / "runs.json", meta)


# ---------------------------------------------------------------------------------- tables

def coupling_table(results: Path, meta: dict) -> str:
    base = results / SUB / "coupling"
    groups: dict[tuple, list] = {}
    for n, m in meta.items():
        if (base / f"{n}.json").is_file():
            state = "init" if m["schedule"] == "init" else "trained"
            groups.setdefault((m["arch"], m["width"], m["batchnorm"], state), []).append(n)
    rows = []
    for (arch, width, bn, state), names in sorted(groups.items(),
                                                  key=lambda kv: (kv[0][0], kv[0][3] != "init",
                                                                  not kv[0][2], kv[0][1])):
        js = [read_json(base / f"{n}.json") for n in names]
        layers = read_rows(base / f"{names[0]}.csv")
        n_layers = len({r["layer"] for r in layers})
        cells = []
        for key in ALIGN:
            cells += [pm([j[key]["median"] for j in js], n=False),
                      pm([j[key]["null_q95"] for j in js], n=False),
                      f"{sum(j[key]['p'] < 0.05 for j in js)}/{len(js)}"]
        aris = []
        for n in names:
            v = [r["ari"] for r in read_rows(base / f"{n}.csv")
                 if r["stat"] == "ix_it" and r["ari"] is not None]
            aris.append(float(np.median(v)) if v else float("nan"))
        rows.append([arch, f"×{width:g}", "BN" if bn else "no BN", state, len(names),
                     n_layers, *cells, pm(aris, n=False)])
    perms = next(iter(read_json(base / f"{n}.json") for n in meta
                      if (base / f"{n}.json").is_file()))["ix_it"]["perms"]
    return ("**Init coupling: median over layers of the per-layer Spearman ρ** (probe calib.npz, "
            "1,000 images x 16 positions; mean ± sd over init / training seeds, n = seeds "
            f"column). Null: each layer's channels shuffled independently, {perms} permutations;"
            " q95 = the null's 95th percentile of the median; p < 0.05: one-sided permutation "
            "p of the median; ARI: median over layers of the k-means (k = 4) agreement between "
            "the two axes. Published (CIFAR-100): ρ(I_X, I(T;Y)) ≈ 0.7 at init, ≈ 0.01 "
            "trained; ARI ≈ 0.02\n\n"
            + table(["arch", "width", "BN", "state", "seeds", "layers", "ρ(I_X,I_T)",
                     "null q95", "p<0.05", "ρ(R_X,Syn)", "null q95 ", "p<0.05 ", "ARI"], rows))


def auc_of(rows: list[dict], score: str, phase: str) -> float:
    from onnxdiag.commands.prune_sweep import normalized_auc

    dense = next(r for r in rows if r["score"] == "dense")[f"accuracy_{phase}"]
    mine = sorted((r for r in rows if r["score"] == score), key=lambda r: r["ratio"])
    kept = [1.0] + [r["kept_fraction"] for r in mine]
    acc = [dense] + [r[f"accuracy_{phase}"] for r in mine]
    return normalized_auc(kept, acc, dense)


def prune_tables(results: Path, meta: dict) -> list[str]:
    base = results / SUB / "prune"
    by_arch: dict[str, list] = {}
    for n, m in sorted(meta.items(), key=lambda kv: kv[1]["seed"]):
        if (base / f"{n}.csv").is_file():
            by_arch.setdefault(m["arch"], []).append(n)
    out = []
    for phase, what in (("before", "no recovery"), ("after", "after BN recalibration")):
        rows = []
        for arch, names in by_arch.items():
            aucs = {n: {s: auc_of(read_rows(base / f"{n}.csv"), s, phase) for s in SCORES}
                    for n in names}
            diff = {"orig": [100 * (max(a[s] for s in LOCAL) - a["relevance"])
                             for a in aucs.values()],
                    "bal": [100 * (max(a[s] for s in LOCAL) - max(a["relevance"], a["synergy"]))
                            for a in aucs.values()],
                    "all": [100 * (max(a[s] for s in LOCAL) - max(a[s] for s in TARGET))
                            for a in aucs.values()]}
            rows.append([arch, len(names), *[pm([100 * a[s] for a in aucs.values()], 1, False)
                                             for s in SCORES],
                         pm(diff["orig"], 1, False), pm(diff["bal"], 1, False),
                         pm(diff["all"], 1, False)])
        out.append(f"**Structured pruning, {what}: normalised AUC ×100 of top-1 over the kept "
                   f"fraction** (prune-sweep, FLOPs-matched uniform budget, ratios "
                   f"{', '.join(map(str, RATIOS))}; mean ± sd over training seeds, n = seeds "
                   f"column). Last three columns, pp: best local (ix, peer) − relevance (the "
                   f"published comparison, best of two vs one); − best of (relevance, synergy) "
                   f"(balanced, two vs two); − best of all three target scores. Published "
                   f"(with fine-tuning): +8.0 (ResNet-18), +6.6 (VGG-16), +10.1 (MobileNetV2)"
                   f"\n\n" + table(["arch", "seeds", *SCORES, "local − relevance",
                                    "local − best(rel, syn)", "local − best(target)"], rows))
    return out


def lesion_table(results: Path, meta: dict, perms: int) -> str:
    base = results / SUB / "lesion"
    rows, pooled = [], {k: [] for k in LESION_SCORES}
    rng = np.random.default_rng(0)
    names = [n for n in sorted(meta, key=lambda n: (meta[n]["arch"], meta[n]["seed"]))
             if (base / f"{n}.csv").is_file()]
    for n in names:
        data = read_rows(base / f"{n}.csv")
        for layer in dict.fromkeys(r["layer"] for r in data):
            rs = [r for r in data if r["layer"] == layer]
            dmg = np.array([r["damage"] for r in rs], float)
            row = [meta[n]["arch"], f"s{meta[n]['seed']}", layer, len(rs)]
            for k in LESION_SCORES:
                v = np.array([np.nan if r[k] is None else r[k] for r in rs], float)
                rho = spearman(v, dmg)
                null = np.array([spearman(rng.permutation(v), dmg) for _ in range(perms)])
                p = (1 + np.sum(np.abs(null) >= abs(rho))) / (perms + 1)
                pooled[k].append((rho, p))
                row.append(f"{rho:+.2f} (p {p:.3f})" if np.isfinite(rho) else "–")
            rows.append(row)
    summary = []
    for k, label in LESION_SCORES.items():
        rhos = [r for r, _ in pooled[k] if np.isfinite(r)]
        sig = sum(p < 0.05 for r, p in pooled[k] if np.isfinite(r))
        summary.append(f"{label}: median ρ {np.median(rhos):+.2f}, {sig}/{len(rhos)} layers "
                       f"with p < 0.05, {sum(r < 0 for r in rhos)}/{len(rhos)} negative")
    return (f"**Lesions: within-layer Spearman ρ of each channel's damage (loss increase on "
            f"eval.npz when the channel alone is zeroed) with its score**, two-sided "
            f"permutation p ({perms} shuffles of the score within the layer); one row per "
            f"(training seed, layer). Expected if peer support protects: ρ(R², damage) < 0\n\n"
            + table(["arch", "seed", "layer", "channels", *LESION_SCORES.values()], rows)
            + "\n\nOver all rows: " + "; ".join(summary))


def tables(results: Path, perms: int, only: str | None = None) -> list[str]:
    """Every table from the raw results (``only``: comma list of coupling, prune, lesion)."""
    meta = read_json(results / SUB / "runs.json", {})
    if not meta:
        raise SystemExit(f"error: no raw results in {results / SUB}; measure with --zoo first")
    keys = set(only.split(",")) if only else {"coupling", "prune", "lesion"}
    parts = []
    if "coupling" in keys and (results / SUB / "coupling").is_dir():
        parts.append(coupling_table(results, meta))
    if "prune" in keys and (results / SUB / "prune").is_dir():
        parts += prune_tables(results, meta)
    if "lesion" in keys and (results / SUB / "lesion").is_dir():
        parts.append(lesion_table(results, meta, perms))
    return parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zoo", type=Path, default=Path("/work/zoo"))
    p.add_argument("--perms", type=int, default=1000, help="permutations of every null")
    p.add_argument("--seeds", type=int, default=3, help="training seeds for prune / lesion")
    p.add_argument("--prune-archs", default="resnet18,vgg16_bn,mobilenetv2")
    p.add_argument("--lesion-archs", default="resnet18,vgg16_bn")
    p.add_argument("--lesion-layers", type=int, default=5, help="layers lesioned per model")
    p.add_argument("--skip", default="", help="comma list of coupling,prune,lesion to skip")
    p.add_argument("--again", action="store_true", help="re-measure what is in --results")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    results_arg(p)
    a = p.parse_args(argv)
    if a.from_results:
        return emit(tables(a.results, a.perms, a.tables), a.out)
    measure(a)
    parts = study_start("study_channels.py", "Channel axes: init coupling, balanced pruning, "
                        "lesions", a.zoo, argv, load_runs(a.zoo), only="-")
    return emit(parts + tables(a.results, a.perms), a.out)


if __name__ == "__main__":
    sys.exit(main())
