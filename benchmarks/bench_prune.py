#!/usr/bin/env python3
"""Does a channel-pruned model run as fast as its FLOPs promise on ONNX Runtime CPU?

    python benchmarks/bench_prune.py [--model M | --arch resnet18 --width-scale S]
        [--ratio 0.5] [--round-to auto] [--threads 1,0] [--seconds 4] [--runs 3]
        [--profile] [--json OUT]

Prunes ``--ratio`` of every prunable channel group the way ``prune-channels --score
magnitude --budget uniform --round-to R`` does (with the uniform budget every score gives
the same shapes, so the same speed) and times three models on real Fashion-MNIST test
images (random ones when the data is absent): the source, the pruned model with its
BatchNormalization nodes (``--no-fold-bn``) and the emitted model (Conv+BN folded,
redundant nodes removed: the default). Each run opens fresh sessions and times rounds
of one inference per model, in random order, for about ``--seconds``, so load on a
shared machine hits all three alike; the speed-up is the median over rounds of source /
emitted time, with its interquartile range, and ``--runs`` repeats all of it. With one
intra-op thread the calling thread's CPU time is reported next to the wall time (it
leaves out the time other processes hold the core). ``--threads 0`` is ONNX Runtime's
default (one thread per core; spin-waiting off so that idle sessions do not compete).

``--arch resnet18 --width-scale S`` builds tools/train_zoo.py's CIFAR ResNet-18 (stages
8·S, 16·S, 32·S, 64·S channels, 28×28 input) with random weights and random BN statistics
(latency does not depend on training). ``--profile`` adds ONNX Runtime's per-node times at
batch 32 (1 thread): where the time goes, per conv, before and after.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
VARIANTS = ("source", "pruned", "emitted")


def build_resnet(scale: float, path: Path) -> Path:
    """tools/train_zoo.py's resnet18 at ``scale`` with random weights, exported to ``path``."""
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import train_zoo as tz

    torch.manual_seed(0)
    net = tz.build("resnet18", tz.arch_widths("resnet18", scale))
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    tz.export(net, path, 17, {"onnxdiag.zoo.arch": "resnet18", "onnxdiag.zoo.scale": scale})
    return path


def prune(model_path: str, ratio: float, round_to) -> dict:
    """The three models and what pruning and the optimisation did."""
    from onnxdiag.commands.channel_pruning import resolve_round_to
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.finalize import finalize_model
    from onnxdiag.model.io import load_model
    from onnxdiag.model.optimize import optimize_for_inference
    from onnxdiag.structured import magnitude_scores, plan_pruning, prune_channels

    model = load_model(model_path)
    structure = analyze_structure(model)
    plan = plan_pruning(model, structure, magnitude_scores(model, structure), ratio,
                        round_to=resolve_round_to(round_to))
    pruned, record = prune_channels(model, structure, plan.removed)
    pruned = finalize_model(pruned)
    emitted, opt = optimize_for_inference(pruned)
    return {"models": dict(zip(VARIANTS, (model, pruned, emitted))), "plan": plan,
            "record": record, "optimization": opt}


def session(model, threads: int):
    """A CPU session; with several intra-op threads their spin-waiting is off, so that one
    session's idle pool does not steal the cores of the next one timed."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads != 1:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def interleaved(models: dict, x: np.ndarray, threads: int, seconds: float) -> np.ndarray:
    """(2, rounds, models) seconds per run: wall time, and the calling thread's CPU time
    (with 1 intra-op thread ORT computes in that thread, so the CPU time leaves out the
    time other processes hold the core). Fresh sessions; each round runs every model once
    (a single run is shorter than a scheduler time slice, so most run unpreempted), in a
    seeded random order; as many rounds (30 to 3000) as fit in about ``seconds``."""
    sessions = [session(m, threads) for m in models.values()]
    feeds = {sessions[0].get_inputs()[0].name: x}
    t0 = time.perf_counter()
    for s in sessions:
        for _ in range(3):
            s.run(None, feeds)
    rounds = int(np.clip(seconds / ((time.perf_counter() - t0) / 3), 30, 3000))
    times = np.zeros((2, rounds, len(sessions)))
    order = np.random.default_rng(0)
    for r in range(rounds):
        for k in order.permutation(len(sessions)):
            wall, cpu = time.perf_counter(), time.thread_time()
            sessions[k].run(None, feeds)
            times[:, r, k] = (time.perf_counter() - wall, time.thread_time() - cpu)
    return times


def _stats(runs: list[np.ndarray], clock: int) -> dict:
    """Medians and spread of one clock (0 wall, 1 thread CPU) over every run's rounds."""
    every = np.concatenate([t[clock, :, 0] / t[clock, :, 2] for t in runs])
    fold = np.concatenate([t[clock, :, 1] / t[clock, :, 2] for t in runs])
    return {"ms": {v: 1000 * float(np.median(np.concatenate([t[clock, :, k] for t in runs])))
                   for k, v in enumerate(VARIANTS)},
            "speedup": float(np.median(every)),
            "speedup_iqr": [float(q) for q in np.percentile(every, [25, 75])],
            "speedup_runs": [float(np.median(t[clock, :, 0] / t[clock, :, 2])) for t in runs],
            "fold_gain": float(np.median(fold)),
            "fold_gain_iqr": [float(q) for q in np.percentile(fold, [25, 75])]}


