#!/usr/bin/env python3
"""Unstructured pruning: label-free repairs next to labelled fine-tuning (docs/METHODS.md §C1,
§E1, §B6 "Recovery").

    python benchmarks/bench_finetune_sparse.py [--models cnn,folded,vit]
        [--sparsity 0.5,0.7,0.8,0.9] [--limit 512] [--epochs 1] [--max-batches 50]
        [--lr 1e-4] [--smoke]

Run it in the ONNX Runtime training environment (the ``[training]`` extra): for every model
and sparsity S it prunes with ERK through ``onnxdiag prune`` (``--repair none`` and ``ls``,
repairs on the first ``--limit`` calibration images, labels never read), fine-tunes the
unrepaired and the LS-repaired model on the labelled calibration images (Adam, ``--lr``,
``--epochs`` of at most ``--max-batches`` batches of 64; zero weights kept at zero after
every step, so the sparsity stays S: checked), and prints top-1 % on ``eval.npz``. Models:
``cnn`` = models/sample/model.onnx, ``folded`` = the same with every Conv+BN folded,
``vit`` = models/vit/model.onnx. ``--smoke``: one model, one sparsity, 64 evaluation images,
one step (what CI runs).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SAMPLE = ROOT / "models" / "sample"
MODELS = {"cnn": SAMPLE / "model.onnx", "folded": SAMPLE / "model.onnx",
          "vit": ROOT / "models" / "vit" / "model.onnx"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,folded,vit")
    ap.add_argument("--sparsity", default="0.5,0.7,0.8,0.9")
    ap.add_argument("--limit", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-batches", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-limit", type=int, default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.sparsity, args.limit = "folded", "0.8", 64
        args.max_batches, args.eval_limit = 1, 64
    return args


def _model_file(name: str, folder: Path) -> Path:
    """The model file of ``name`` (the BN-folded export written into ``folder``)."""
    if name != "folded":
        return MODELS[name]
    from onnxdiag.model.io import load_model, save_model
    from onnxdiag.model.optimize import optimize_for_inference

    path = folder / "sample_folded.onnx"
    save_model(optimize_for_inference(load_model(MODELS[name]))[0], path)
    return path


def _prune(model: Path, sparsity: float, repair: str, limit: int, out: Path) -> Path:
    """``onnxdiag prune`` with ERK in a fresh process; the emitted model."""
    output = out / f"s{sparsity}_{repair}.onnx"
    cmd = [sys.executable, "-m", "onnxdiag", "prune", str(model), "-o", str(output),
           "--sparsity", str(sparsity), "--allocation", "erk", "--repair", repair,
           "--data", str(SAMPLE / "calib.npz"), "--limit", str(limit),
           "--out", str(out / f"report_s{sparsity}_{repair}"), "--format", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return output


def _zeros(model) -> int:
    """Exactly-zero entries of the prunable weights."""
    from onnxdiag.graph import analyze_structure
    from onnxdiag.sparsity.masks import find_prunable, read_weights

    weights = read_weights(model, find_prunable(analyze_structure(model)))
    return int(sum(int((w == 0).sum()) for w in weights.values()))


def _row(name, model_path, s, args, sources, folder) -> dict:
    """Top-1 % of none / ls / finetune / ls+finetune at sparsity ``s``."""
    from onnxdiag.evaluate import evaluate
    from onnxdiag.finetune import FinetuneSettings, finetune_model
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import load_model

    train, evaluation = sources
    settings = FinetuneSettings(epochs=args.epochs, max_batches=args.max_batches, lr=args.lr,
                                optimizer="adam", keep_zeros=True)
    row = {}
    for repair in ("none", "ls"):
        pruned = load_model(_prune(model_path, s, repair, args.limit, folder))
        head = analyze_structure(pruned).head
        row[repair] = 100 * evaluate(pruned, head, evaluation).accuracy
        tuned, record = finetune_model(pruned, train, settings)
        if _zeros(tuned) < _zeros(pruned):
            raise SystemExit(f"{name} S={s} {repair}: fine-tuning lost zero weights")
        key = "finetune" if repair == "none" else "ls+finetune"
        row[key] = 100 * evaluate(tuned, head, evaluation).accuracy
        row[f"{key} steps"] = record.steps
    return row


def main(argv=None) -> int:
    from onnxdiag.data.source import open_data
    from onnxdiag.evaluate import evaluate
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model

    args = parse_args(argv)
    sparsities = [float(v) for v in args.sparsity.split(",")]
    print(f"Machine: {platform.processor() or platform.machine()}, date "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; ERK; repairs on "
          f"{args.limit} calibration images; fine-tuning {args.epochs} epoch(s) of ≤ "
          f"{args.max_batches} batches of 64, Adam lr {args.lr}, zeros kept")
    print("\n| model | S | dense | none | ls | finetune | ls+finetune |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="bench-ft-sparse-") as tmp:
        folder = Path(tmp)
        for name in args.models.split(","):
            (folder / name).mkdir()
            path = _model_file(name, folder / name)
            specs = get_input_specs(load_model(path))
            train = open_data(str(SAMPLE / "calib.npz"), specs, batch_size=64)
            evaluation = open_data(str(SAMPLE / "eval.npz"), specs, batch_size=256,
                                   limit=args.eval_limit)
            model = load_model(path)
            dense = 100 * evaluate(model, analyze_structure(model).head, evaluation).accuracy
            for s in sparsities:
                r = _row(name, path, s, args, (train, evaluation), folder / name)
                print(f"| {name} | {s} | {dense:.2f} | {r['none']:.2f} | {r['ls']:.2f} | "
                      f"{r['finetune']:.2f} | {r['ls+finetune']:.2f} |", flush=True)
    print("\ncheck ok: every fine-tuned model kept all of its pruned model's zero weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
