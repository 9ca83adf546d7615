#!/usr/bin/env python3
"""Build the bundled transformer sample: a small Vision Transformer trained on real Fashion-MNIST.

    python tools/make_vit_sample.py --out models/vit

writes (models/README.md describes each file):

    OUT/checkpoints/ckpt_000.onnx ...   one ONNX export per checkpoint, in training order
    OUT/checkpoints/checkpoints.json    step, epoch, train / test accuracy of every checkpoint
    OUT/model.onnx                      copy of the last checkpoint
    OUT/manifest.json                   hyper-parameters, seeds, export settings, results

The protocol is the CNN sample's (tools/make_sample.py), so the two can be compared: the same
5,000-image training subset of the 60k training file with the same 40 % of its labels
corrupted, a constant learning rate and enough epochs to memorise the noise, so test accuracy
peaks and then falls. The CNN sample's ``calib.npz`` (1,000 held-out training images) and
``eval.npz`` (2,000 test images) are the calibration and evaluation sets of this model too:
``--data models/sample/calib.npz --eval-data models/sample/eval.npz``.

The transformer is written out in plain torch so that the export shows every linear layer as
a MatMul with a constant weight: patch embedding (a 7×7 stride-7 conv, 16 patches), a class
token and learned position embeddings, ``--depth`` pre-norm blocks (LayerNorm, multi-head
self-attention with separate query/key/value projections and an output projection,
LayerNorm, a GELU MLP), a final LayerNorm, the class token picked by Gather, and a linear head.
Deterministic for a given ``--seed``, torch version and thread count. Data: the Debian package
``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_sample as cnn  # noqa: E402  (shared data reading, splits, evaluation)

DEFAULT_CKPT_EPOCHS = "0.5,1,2,3,5,8,12,16,20,25,30"
ARCHITECTURE = ("(x - mean) / std; patch embedding Conv7x7/7 (1->D, 16 patches) + class token + "
                "learned positions (17 tokens); DEPTH pre-norm blocks: x + Attn(LN(x)), "
                "x + MLP(LN(x)) with Attn = HEADS-head softmax(QK^T/sqrt(d))V with separate "
                "Q, K, V, O linear maps and MLP = Linear(D->M), GELU, Linear(M->D); final LN; "
                "class token (Gather); Linear(D->10).")


def build_model(dim: int, depth: int, heads: int, mlp: int):
    """The ViT as a torch module (see ARCHITECTURE)."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads, self.head_dim = heads, dim // heads
            self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
            self.out = nn.Linear(dim, dim)

        def forward(self, x):
            b, n, _ = x.shape

            def split(t):  # (b, n, dim) -> (b, heads, n, head_dim)
                return t.reshape(b, n, self.heads, self.head_dim).transpose(1, 2)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), dim=-1)
            return self.out((att @ v).transpose(1, 2).reshape(b, n, dim))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.attn = nn.LayerNorm(dim), Attention()
            self.norm2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.tensor(cnn.PIXEL_MEAN))
            self.register_buffer("std", torch.tensor(cnn.PIXEL_STD))
            self.patch = nn.Conv2d(1, dim, kernel_size=7, stride=7)
            self.cls = nn.Parameter(torch.zeros(1, 1, dim))
            self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
            self.blocks = nn.Sequential(*(Block() for _ in range(depth)))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, cnn.N_CLASSES)

        def forward(self, x):
            x = self.patch((x - self.mean) / self.std).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
            x = self.norm(self.blocks(x))
            return self.head(x[:, 0])

    return ViT()