def measure(models: dict, x: np.ndarray, args) -> list[dict]:
    """One row per (threads, batch, clock) over ``args.runs`` runs of about
    ``args.seconds`` each; the thread-CPU clock only with 1 thread."""
    rows = []
    for threads in args.threads:
        for batch in (1, 32):
            runs = [interleaved(models, x[:batch], threads, args.seconds)
                    for _ in range(args.runs)]
            for clock, name in ((0, "wall"), (1, "thread CPU"))[:2 if threads == 1 else 1]:
                rows.append({"threads": threads or "default", "batch": batch, "clock": name,
                             **_stats(runs, clock)})
    return rows


# -- where the time goes ----------------------------------------------------------------------
def node_times(model, x: np.ndarray, runs: int = 30) -> dict[str, tuple[str, float]]:
    """ONNX Runtime profile at 1 thread: ORT node name -> (op, median µs per run)."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.enable_profiling, opts.intra_op_num_threads = True, 1
        opts.profile_file_prefix = str(Path(tmp) / "prof")
        opts.log_severity_level = 3
        s = ort.InferenceSession(model.SerializeToString(), opts,
                                 providers=["CPUExecutionProvider"])
        feeds = {s.get_inputs()[0].name: x}
        for _ in range(runs):
            s.run(None, feeds)
        events = json.loads(Path(s.end_profiling()).read_text())
    per: dict[str, list] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per.setdefault(e["name"][:-len("_kernel_time")], [e["args"]["op_name"]]).append(
                e["dur"])
    return {name: (v[0], float(np.median(v[1:]))) for name, v in per.items()}


def conv_of_node(model) -> dict[str, str]:
    """ORT node name (a fused chain's last output + "_nchwc", or that output) -> the Conv
    that starts the chain (Conv → BN → Relu/Add/Clip through sole readers)."""
    from onnxdiag.graph import GraphIndex

    index = GraphIndex(model)
    out = {}
    for conv in (n for n in index.nodes if n.op_type == "Conv"):
        tensor = conv.output[0]
        while True:
            out[tensor] = out[tensor + "_nchwc"] = conv.name
            nxt = index.sole_consumer(tensor)
            if nxt is None or nxt.op_type not in ("BatchNormalization", "Relu", "Add", "Clip"):
                break
            tensor = nxt.output[0]
    return out


def profile(result: dict, x: np.ndarray) -> dict:
    """Per-conv µs at batch 32 before and after, and the time outside convs."""
    src, emitted = result["models"]["source"], result["models"]["emitted"]
    before, after = node_times(src, x), node_times(emitted, x)
    convs = conv_of_node(src)
    widths = result["record"].widths
    rows, other = {}, {"source": 0.0, "emitted": 0.0}
    for key, times in (("source", before), ("emitted", after)):
        for name, (op, us) in times.items():
            conv = convs.get(name) if op in ("Conv", "FusedConv") else None
            if conv is None:
                other[key] += us
                continue
            row = rows.setdefault(conv, {"conv": conv, "source": 0.0, "emitted": 0.0,
                                         "width": widths.get(conv)})
            row[key] += us
    return {"convs": list(rows.values()), "other_us": other,
            "total_us": {"source": sum(t for _, t in before.values()),
                         "emitted": sum(t for _, t in after.values())},
            "other_ops": sorted({op for op, _ in after.values() if op not in ("Conv",)})}


# -- output -----------------------------------------------------------------------------------
def print_summary(name: str, result: dict, rows: list[dict]) -> None:
    rec, opt = result["record"], result["optimization"]
    ratio = rec.flops_after / rec.flops_before
    print(f"\n{name}: channels removed {result['plan'].n_removed}/"
          f"{sum(result['plan'].n_channels.values())}, widths after "
          f"{sorted({a for _, a in rec.widths.values()})}; FLOPs {rec.flops_before:,} -> "
          f"{rec.flops_after:,} (ratio {ratio:.3f}, promise {1 / ratio:.2f}x); "
          f"{len(opt.folded)} Conv+BN folded, {len(opt.removed)} nodes removed")
    print("| batch | threads | clock | source ms | pruned ms (BN kept) | emitted ms | speed-up "
          "(IQR) | per run | speed-up ÷ promise | BN kept ÷ folded (IQR) |\n"
          "|---:|---|---|---:|---:|---:|---|---|---:|---|")
    for r in rows:
        ms = r["ms"]
        lo, hi = r["speedup_iqr"]
        print(f"| {r['batch']} | {r['threads']} | {r['clock']} | {ms['source']:.4g} | "
              f"{ms['pruned']:.4g} | {ms['emitted']:.4g} | {r['speedup']:.2f}x ({lo:.2f}–"
              f"{hi:.2f}) | {', '.join(f'{s:.2f}' for s in r['speedup_runs'])}"
              f" | **{r['speedup'] * ratio:.2f}** | {r['fold_gain']:.3f} "
              f"({r['fold_gain_iqr'][0]:.3f}–{r['fold_gain_iqr'][1]:.3f}) |")


def print_profile(prof: dict) -> None:
    total = prof["total_us"]
    print(f"\nORT node times, batch 32, 1 thread (µs per run): total {total['source']:.0f} -> "
          f"{total['emitted']:.0f}; outside convs {prof['other_us']['source']:.0f} -> "
          f"{prof['other_us']['emitted']:.0f} ({', '.join(prof['other_ops'])})")
    print("| conv | out channels | µs source | µs emitted | time ratio | share of source |\n"
          "|---|---|---:|---:|---:|---:|")
    for r in prof["convs"]:
        width = "kept" if r["width"] is None else f"{r['width'][0]} → {r['width'][1]}"
        print(f"| {r['conv']} | {width} | {r['source']:.0f} | {r['emitted']:.0f} | "
              f"{r['emitted'] / max(r['source'], 1e-9):.2f} | "
              f"{r['source'] / total['source']:.1%} |")


def input_shape(model) -> tuple:
    """The per-sample shape of the model's first input (its fixed dimensions)."""
    dims = model.graph.input[0].type.tensor_type.shape.dim[1:]
    return tuple(d.dim_value for d in dims)


def images(n: int, shape: tuple = (1, 28, 28)) -> np.ndarray:
    """Real Fashion-MNIST test images for a 1×28×28 input, random ones otherwise (latency
    does not depend on the values)."""
    if shape == (1, 28, 28):
        try:
            from bench_core import load_fashion_mnist_test

            x, _ = load_fashion_mnist_test(n)
            return x[:, None] if x.ndim == 3 else x
        except (OSError, ImportError):
            pass
    return np.random.default_rng(0).random((n, *shape), dtype=np.float32)


def _check_folded(result: dict, x: np.ndarray) -> None:
    """Consistency: the emitted (folded, cleaned) model computes the BN-kept pruned one."""
    name = result["models"]["source"].graph.input[0].name
    a = session(result["models"]["pruned"], 1).run(None, {name: x})[0]
    b = session(result["models"]["emitted"], 1).run(None, {name: x})[0]
    diff = float(np.abs(a - b).max() / (np.abs(a).max() + 1e-12))
    if not diff <= 1e-4:
        raise SystemExit(f"CONSISTENCY CHECK FAILED: folded model differs by {diff:.3g}")
    print(f"check ok: emitted model equals the BN-kept pruned model (max rel |Δ| {diff:.2g})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--arch", choices=["resnet18"], default=None)
    parser.add_argument("--width-scale", type=float, default=1.0)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--round-to", default="auto", help="N, auto, or none")
    parser.add_argument("--threads", default="1,0",
                        type=lambda s: [int(t) for t in s.split(",")])
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="Time per run and (threads, batch) setting.")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    parser.add_argument("--smoke", action="store_true",
                        help="Seconds: one run of short blocks at 1 thread (CI checks it runs).")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.seconds, args.threads = 1, 0.2, [1]
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(ROOT / "models/sample/model.onnx")
        if args.arch:
            path = str(build_resnet(args.width_scale, Path(tmp) / "resnet18.onnx"))
        name = f"{args.arch} ×{args.width_scale:g}" if args.arch else Path(path).name
        result = prune(path, args.ratio, None if args.round_to == "none" else args.round_to)
    x = images(32, input_shape(result["models"]["source"]))
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"{platform.platform()}, onnxruntime {ort.__version__}, load average "
          f"{' '.join(load)} at start")
    _check_folded(result, x)
    rows = measure(result["models"], x, args)
    print_summary(f"{name}, ratio {args.ratio}, --round-to {args.round_to}", result, rows)
    prof = profile(result, x) if args.profile else None
    if prof:
        print_profile(prof)
    if args.json:
        rec = result["record"]
        Path(args.json).write_text(json.dumps({
            "model": name, "ratio": args.ratio, "round_to": args.round_to, "rows": rows,
            "flops": [rec.flops_before, rec.flops_after], "profile": prof,
            "params": [rec.params_before, rec.params_after], "load_average": load,
            "optimization": result["optimization"].to_dict()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
