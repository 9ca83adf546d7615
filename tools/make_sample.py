#!/usr/bin/env python3
"""Build the bundled onnxdiag sample: a small residual CNN trained on real Fashion-MNIST.

    python tools/make_sample.py --out models/sample

writes (models/README.md describes each file):

    OUT/checkpoints/ckpt_000.onnx ...   one ONNX export per checkpoint, in training order
    OUT/checkpoints/checkpoints.json    step, epoch, train / test accuracy of every checkpoint
    OUT/model.onnx                      copy of the last checkpoint
    OUT/calib.npz                       held-out TRAINING images + true labels (probe set)
    OUT/eval.npz                        fixed seeded subset of the TEST set + labels
    OUT/indices.json                    source indices of every split + the noisy labels
    OUT/manifest.json                   hyper-parameters, seeds, export settings, results

The schedule makes the best checkpoint NOT the last one: a training subset with a fraction of its
labels corrupted, a constant learning rate, and enough epochs for the network to memorise the
noise, so test accuracy peaks and then falls.  The script checks the fall (``--min-gap``
percentage points between best and last) and exits with status 2 when it is smaller.

Every checkpoint is exported with its BatchNormalization nodes KEPT (the default exporters fold BN
into the convolutions), checked with ``onnx.checker.check_model(full_check=True)`` and compared
with torch through ONNX Runtime.  Deterministic for a given ``--seed``, torch version and thread
count.  Data: the Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
# Fashion-MNIST training-set pixel statistics of x in [0, 1]; applied inside the model (Sub, Div).
PIXEL_MEAN = 0.2860
PIXEL_STD = 0.3530
N_CLASSES = 10
CLASS_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
DEFAULT_CKPT_EPOCHS = "0.25,0.5,1,2,3,5,7,9,11,13,16,20,25,30,40"
ARCHITECTURE = ("(x - mean) / std; stem conv3x3(1->w0)+BN+ReLU+MaxPool2x2; block(w0); "
                "block(w0->w1, stride 2, 1x1 conv+BN projection shortcut); block(w1); "
                "global average pool; flatten; Linear(w1->10). block = conv3x3+BN+ReLU, "
                "conv3x3+BN, Add(shortcut), ReLU. Convs have no bias.")


# --------------------------------------------------------------------------------------------- data

def read_idx(path: Path) -> np.ndarray:
    """Parse a gzipped IDX file (unsigned-byte data only, as used by (Fashion-)MNIST)."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = raw[0:2], raw[2], raw[3]
    if zero != b"\x00\x00" or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (header {raw[:4]!r})")
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(dims):
        raise ValueError(f"{path}: header says {dims}, found {data.size} bytes")
    return data.reshape(dims)


def load_fashion_mnist(data_dir: Path) -> dict[str, np.ndarray]:
    """Return uint8 images (N, 28, 28) and int64 labels for the train and t10k splits."""
    out = {}
    for split in ("train", "t10k"):
        paths = {kind: data_dir / f"{split}-{kind}-ubyte.gz"
                 for kind in ("images-idx3", "labels-idx1")}
        missing = [str(p) for p in paths.values() if not p.is_file()]
        if missing:
            sys.exit(f"error: Fashion-MNIST file(s) not found: {', '.join(missing)}.\n"
                     f"Install them with `apt-get install dataset-fashion-mnist` "
                     f"or pass --data-dir DIR holding the four *-ubyte.gz files.")
        out[f"{split}_images"] = read_idx(paths["images-idx3"])
        out[f"{split}_labels"] = read_idx(paths["labels-idx1"]).astype(np.int64)
    return out


def to_input(images_u8: np.ndarray) -> np.ndarray:
    """uint8 (N, 28, 28) -> float32 (N, 1, 28, 28) in [0, 1], the model's input convention."""
    return (images_u8.astype(np.float32) / 255.0)[:, None, :, :]