def export_vit(model, path: Path, opset: int, meta: dict[str, str]) -> None:
    """TorchScript export (readable node names), batch dynamic; written to a temporary name,
    then renamed."""
    import onnx
    import torch

    model.eval()
    tmp = path.with_name(path.name + ".tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, 1, 28, 28),), str(tmp), dynamo=False,
                          opset_version=opset, training=torch.onnx.TrainingMode.EVAL,
                          do_constant_folding=True, input_names=["input"],
                          output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    proto = onnx.load(str(tmp))
    cnn.undo_initializer_dedup(proto)
    proto.graph.name = "onnxdiag_sample_vit"
    proto.doc_string = ("onnxdiag transformer sample: ViT on Fashion-MNIST; input float32 "
                        "(N,1,28,28) in [0,1]; output logits (N,10). Made by "
                        "tools/make_vit_sample.py.")
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, str(value)
    onnx.save(proto, str(tmp))
    os.replace(tmp, path)


def verify(path: Path, model, x: np.ndarray, tol: float = 1e-4) -> float:
    """Full checker; ONNX Runtime equals torch on ``x`` and on one image; max |diff|."""
    import onnx

    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    return cnn.ort_matches_torch(path, model, x, tol)


def train(args, data: dict, out: Path) -> list[dict]:
    """Train, exporting a checkpoint at each scheduled step; returns the checkpoint records."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(args.seed)
    model = build_model(args.dim, args.depth, args.heads, args.mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    x, y = data["x_train"], data["y_train_noisy"]
    steps_per_epoch = -(-len(x) // args.batch)
    total = int(round(args.epochs * steps_per_epoch))
    save_at = cnn.checkpoint_steps(args.ckpt_epochs, steps_per_epoch, total)
    gen = torch.Generator().manual_seed(args.seed)
    records, step, order = [], 0, None
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    while True:
        if step in save_at:
            records.append(save_checkpoint(args, model, data, ckpt_dir, step, steps_per_epoch,
                                           len(records)))
        if step >= total:
            return records
        pos = step % steps_per_epoch
        if pos == 0:
            order = torch.randperm(len(x), generator=gen)
        idx = order[pos * args.batch:(pos + 1) * args.batch]
        model.train()
        loss = F.cross_entropy(model(torch.from_numpy(x[idx.numpy()])),
                               torch.from_numpy(y[idx.numpy()]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1


def save_checkpoint(args, model, data, folder: Path, step: int, steps_per_epoch: int,
                    index: int) -> dict:
    epoch = step / steps_per_epoch
    path = folder / f"ckpt_{index:03d}.onnx"
    export_vit(model, path, args.opset, {"onnxdiag.sample.step": step,
                                         "onnxdiag.sample.epoch": f"{epoch:g}"})
    diff = verify(path, model, data["x_eval"][:64])
    rec = {"path": f"checkpoints/{path.name}", "step": step, "epoch": round(epoch, 4),
           "ort_vs_torch_max_abs": diff}
    for name, (xs, ys) in {"train_noisy": (data["x_train"], data["y_train_noisy"]),
                           "train": (data["x_train"], data["y_train"]),
                           "test": (data["x_test"], data["y_test"]),
                           "eval": (data["x_eval"], data["y_eval"])}.items():
        acc, loss = cnn.evaluate(model, xs, ys)
        rec[f"{name}_acc"], rec[f"{name}_loss"] = round(acc, 3), round(loss, 5)
    print(f"ckpt {index:2d} step {step:5d} epoch {epoch:6.2f}: test {rec['test_acc']:.2f} % "
          f"(train noisy {rec['train_noisy_acc']:.1f} %)", flush=True)
    return rec


def load_data(args) -> dict:
    """The CNN sample's splits (same seeds): training subset with noisy labels, test set, and
    the sample's eval subset for the ORT check."""
    raw = cnn.load_fashion_mnist(Path(args.data_dir))
    split_args = argparse.Namespace(seed=args.split_seed, n_train=args.n_train,
                                    n_calib=args.n_calib, n_eval=args.n_eval)
    splits = cnn.make_splits(len(raw["train_images"]), len(raw["t10k_images"]), split_args)
    y_train = raw["train_labels"][splits["train"]].astype(np.int64)
    noisy = cnn.corrupt_labels(y_train, args.noise, args.split_seed + 2)
    return {"x_train": cnn.to_input(raw["train_images"][splits["train"]]), "y_train": y_train,
            "y_train_noisy": noisy,
            "x_test": cnn.to_input(raw["t10k_images"]),
            "y_test": raw["t10k_labels"].astype(np.int64),
            "x_eval": cnn.to_input(raw["t10k_images"][splits["eval"]]),
            "y_eval": raw["t10k_labels"][splits["eval"]].astype(np.int64)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="models/vit")
    p.add_argument("--data-dir", default=str(cnn.DATA_DIR))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=48)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=96)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=float, default=30)
    p.add_argument("--ckpt-epochs", default=DEFAULT_CKPT_EPOCHS)
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--threads", type=int, default=2)
    # the CNN sample's split and noise settings (make_sample.py defaults)
    p.add_argument("--n-train", type=int, default=5000)
    p.add_argument("--n-calib", type=int, default=1000)
    p.add_argument("--n-eval", type=int, default=2000)
    p.add_argument("--split-seed", type=int, default=0,
                   help="seed of the CNN sample's splits (eval subset seed + 1, noise seed + 2)")
    p.add_argument("--noise", type=float, default=0.4)
    p.add_argument("--overwrite", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        sys.exit(f"error: {out} exists; pass --overwrite to rebuild it")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()
    data = load_data(args)
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    records = train(args, data, tmp)
    cnn.save_json(tmp / "checkpoints" / "checkpoints.json", records)
    shutil.copyfile(tmp / records[-1]["path"], tmp / "model.onnx")
    best = max(records, key=lambda r: r["test_acc"])
    manifest = {"tool": "tools/make_vit_sample.py", "argv": sys.argv[1:] if argv is None else argv,
                "args": vars(args), "architecture": ARCHITECTURE,
                "n_params": sum(p.numel() for p in build_model(
                    args.dim, args.depth, args.heads, args.mlp).parameters()),
                "data": "CNN sample splits (tools/make_sample.py): calib = "
                        "models/sample/calib.npz, eval = models/sample/eval.npz",
                "torch": torch.__version__, "best": best, "last": records[-1],
                "seconds": round(time.time() - t0, 1)}
    cnn.save_json(tmp / "manifest.json", manifest, indent=2)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"best test {best['test_acc']:.2f} % at ckpt {records.index(best)}, last "
          f"{records[-1]['test_acc']:.2f} %; {manifest['seconds']} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