def make_splits(n_train_total: int, n_test_total: int, args) -> dict[str, np.ndarray]:
    """Disjoint train / calib indices into the training file; eval indices into the test file."""
    if args.n_train + args.n_calib > n_train_total:
        sys.exit(f"error: --n-train + --n-calib = {args.n_train + args.n_calib} > {n_train_total}")
    perm = np.random.default_rng(args.seed).permutation(n_train_total)
    train = np.sort(perm[: args.n_train])
    calib = np.sort(perm[args.n_train: args.n_train + args.n_calib])
    rng_eval = np.random.default_rng(args.seed + 1)
    evl = np.sort(rng_eval.choice(n_test_total, args.n_eval, replace=False))
    return {"train": train, "calib": calib, "eval": evl}


def corrupt_labels(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Replace round(fraction·N) labels, chosen at random, by a uniformly random OTHER class."""
    rng = np.random.default_rng(seed)
    noisy = labels.copy()
    flip = rng.choice(len(labels), int(round(fraction * len(labels))), replace=False)
    noisy[flip] = (labels[flip] + rng.integers(1, N_CLASSES, size=len(flip))) % N_CLASSES
    return noisy


# -------------------------------------------------------------------------------------------- model

def basic_block():
    """The ResNet basic block class (conv-BN-ReLU, conv-BN, + identity or a 1×1 projection
    shortcut with BN, ReLU), shared with tools/train_zoo.py; torch is imported here."""
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, c_in: int, c_out: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(c_out)
            self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(c_out)
            self.shortcut = None
            if stride != 1 or c_in != c_out:  # 1x1 projection shortcut
                self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, 0, bias=False),
                                              nn.BatchNorm2d(c_out))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            s = x if self.shortcut is None else self.shortcut(x)
            return torch.relu(y + s)

    return BasicBlock


def build_model(widths: tuple[int, int]):
    """The residual CNN described by ARCHITECTURE; input (N, 1, 28, 28) in [0, 1], logits out."""
    import torch
    from torch import nn

    BasicBlock = basic_block()

    class SampleNet(nn.Module):
        def __init__(self):
            super().__init__()
            w0, w1 = widths
            self.register_buffer("pixel_mean", torch.full((1, 1, 1, 1), PIXEL_MEAN))
            self.register_buffer("pixel_std", torch.full((1, 1, 1, 1), PIXEL_STD))
            # ResNet-style stem pooling (28 -> 14): without it the net sees too little of the
            # garment before pooling, tops out near 80 % clean accuracy and never memorises.
            self.stem = nn.Sequential(nn.Conv2d(1, w0, 3, 1, 1, bias=False), nn.BatchNorm2d(w0),
                                      nn.ReLU(), nn.MaxPool2d(2))
            self.block1 = BasicBlock(w0, w0, 1)
            self.block2 = BasicBlock(w0, w1, 2)
            self.block3 = BasicBlock(w1, w1, 1)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(w1, N_CLASSES)

        def forward(self, x):
            x = (x - self.pixel_mean) / self.pixel_std
            x = self.block3(self.block2(self.block1(self.stem(x))))
            return self.fc(torch.flatten(self.pool(x), 1))

    return SampleNet()


def precise_bn_copy(model, x: np.ndarray, batch: int = 500):
    """A copy of `model` whose BN running statistics are recomputed over `x` (never modifies
    `model`): the cumulative average of per-batch statistics in train mode ("precise BN").

    The running averages that torch keeps during training lag the weights; with Adam and noisy
    labels that lag moves eval-mode test accuracy by up to ~25 pp from one checkpoint to the next,
    noise that has nothing to do with the quality of the weights.
    """
    import torch

    snap = copy.deepcopy(model)
    for m in snap.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative moving average
    snap.train()
    with torch.no_grad():
        for i in range(0, len(x), batch):
            snap(torch.from_numpy(x[i:i + batch]))
    return snap.eval()


# ------------------------------------------------------------------------------------------- export

def export_settings(opset: int) -> dict:
    """The torch.onnx.export settings that keep BatchNormalization nodes (for the manifest)."""
    return {"exporter": "torchscript (legacy)", "dynamo": False, "opset_version": opset,
            "training": "torch.onnx.TrainingMode.EVAL (model.eval())",
            "do_constant_folding": False,
            "dynamic_axes": {"input": {"0": "batch"}, "logits": {"0": "batch"}},
            "input_names": ["input"], "output_names": ["logits"], "batchnorm_kept": True,
            "post_processing": "Identity(initializer) nodes left by the exporter's initializer "
                               "de-duplication replaced by plain initializers"}


def undo_initializer_dedup(proto) -> int:
    """Turn ``Identity(initializer)`` nodes back into initializers of their own; returns how many.

    The TorchScript exporter de-duplicates initializers with equal values (at step 0 every BN's
    weight/running_var is ones and bias/running_mean zeros; later the two BN biases summed by the
    projection block's Add stay equal for ever because they receive the same gradient) and feeds
    the duplicates through Identity nodes.  Valid ONNX, but a sample in which every BN parameter is
    a plain initializer is easier to read and to edit layer by layer.
    """
    import onnx
    from onnx import numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    keep = []
    for node in proto.graph.node:
        if node.op_type == "Identity" and node.input[0] in inits:
            arr = numpy_helper.to_array(inits[node.input[0]])
            proto.graph.initializer.append(numpy_helper.from_array(arr.copy(), node.output[0]))
        else:
            keep.append(node)
    n_undone = len(proto.graph.node) - len(keep)
    del proto.graph.node[:]
    proto.graph.node.extend(keep)
    onnx.checker.check_model(proto)
    return n_undone


SAMPLE_DOC = ("onnxdiag sample: residual CNN on Fashion-MNIST; input float32 (N,1,28,28) in [0,1] "
              f"(normalised inside: (x-{PIXEL_MEAN})/{PIXEL_STD}); output logits (N,10). "
              "Made by tools/make_sample.py.")


def export_onnx(model, path: Path, opset: int, meta: dict[str, str], *,
                graph_name: str = "onnxdiag_sample_resnet", doc: str = SAMPLE_DOC,
                fold_bn: bool = False) -> None:
    """Export `model` (in eval mode) with BN kept (or folded into the convs with `fold_bn`);
    written to a temporary name, then renamed."""
    import onnx
    import torch

    model.eval()
    tmp = path.with_name(path.name + ".tmp")
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated since torch 2.9 but is the one that keeps BN
        # unfused with readable node names; silence its deprecation chatter.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (torch.zeros(1, 1, 28, 28),), str(tmp), dynamo=False, opset_version=opset,
            training=torch.onnx.TrainingMode.EVAL, do_constant_folding=fold_bn,
            input_names=["input"], output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    proto = onnx.load(str(tmp))
    undo_initializer_dedup(proto)
    proto.graph.name = graph_name
    proto.doc_string = doc
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, str(value)
    onnx.save(proto, str(tmp))
    os.replace(tmp, path)


def verify_onnx(path: Path, model, x: np.ndarray, n_bn: int, tol: float = 1e-4) -> float:
    """full_check, BN present, no Identity, ORT == torch for len(x) and 1 image; max |diff|."""
    import onnx

    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    if "Identity" in ops:
        raise RuntimeError(f"{path}: Identity nodes left after undo_initializer_dedup")
    if ops.count("BatchNormalization") != n_bn:
        raise RuntimeError(f"{path}: expected {n_bn} BatchNormalization nodes, found "
                           f"{ops.count('BatchNormalization')} (BN was folded?)")
    return ort_matches_torch(path, model, x, tol)


def ort_matches_torch(path: Path, model, x: np.ndarray, tol: float = 1e-4) -> float:
    """ONNX Runtime's ``logits`` of the exported ``path`` equal torch ``model``'s on ``x`` and
    on its first image alone (the batch axis is dynamic); the max |diff| (raises above tol)."""
    import onnxruntime as ort
    import torch

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ref = model.eval()(torch.from_numpy(x)).numpy()
    got = sess.run(["logits"], {"input": x})[0]
    one = sess.run(["logits"], {"input": x[:1]})[0]
    diff = max(float(np.abs(got - ref).max()), float(np.abs(one - ref[:1]).max()))
    if diff > tol:
        raise RuntimeError(f"{path}: ONNX Runtime differs from torch by {diff:.3g} > {tol}")
    return diff


# ----------------------------------------------------------------------------------------- training

def evaluate(model, x: np.ndarray, y: np.ndarray, batch: int = 1000) -> tuple[float, float]:
    """Top-1 accuracy (%) and mean cross-entropy in eval mode."""
    import torch
    import torch.nn.functional as F

    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            xb, yb = torch.from_numpy(x[i:i + batch]), torch.from_numpy(y[i:i + batch])
            logits = model(xb)
            correct += int((logits.argmax(1) == yb).sum())
            loss += float(F.cross_entropy(logits, yb, reduction="sum"))
    return 100.0 * correct / len(x), loss / len(x)


def checkpoint_steps(epochs_csv: str, steps_per_epoch: int, total_steps: int) -> list[int]:
    """Optimizer steps at which to save: step 0 plus round(epoch · steps_per_epoch) for each."""
    epochs = [float(e) for e in epochs_csv.split(",") if e.strip()]
    steps = sorted({0} | {int(round(e * steps_per_epoch)) for e in epochs})
    if steps[-1] > total_steps:
        sys.exit(f"error: checkpoint at step {steps[-1]} is beyond training ({total_steps} steps)")
    return steps


def make_optimizer(args, params):
    import torch

    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)
    return torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)


def train(args, data: dict, out: Path) -> list[dict]:
    """Train with a constant learning rate, exporting and verifying each checkpoint on the way."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    model = build_model((args.width, args.width2))
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters ({4 * n_params / 1024:.0f} KiB float32), "
          f"{n_bn} BatchNorm layers")
    opt = make_optimizer(args, model.parameters())

    xtr, ytr_true, ytr_noisy = data["x_train"], data["y_train"], data["y_train_noisy"]
    xte, yte = data["x_test"], data["y_test"]
    x_check = data["x_eval"][:64]
    steps_per_epoch = math.ceil(len(xtr) / args.batch_size)
    total_steps = int(round(args.epochs * steps_per_epoch))
    ckpt_steps = checkpoint_steps(args.checkpoint_epochs, steps_per_epoch, total_steps)
    print(f"training: {len(xtr)} images, {steps_per_epoch} steps/epoch, {total_steps} steps, "
          f"checkpoints at steps {ckpt_steps}")

    ckpt_dir = out / "checkpoints"
    records: list[dict] = []
    gen = torch.Generator().manual_seed(args.seed)
    xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr_noisy)
    step, t0 = 0, time.time()

    def save_checkpoint():
        # Measure and export a snapshot so that training itself is untouched.
        snap = precise_bn_copy(model, xtr) if args.bn_stats == "precise" else copy.deepcopy(model)
        tr_acc, _ = evaluate(snap, xtr, ytr_true)
        tr_acc_noisy, tr_loss_noisy = evaluate(snap, xtr, ytr_noisy)
        te_acc, te_loss = evaluate(snap, xte, yte)
        ev_acc, ev_loss = evaluate(snap, data["x_eval"], data["y_eval"])
        epoch = step / steps_per_epoch
        name = f"ckpt_{len(records):03d}.onnx"
        export_onnx(snap, ckpt_dir / name, args.opset,
                    {"onnxdiag.sample.step": str(step), "onnxdiag.sample.epoch": f"{epoch:.4g}"})
        diff = verify_onnx(ckpt_dir / name, snap, x_check, n_bn)
        records.append({"path": name, "step": step, "epoch": round(epoch, 4),
                        "train_acc": round(tr_acc, 2), "train_acc_noisy": round(tr_acc_noisy, 2),
                        "train_loss_noisy": round(tr_loss_noisy, 4),
                        "test_acc": round(te_acc, 2), "test_loss": round(te_loss, 4),
                        "eval_acc": round(ev_acc, 2), "eval_loss": round(ev_loss, 4)})
        print(f"  [{time.time() - t0:6.1f}s] {name} step {step:5d} epoch {epoch:6.2f}  "
              f"train {tr_acc:5.2f}%  train(noisy) {tr_acc_noisy:5.2f}%  test {te_acc:5.2f}% "
              f"(loss {te_loss:.3f})  ort-vs-torch {diff:.1e}", flush=True)

    save_checkpoint()
    model.train()
    while step < total_steps:
        order = torch.randperm(len(xtr), generator=gen)
        for i in range(0, len(xtr), args.batch_size):
            idx = order[i:i + args.batch_size]
            loss = F.cross_entropy(model(xtr_t[idx]), ytr_t[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step in ckpt_steps:
                save_checkpoint()
            if step >= total_steps:
                break
    return records


# --------------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("models/sample"), help="output folder")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for splits, label noise, init and batch order")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR,
                   help="folder with the four Fashion-MNIST *-ubyte.gz files")
    p.add_argument("--n-train", type=int, default=5000, help="training images used (of 60k)")
    p.add_argument("--n-calib", type=int, default=1000,
                   help="held-out training images for calib.npz")
    p.add_argument("--n-eval", type=int, default=2000, help="test images for eval.npz")
    p.add_argument("--noise", type=float, default=0.4, help="fraction of training labels corrupted")
    p.add_argument("--epochs", type=float, default=40, help="training epochs")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--lr", type=float, default=5e-4, help="constant learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--width", type=int, default=16, help="channels of stem and first block")
    p.add_argument("--width2", type=int, default=32, help="channels after the downsampling block")
    p.add_argument("--bn-stats", choices=["precise", "ema"], default="precise",
                   help="BN running statistics in the exported checkpoints: recomputed over the "
                        "training subset (precise) or torch's running averages (ema)")
    p.add_argument("--checkpoint-epochs", default=DEFAULT_CKPT_EPOCHS,
                   help="comma-separated epochs at which to save (step 0 is always saved)")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--min-gap", type=float, default=2.0,
                   help="required drop (pp) from best to last test accuracy; exit 2 if smaller")
    return p.parse_args(argv)


def save_npz(path: Path, **arrays) -> None:
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def save_json(path: Path, obj, indent: int | None = 1) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent) + "\n")
    os.replace(tmp, path)


def build_manifest(args, argv, records: list[dict], ops: list[str], runtime: float) -> dict:
    import onnx
    import onnxruntime
    import torch

    best = max(records, key=lambda r: r["test_acc"])
    last = records[-1]
    cmd_args = sys.argv[1:] if argv is None else list(argv)
    return {
        "description": "Residual CNN on Fashion-MNIST trained with label noise so that test "
                       "accuracy peaks before the last checkpoint; made by tools/make_sample.py",
        "command": " ".join(["python tools/make_sample.py", *cmd_args]),
        "seed": args.seed,
        "seeds": {"train_calib_permutation": args.seed, "eval_subset": args.seed + 1,
                  "label_corruption": args.seed + 2, "torch_init_and_batch_order": args.seed},
        "data": {"source": str(args.data_dir), "n_train": args.n_train, "n_calib": args.n_calib,
                 "n_eval": args.n_eval, "n_test_for_test_acc": 10000,
                 "label_noise_fraction": args.noise,
                 "label_noise": "uniformly random other class (never the true one)",
                 "calib_from": "training file, disjoint from the training subset",
                 "eval_from": "test file (t10k), seeded subset", "class_names": CLASS_NAMES},
        "input": {"name": "input", "shape": ["batch", 1, 28, 28], "dtype": "float32",
                  "range": [0.0, 1.0],
                  "normalisation": f"inside the model: (x - {PIXEL_MEAN}) / {PIXEL_STD}"},
        "output": {"name": "logits", "shape": ["batch", N_CLASSES], "softmax": False},
        "architecture": {"widths": [args.width, args.width2], "layers": ARCHITECTURE,
                         "n_parameters": sum(p.numel() for p in
                                             build_model((args.width, args.width2)).parameters())},
        "training": {"optimizer": args.optimizer, "lr": args.lr, "lr_schedule": "constant",
                     "weight_decay": args.weight_decay, "batch_size": args.batch_size,
                     "epochs": args.epochs, "augmentation": None,
                     "checkpoint_epochs": [0.0] + [float(e) for e in
                                                   args.checkpoint_epochs.split(",")],
                     "bn_running_stats_exported": args.bn_stats, "threads": args.threads},
        "export": export_settings(args.opset),
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__,
                     "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
                     "python": sys.version.split()[0]},
        "model_onnx_op_types": ops,
        "results": {"best": {k: best[k] for k in ("path", "epoch", "test_acc")},
                    "last": {k: last[k] for k in ("path", "epoch", "test_acc")},
                    "best_minus_last_pp": round(best["test_acc"] - last["test_acc"], 2),
                    "n_checkpoints": len(records)},
        "runtime_s": round(runtime, 1),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import onnx
    import torch

    torch.set_num_threads(args.threads)
    t_start = time.time()
    out: Path = args.out
    print(f"reading Fashion-MNIST from {args.data_dir}")
    raw = load_fashion_mnist(args.data_dir)  # before touching OUT: missing data deletes nothing
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    for stale in (out / "checkpoints").glob("ckpt_*.onnx"):
        stale.unlink()
    splits = make_splits(len(raw["train_labels"]), len(raw["t10k_labels"]), args)
    y_train = raw["train_labels"][splits["train"]]
    y_noisy = corrupt_labels(y_train, args.noise, args.seed + 2)
    data = {"x_train": to_input(raw["train_images"][splits["train"]]), "y_train": y_train,
            "y_train_noisy": y_noisy,
            "x_test": to_input(raw["t10k_images"]), "y_test": raw["t10k_labels"],
            "x_eval": to_input(raw["t10k_images"][splits["eval"]]),
            "y_eval": raw["t10k_labels"][splits["eval"]]}
    print(f"splits: train {len(splits['train'])} "
          f"(labels corrupted: {int((y_noisy != y_train).sum())}), "
          f"calib {len(splits['calib'])}, eval {len(splits['eval'])} of the 10k test set")

    records = train(args, data, out)
    save_json(out / "checkpoints" / "checkpoints.json", records)
    shutil.copyfile(out / "checkpoints" / records[-1]["path"], out / "model.onnx")
    save_npz(out / "calib.npz", input=to_input(raw["train_images"][splits["calib"]]),
             labels=raw["train_labels"][splits["calib"]])
    save_npz(out / "eval.npz", input=data["x_eval"], labels=data["y_eval"])
    save_json(out / "indices.json", {
        "about": "indices into the Fashion-MNIST idx files (train-* for train and calib, t10k-* "
                 "for eval); train_noisy_labels are the partly corrupted labels trained on",
        "train": splits["train"].tolist(), "train_noisy_labels": y_noisy.tolist(),
        "calib": splits["calib"].tolist(), "eval": splits["eval"].tolist()}, indent=None)

    ops = sorted({n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node})
    manifest = build_manifest(args, argv, records, ops, time.time() - t_start)
    save_json(out / "manifest.json", manifest)

    print(f"\nop types in model.onnx: {ops}")
    print("files:")
    total = 0
    for f in sorted(p for p in out.rglob("*") if p.is_file()):
        total += f.stat().st_size
        print(f"  {f.relative_to(out)}  {f.stat().st_size / 1024:.1f} KiB")
    print(f"  total {total / 1024 / 1024:.2f} MiB")
    res = manifest["results"]
    best, last, gap = res["best"], res["last"], res["best_minus_last_pp"]
    print(f"best test acc {best['test_acc']:.2f}% at {best['path']} (epoch {best['epoch']}); "
          f"last {last['test_acc']:.2f}% at {last['path']}; best - last = {gap:.2f} pp; "
          f"runtime {manifest['runtime_s']:.0f} s")
    if best["path"] == last["path"] or gap < args.min_gap:
        print(f"FAIL: best-minus-last gap {gap:.2f} pp < --min-gap {args.min_gap}; "
              f"adjust the schedule", file=sys.stderr)
        return 2
    print(f"OK: the best checkpoint is not the last (gap {gap:.2f} pp >= {args.min_gap})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
