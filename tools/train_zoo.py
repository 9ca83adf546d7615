#!/usr/bin/env python3
"""Train onnxdiag's small model zoo: narrow CIFAR-style networks on real Fashion-MNIST.

    nohup nice -n 19 python tools/train_zoo.py --out /work/zoo > /work/zoo/train.log 2>&1 &

Five architectures, adapted to 1x28x28 input and made narrow so an epoch on the training subset
takes seconds on 2 CPU cores (base widths, ``--width-scale 1``):

    resnet18     CIFAR ResNet-18: stem conv3x3(1->8)+BN+ReLU+MaxPool2x2 (28->14; the pool keeps
                 an epoch cheap on 2 cores), 4 stages x 2 BasicBlocks, widths 8,16,32,64, strides
                 1,2,2,2 (14->14->7->4->2), GAP, Linear(64->10)
    resnet34     CIFAR ResNet-34: as resnet18 with 3,4,6,3 BasicBlocks
    vgg16_bn     VGG-16-BN: 13 conv3x3+BN+ReLU in 5 stages of widths 8,16,32,64,64 (the
                 64,128,256,512,512 of VGG-16 divided by 8), MaxPool after stages 1-4
                 (28->14->7->3->1), GAP, Linear(64->10)
    mobilenetv2  CIFAR MobileNetV2 at width multiplier 0.25: stem conv3x3(1->8) stride 2
                 (28->14), 17 inverted residual blocks (t,c,n,s) = (1,4,1,1) (6,6,2,2) (6,8,3,2)
                 (6,16,4,2) (6,24,3,1) (6,40,3,2) (6,80,1,1) (14->7->4->2->1), conv1x1(80->320)
                 +BN+ReLU6, GAP, Linear(320->10)

Every network normalises its input inside the graph ((x - 0.2860) / 0.3530, as models/sample) and
ends in Flatten + Gemm (the head).  ``vit`` is the transformer of tools/make_vit_sample.py (dim 48,
depth 3, 4 heads, MLP 96; no BN, exported with constant folding as that script does).

Schedules (``SCHEDULES``; per-architecture changes in ``ARCH_SCHEDULES``, per-run ones in
``OVERRIDES``):

    cosine  SGD (momentum 0.9, nesterov, weight decay 5e-4), lr 0.05 with cosine decay to 0
            over 6 epochs of the first 4,000 training-subset images, clean labels: accuracy rises
            to the end.  Checkpoints at epochs 0, 0.25, 0.5, 1, 2, 3, 4, 5, 6.
    tail    (issue 18) SGD (momentum 0.9, weight decay 5e-4) at a CONSTANT lr 0.05 on the first
            2,000 images with 15 % of their labels replaced by a random other class, stopped
            soon after test accuracy peaks so that the peak lies inside the tail window (the
            last K = 5 checkpoints) and accuracy falls after it: ResNet-18 9 epochs,
            checkpoints at 0, 0.5, 1, ..., 9; VGG-16-BN 16 epochs (0, 0.5, 1, 2, 4, ..., 12,
            13, 14, 15, 16); MobileNetV2 20 epochs (0, 0.5, 1, 2, 4, ..., 20); ViT: AdamW
            lr 1e-3 (the ViT sample's), 20 epochs.  The lengths come from one seed-0 pilot per
            architecture (test accuracy every half epoch; docs/STUDIES.md).
    init    no training: the step-0 export only, at width x1 / x4 / x8 with and without BN
            (init coupling, METHODS §B4).
    noisy   (issue 7) Adam, constant lr 1e-3, 16 epochs of 2,500 images with 40 % noise
            (mobilenetv2-noisy: SGD, lr 0.05, 40 epochs); kept for ``--runs legacy``.

Batch 128.  ``--runs all`` is issue 18's plan (``plan_runs``: 5 seeds x tail for resnet18,
vgg16_bn, mobilenetv2 and vit; cosine seeds 0-4 for resnet18 and vgg16_bn, 0-2 for mobilenetv2;
36 init-only exports), ``--runs legacy`` issue 7's zoo; names and patterns select runs.  Each run
also writes ``probe_train.npz``: its first 1,000 training images with the labels it was trained
on (noisy on the tail runs), the probe of the readout study.

Checkpoints at step 0 and at fractional epochs from
initialisation through convergence; each is exported to ONNX with BatchNormalization KEPT
(tools/make_sample.py's settings: TorchScript exporter, dynamo=False, do_constant_folding=False,
training=EVAL), checked with the full ONNX checker and compared with torch through ONNX Runtime.
One extra export of ``resnet18-cosine``'s last checkpoint has BN folded into the convolutions
(do_constant_folding=True).  BN statistics in the exports are "precise BN" (make_sample.py's
precise_bn_copy over the first 1,000 images of the training subset).

Data splits are shared by every run (seed 0 permutation of the 60k training images: the first
N_TRAIN are the training subset, the next 1,000 are ``calib.npz``; 2,000 test images drawn with
seed 1 are ``eval.npz``, and ``test_acc`` in every manifest is the accuracy on exactly those
2,000).  The run seed drives initialisation, batch order and label corruption.

Layout of OUT::

    OUT/calib.npz, OUT/eval.npz, OUT/zoo.json
    OUT/<run>/checkpoints/ckpt_000.onnx ...   in training order
    OUT/<run>/checkpoints/checkpoints.json    step, epoch, accuracies per checkpoint
    OUT/<run>/manifest.json                   everything about the run ("complete": true at end)
    OUT/<run>/state.pt                        resume state (model, optimizer, records)
    OUT/<run>/probe_train.npz                 the training probe (images, labels trained on)
    OUT/<run>/probe_train_clean_labels.npy    its true labels
    OUT/resnet18-cosine/model_bnfolded.onnx   the BN-folded export

Resumable: a run whose manifest says complete is skipped; otherwise training restarts from the
last saved checkpoint's state (model, optimizer, step); batch order is a pure function of seed and
epoch, so an interrupted-and-resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_sample as ms  # noqa: E402  (tools/ is not a package)

ARCHS = ("resnet18", "resnet34", "vgg16_bn", "mobilenetv2", "vit")
_EVERY_EPOCH = [0.5, *range(1, 10)]
SCHEDULES = {
    "cosine": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True,
               "weight_decay": 5e-4, "lr_schedule": "cosine", "noise": 0.0,
               "epochs": 6.0, "n_train": 4000,
               "checkpoint_epochs": [0.25, 0.5, 1, 2, 3, 4, 5, 6]},
    "noisy": {"optimizer": "adam", "lr": 1e-3, "momentum": None, "nesterov": False,
              "weight_decay": 0.0, "lr_schedule": "constant", "noise": 0.4,
              "epochs": 16.0, "n_train": 2500,
              "checkpoint_epochs": [0.25, 0.5, 1, 2, 3, 4, 6, 8, 10, 12, 14, 16]},
    # issue 18: constant lr, 2,000 images, 15 % label noise, training stopped soon after the
    # peak so that test accuracy peaks INSIDE the tail window (K = 5) and falls after it
    "tail": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": False,
             "weight_decay": 5e-4, "lr_schedule": "constant", "noise": 0.15,
             "epochs": 9.0, "n_train": 2000, "checkpoint_epochs": _EVERY_EPOCH},
    # no training: the step-0 export only (init coupling, METHODS §B4)
    "init": {"optimizer": "sgd", "lr": 0.0, "momentum": 0.0, "nesterov": False,
             "weight_decay": 0.0, "lr_schedule": "constant", "noise": 0.0,
             "epochs": 0.0, "n_train": 2000, "checkpoint_epochs": []},
}
# per-run schedule changes (see the docstring); applied on top of SCHEDULES
OVERRIDES: dict[str, dict] = {
    # With Adam (lr 1e-3, 16 epochs) this MobileNetV2 learnt slowly and never peaked (40.5 %
    # best, 39.75 % last); constant-lr SGD learns to ~73 % and then memorises the noise.
    "mobilenetv2-noisy": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": False,
                          "epochs": 40,
                          "checkpoint_epochs": [1, 2, 4, 6, 8, 10, 12, 16, 20, 25, 30, 35, 40]},
}
# per-(architecture, schedule) changes, chosen from one seed-0 pilot per architecture (the
# pilot's curves are in docs/STUDIES.md); applied before OVERRIDES
ARCH_SCHEDULES: dict[tuple[str, str], dict] = {
    # ResNet-18 peaked at epoch ~5.5-7 in its pilot: the default (9 epochs, tail = 5..9).
    # VGG-16-BN learnt and memorised more slowly (plateau 11-19 epochs, still rising on the
    # noisy labels at 20); MobileNetV2 peaked (~72 %) between epochs 12 and 20.
    ("vgg16_bn", "tail"): {"epochs": 16.0,
                           "checkpoint_epochs": [0.5, 1, 2, 4, 6, 8, 10, 12, 13, 14, 15, 16]},
    ("mobilenetv2", "tail"): {"epochs": 20.0,
                              "checkpoint_epochs": [0.5, 1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]},
    # the ViT sample's optimiser (AdamW, lr 1e-3, no weight decay)
    ("vit", "tail"): {"optimizer": "adamw", "lr": 1e-3, "momentum": None, "weight_decay": 0.0,
                      "epochs": 20.0,
                      "checkpoint_epochs": [0.5, 1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]},
    ("vit", "cosine"): {"optimizer": "adamw", "lr": 1e-3, "momentum": None,
                        "weight_decay": 0.0},
}
SEEDS_EXTRA = {"resnet18-cosine-s1": ("resnet18", "cosine", 1)}
FOLDED_RUN = "resnet18-cosine"
N_PRECISE_BN = 1000
N_TRAIN_PROBE = 1000
VIT_DIMS = {"dim": 48, "depth": 3, "heads": 4, "mlp": 96}  # tools/make_vit_sample.py defaults


@dataclass(frozen=True)
class Run:
    """One run of the zoo: architecture, schedule, seed (init, batch order, label noise),
    width multiplier (on top of ``--width-scale``) and whether BatchNormalization is kept."""

    arch: str
    schedule: str
    seed: int = 0
    width: float = 1.0
    bn: bool = True

    def __iter__(self):  # ``arch, schedule, seed = run`` (issue 7's tuples)
        return iter((self.arch, self.schedule, self.seed))


def run_name(run: Run) -> str:
    """``ARCH-SCHEDULE`` (seed 0) or ``ARCH-SCHEDULE-sSEED``; init runs name width and BN."""
    if run.schedule == "init":
        return (f"init-{run.arch}-w{run.width:g}{'' if run.bn else '-nobn'}-s{run.seed}")
    return f"{run.arch}-{run.schedule}" + (f"-s{run.seed}" if run.seed else "")


def legacy_runs() -> dict[str, Run]:
    """Issue 7's zoo: four architectures x (cosine, noisy), seed 0, plus resnet18-cosine-s1."""
    runs = {f"{a}-{s}": Run(a, s, 0) for s in ("cosine", "noisy") for a in ARCHS[:4]}
    runs.update({n: Run(*t) for n, t in SEEDS_EXTRA.items()})
    return runs


def plan_runs() -> dict[str, Run]:
    """Issue 18's zoo, in training order (what the studies need first comes first)."""
    plan: list[Run] = []
    plan += [Run(a, "tail", s) for a in ("resnet18", "vgg16_bn") for s in range(5)]
    plan += [Run(a, "cosine", s) for a in ("resnet18", "vgg16_bn") for s in range(3)]
    plan += [Run("mobilenetv2", "tail", s) for s in range(5)]
    plan += [Run(a, "init", s, w, bn) for a in ("resnet18", "vgg16_bn") for w in (1, 4, 8)
             for bn in (True, False) for s in range(3)]
    plan += [Run("mobilenetv2", "cosine", s) for s in range(3)]
    plan += [Run(a, "cosine", s) for a in ("resnet18", "vgg16_bn") for s in (3, 4)]
    plan += [Run("vit", "tail", s) for s in range(5)]
    return {run_name(r): r for r in plan}


def all_runs() -> dict[str, Run]:
    """Every run the script knows: issue 7's (legacy) and issue 18's plan."""
    return {**legacy_runs(), **plan_runs()}


def select_runs(spec: str) -> list[str]:
    """``all`` (issue 18's plan), ``legacy`` (issue 7's zoo), or comma-separated run names and
    shell patterns (``resnet18-tail*``)."""
    known = all_runs()
    if spec == "all":
        return list(plan_runs())
    if spec == "legacy":
        return list(legacy_runs())
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        hits = [n for n in known if fnmatch.fnmatchcase(n, item)]
        if not hits:
            sys.exit(f"error: unknown run {item!r}; known: {', '.join(known)}")
        names += [n for n in hits if n not in names]
    return names


def schedule_for(name: str, run: Run, args, sched: dict | None = None) -> dict:
    """The schedule of one run: SCHEDULES, then ARCH_SCHEDULES, OVERRIDES, ``--set`` and
    ``--epochs-scale``."""
    sched = dict(SCHEDULES[run.schedule] if sched is None else sched)
    sched.update(ARCH_SCHEDULES.get((run.arch, run.schedule), {}))
    sched.update(OVERRIDES.get(name, {}))
    sched.update(getattr(args, "set", None) or {})
    if args.epochs_scale != 1.0:
        sched["epochs"] *= args.epochs_scale
        sched["checkpoint_epochs"] = [e * args.epochs_scale for e in sched["checkpoint_epochs"]]
    return sched


# -------------------------------------------------------------------------------------- models

def arch_widths(arch: str, scale: float) -> dict:
    """The channel widths of `arch` at `scale` (1 = the documented zoo widths)."""
    def w(c):
        return max(1, int(round(c * scale)))
    if arch in ("resnet18", "resnet34"):
        return {"stages": [w(8), w(16), w(32), w(64)],
                "blocks": [2, 2, 2, 2] if arch == "resnet18" else [3, 4, 6, 3]}
    if arch == "vgg16_bn":
        return {"stages": [[w(8)] * 2, [w(16)] * 2, [w(32)] * 3, [w(64)] * 3, [w(64)] * 3]}
    if arch == "mobilenetv2":
        cfg = [(1, 4, 1, 1), (6, 6, 2, 2), (6, 8, 3, 2), (6, 16, 4, 2), (6, 24, 3, 1),
               (6, 40, 3, 2), (6, 80, 1, 1)]
        return {"stem": w(8), "blocks": [[t, w(c), n, s] for t, c, n, s in cfg],
                "last": w(320)}
    if arch == "vit":  # dim stays a multiple of the 4 heads
        return {"dim": 4 * w(VIT_DIMS["dim"] // 4), "depth": VIT_DIMS["depth"],
                "heads": VIT_DIMS["heads"], "mlp": w(VIT_DIMS["mlp"])}
    raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")


def build(arch: str, widths: dict):
    """A torch module for `arch` with `widths` (see arch_widths); input (N,1,28,28) in [0,1]."""
    import torch
    from torch import nn

    if arch == "vit":
        import make_vit_sample

        return make_vit_sample.build_model(widths["dim"], widths["depth"], widths["heads"],
                                           widths["mlp"])

    def cbr(c_in, c_out, k=3, stride=1, groups=1, act=nn.ReLU):
        layers = [nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(c_out)]
        if act is not None:
            layers.append(act())
        return nn.Sequential(*layers)

    BasicBlock = ms.basic_block()

    class InvertedResidual(nn.Module):
        def __init__(self, c_in, c_out, stride, t):
            super().__init__()
            hidden = c_in * t
            layers = [] if t == 1 else [cbr(c_in, hidden, 1, act=nn.ReLU6)]
            layers += [cbr(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
                       cbr(hidden, c_out, 1, act=None)]
            self.conv = nn.Sequential(*layers)
            self.residual = stride == 1 and c_in == c_out

        def forward(self, x):
            y = self.conv(x)
            return x + y if self.residual else y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pixel_mean", torch.full((1, 1, 1, 1), ms.PIXEL_MEAN))
            self.register_buffer("pixel_std", torch.full((1, 1, 1, 1), ms.PIXEL_STD))
            if arch in ("resnet18", "resnet34"):
                st = widths["stages"]
                self.stem = nn.Sequential(cbr(1, st[0]), nn.MaxPool2d(2))
                blocks, c = [], st[0]
                for i, (c_out, n) in enumerate(zip(st, widths["blocks"], strict=True)):
                    for j in range(n):
                        blocks.append(BasicBlock(c, c_out, 2 if (i > 0 and j == 0) else 1))
                        c = c_out
                self.features = nn.Sequential(*blocks)
            elif arch == "vgg16_bn":
                self.stem = nn.Identity()
                layers, c = [], 1
                for i, stage in enumerate(widths["stages"]):
                    for c_out in stage:
                        layers.append(cbr(c, c_out))
                        c = c_out
                    if i < 4:
                        layers.append(nn.MaxPool2d(2))
                self.features = nn.Sequential(*layers)
            else:
                c = widths["stem"]
                self.stem = cbr(1, c, stride=2, act=nn.ReLU6)
                blocks = []
                for t, c_out, n, s in widths["blocks"]:
                    for j in range(n):
                        blocks.append(InvertedResidual(c, c_out, s if j == 0 else 1, t))
                        c = c_out
                blocks.append(cbr(c, widths["last"], 1, act=nn.ReLU6))
                c = widths["last"]
                self.features = nn.Sequential(*blocks)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(c, ms.N_CLASSES)

        def forward(self, x):
            x = (x - self.pixel_mean) / self.pixel_std
            x = self.features(self.stem(x))
            return self.fc(torch.flatten(self.pool(x), 1))

    return Net()


def strip_bn(model):
    """Replace every BatchNorm2d of `model` by Identity, in place (the no-BN variants of the
    init-coupling study); returns the model."""
    from torch import nn

    for parent in list(model.modules()):
        for key, child in list(parent.named_children()):
            if isinstance(child, nn.BatchNorm2d):
                setattr(parent, key, nn.Identity())
    return model


def make_optimizer(sched: dict, params):
    import torch

    if sched["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=sched["lr"], momentum=sched["momentum"],
                               nesterov=sched["nesterov"], weight_decay=sched["weight_decay"])
    if sched["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=sched["lr"], weight_decay=sched["weight_decay"])
    return torch.optim.Adam(params, lr=sched["lr"], weight_decay=sched["weight_decay"])


def bn_snapshot(model, x_bn, n_bn: int):
    """The model to export: precise BN over `x_bn` (a deep copy in eval mode without BN)."""
    import copy

    return ms.precise_bn_copy(model, x_bn) if n_bn else copy.deepcopy(model).eval()


def write_train_probe(run_dir: Path, x, y_noisy, y_clean) -> None:
    """RUN/probe_train.npz: the first N_TRAIN_PROBE training images with the labels the run
    trained on (noisy where the schedule corrupts labels; the Part A probe), and
    RUN/probe_train_clean_labels.npy, their true labels."""
    if not (run_dir / "probe_train.npz").is_file():
        ms.save_npz(run_dir / "probe_train.npz", input=x, labels=y_noisy)
        np.save(run_dir / "probe_train_clean_labels.npy", y_clean)


# -------------------------------------------------------------------------------------- export

def export(model, path: Path, opset: int, meta: dict, fold_bn: bool = False) -> None:
    """make_sample's export (BN kept, or folded with `fold_bn`) with the zoo's names."""
    ms.export_onnx(model, path, opset, meta, fold_bn=fold_bn,
                   graph_name=f"onnxdiag_zoo_{meta.get('onnxdiag.zoo.arch', 'model')}",
                   doc="onnxdiag zoo model on Fashion-MNIST; input float32 (N,1,28,28) in "
                       "[0,1] (normalised inside); output logits (N,10). Made by "
                       "tools/train_zoo.py.")


def export_settings(opset: int, fold_bn: bool = False) -> dict:
    s = ms.export_settings(opset)
    s["do_constant_folding"] = fold_bn
    s["batchnorm_kept"] = not fold_bn
    return s


# ------------------------------------------------------------------------------------ training

def load_data(data_dir: Path, n_train: int, n_calib: int, n_eval: int) -> dict:
    raw = ms.load_fashion_mnist(data_dir)
    ns = argparse.Namespace(n_train=n_train, n_calib=n_calib, n_eval=n_eval, seed=0)
    sp = ms.make_splits(len(raw["train_labels"]), len(raw["t10k_labels"]), ns)
    return {"splits": sp,
            "x_train": ms.to_input(raw["train_images"][sp["train"]]),
            "y_train": raw["train_labels"][sp["train"]],
            "x_calib": ms.to_input(raw["train_images"][sp["calib"]]),
            "y_calib": raw["train_labels"][sp["calib"]],
            "x_eval": ms.to_input(raw["t10k_images"][sp["eval"]]),
            "y_eval": raw["t10k_labels"][sp["eval"]]}


def epoch_order(seed: int, epoch: int, n: int):
    """Batch order of `epoch`: a pure function of (seed, epoch), so resuming is exact."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))


def lr_at(sched: dict, step: int, total: int) -> float:
    if sched["lr_schedule"] == "cosine":
        return 0.5 * sched["lr"] * (1.0 + math.cos(math.pi * step / total))
    return sched["lr"]


def tolerance(model, x) -> float:
    """ORT-vs-torch tolerance: 1e-4 relative to the largest |logit| (at least 1e-4)."""
    import torch

    with torch.no_grad():
        scale = float(model.eval()(torch.from_numpy(x)).abs().max())
    return 1e-4 * max(1.0, scale)


def save_json(path: Path, obj) -> None:
    ms.save_json(path, obj)


def train_run(name: str, arch: str, sched_name: str, seed: int, data: dict, args,
              sched: dict | None = None, *, width: float = 1.0, bn: bool = True) -> dict:
    """Train (or resume, or skip) one run; returns its manifest."""
    import onnx
    import torch
    import torch.nn.functional as F

    sched = schedule_for(name, Run(arch, sched_name, seed, width, bn), args, sched)
    fold_export = arch == "vit"  # no BN; constant folding as tools/make_vit_sample.py
    run_dir = args.out / name
    ckpt_dir = run_dir / "checkpoints"
    manifest_path = run_dir / "manifest.json"
    if manifest_path.is_file():
        m = json.loads(manifest_path.read_text())
        if m.get("complete"):
            print(f"[{name}] complete, skipped", flush=True)
            return m
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    widths = arch_widths(arch, args.width_scale * width)
    model = build(arch, widths)
    if not bn:
        strip_bn(model)
    n_bn = sum(isinstance(mm, torch.nn.BatchNorm2d) for mm in model.modules())
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(sched, model.parameters())

    n_train = min(sched["n_train"], len(data["x_train"]))
    xtr, ytr = data["x_train"][:n_train], data["y_train"][:n_train]
    ytr_noisy = ms.corrupt_labels(ytr, sched["noise"], seed + 2) if sched["noise"] else ytr
    spe = math.ceil(len(xtr) / args.batch_size)
    total = int(round(sched["epochs"] * spe))
    ckpt_steps = sorted({0} | {int(round(e * spe)) for e in sched["checkpoint_epochs"]})
    ckpt_steps = [s for s in ckpt_steps if s <= total]
    x_bn = xtr[:N_PRECISE_BN]
    x_tr_eval, y_tr_eval, y_tr_eval_noisy = (xtr[:N_PRECISE_BN], ytr[:N_PRECISE_BN],
                                             ytr_noisy[:N_PRECISE_BN])
    x_check = data["x_eval"][:32]
    write_train_probe(run_dir, xtr[:N_TRAIN_PROBE], ytr_noisy[:N_TRAIN_PROBE],
                      ytr[:N_TRAIN_PROBE])

    step, records, train_time = 0, [], 0.0
    state_path = run_dir / "state.pt"
    if state_path.is_file():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        step, records, train_time = st["step"], st["records"], st["train_time"]
        print(f"[{name}] resumed at step {step} ({len(records)} checkpoints done)", flush=True)
    print(f"[{name}] {arch} {sched_name} seed {seed}: {n_params} parameters, {n_bn} BN; "
          f"{len(xtr)} images, {spe} steps/epoch, {total} steps, checkpoints at {ckpt_steps}",
          flush=True)

    def checkpoint():
        t = time.time()
        snap = bn_snapshot(model, x_bn, n_bn)
        tr_acc, tr_loss = ms.evaluate(snap, x_tr_eval, y_tr_eval)
        tr_acc_noisy, tr_loss_noisy = ms.evaluate(snap, x_tr_eval, y_tr_eval_noisy)
        te_acc, te_loss = ms.evaluate(snap, data["x_eval"], data["y_eval"])
        fname = f"ckpt_{len(records):03d}.onnx"
        export(snap, ckpt_dir / fname, args.opset,
               {"onnxdiag.zoo.run": name, "onnxdiag.zoo.arch": arch,
                "onnxdiag.zoo.step": step, "onnxdiag.zoo.epoch": f"{step / spe:.4g}"},
               fold_bn=fold_export)
        diff = ms.verify_onnx(ckpt_dir / fname, snap, x_check, n_bn, tol=tolerance(snap, x_check))
        rec = {"path": fname, "step": step, "epoch": round(step / spe, 4),
               "train_acc": round(tr_acc, 2), "test_acc": round(te_acc, 2),
               "test_loss": round(te_loss, 4), "train_loss": round(tr_loss, 4),
               "ort_vs_torch_max_abs": float(f"{diff:.3g}")}
        if sched["noise"]:
            rec["train_acc_noisy"] = round(tr_acc_noisy, 2)
            rec["train_loss_noisy"] = round(tr_loss_noisy, 4)
        records.append(rec)
        tmp = state_path.with_name("state.pt.tmp")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "records": records, "train_time": train_time}, tmp)
        os.replace(tmp, state_path)
        save_json(ckpt_dir / "checkpoints.json", records)
        print(f"[{name}] {fname} step {step:5d} epoch {step / spe:5.2f} train {tr_acc:5.2f}% "
              + (f"train(noisy) {tr_acc_noisy:5.2f}% " if sched["noise"] else "")
              + f"test {te_acc:5.2f}%  ort-vs-torch {diff:.1e}  "
                f"(train {train_time:.0f}s, ckpt {time.time() - t:.1f}s)", flush=True)

    if not records:
        checkpoint()
    xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr_noisy)
    model.train()
    t0 = time.time()
    while step < total:
        epoch, pos = divmod(step, spe)
        order = epoch_order(seed, epoch, len(xtr))
        for b in range(pos, spe):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            for g in opt.param_groups:
                g["lr"] = lr_at(sched, step, total)
            loss = F.cross_entropy(model(xtr_t[idx]), ytr_t[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step in ckpt_steps:
                train_time += time.time() - t0
                checkpoint()
                model.train()
                t0 = time.time()
            if step >= total:
                break

    extra = {}
    if name == FOLDED_RUN or getattr(args, "fold_all", False):
        snap = ms.precise_bn_copy(model, x_bn)
        fpath = run_dir / "model_bnfolded.onnx"
        export(snap, fpath, args.opset, {"onnxdiag.zoo.run": name, "onnxdiag.zoo.arch": arch,
                                         "onnxdiag.zoo.step": step, "onnxdiag.zoo.bn": "folded"},
               fold_bn=True)
        diff = ms.verify_onnx(fpath, snap, x_check, 0, tol=tolerance(snap, x_check))
        extra = {"bn_folded_export": {"path": fpath.name, "of": records[-1]["path"],
                                      "settings": export_settings(args.opset, True),
                                      "ort_vs_torch_max_abs": float(f"{diff:.3g}")}}
        print(f"[{name}] BN-folded export {fpath.name}: ort-vs-torch {diff:.1e}", flush=True)

    import onnxruntime

    best = max(records, key=lambda r: r["test_acc"])
    ops = sorted({n.op_type for n in onnx.load(str(ckpt_dir / records[-1]["path"])).graph.node})
    manifest = {
        "run": name, "arch": arch, "schedule": sched_name, "seed": seed, "complete": True,
        "command": "python tools/train_zoo.py " + " ".join(args.argv),
        "widths": widths, "width_scale": args.width_scale, "width": width, "batchnorm": bn,
        "n_parameters": n_params, "n_batchnorm": n_bn,
        "seeds": {"splits": 0, "eval_subset": 1, "label_corruption": seed + 2,
                  "init": seed, "batch_order": f"torch.Generator({seed}*100003 + epoch)"},
        "data": {"source": str(args.data_dir), "n_train": len(xtr),
                 "n_calib": len(data["x_calib"]), "n_eval": len(data["x_eval"]),
                 "test_acc_on": "eval.npz (fixed seed-1 subset of the 10k test set)",
                 "train_acc_on": f"first {len(x_tr_eval)} training-subset images, true labels",
                 "label_noise_fraction": sched["noise"],
                 "probe_train": f"probe_train.npz: the first {N_TRAIN_PROBE} training-subset "
                                f"images with the labels trained on "
                                f"({'noisy' if sched['noise'] else 'clean'}); true labels in "
                                f"probe_train_clean_labels.npy"},
        "training": {**{k: v for k, v in sched.items()}, "batch_size": args.batch_size,
                     "steps_per_epoch": spe, "total_steps": total, "augmentation": None,
                     "threads": args.threads,
                     "bn_running_stats_exported": f"precise BN over {len(x_bn)} training images"},
        "export": export_settings(args.opset, fold_export), **extra,
        "op_types": ops,
        "checkpoints": records,
        "results": {"best": {k: best[k] for k in ("path", "epoch", "test_acc")},
                    "last": {k: records[-1][k] for k in ("path", "epoch", "test_acc")},
                    "best_minus_last_pp": round(best["test_acc"] - records[-1]["test_acc"], 2),
                    "best_in_tail_5": records.index(best) >= len(records) - 5,
                    "n_checkpoints": len(records)},
        "timing": {"train_s": round(train_time, 1),
                   "train_s_per_epoch": round(train_time / max(sched["epochs"], 1e-9), 2)},
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__,
                     "onnxruntime": onnxruntime.__version__, "numpy": np.__version__},
    }
    save_json(manifest_path, manifest)
    state_path.unlink(missing_ok=True)
    print(f"[{name}] done: best {best['test_acc']:.2f}% at {best['path']} (epoch {best['epoch']}), "
          f"last {records[-1]['test_acc']:.2f}%, train {train_time:.0f}s", flush=True)
    return manifest


def write_probe_sets(out: Path, data: dict) -> None:
    """calib.npz / eval.npz of the zoo; existing files must hold the same arrays (several
    processes may train runs of one zoo at the same time)."""
    for name, x, y in (("calib", data["x_calib"], data["y_calib"]),
                       ("eval", data["x_eval"], data["y_eval"])):
        path = out / f"{name}.npz"
        if path.is_file():
            with np.load(path) as f:
                if np.array_equal(f["input"], x) and np.array_equal(f["labels"], y):
                    continue
            sys.exit(f"error: {path} holds other images than this zoo's {name} split; "
                     f"use another --out or delete it")
        ms.save_npz(path, input=x, labels=y)


def copy_manifests(zoo: Path, dest: Path) -> int:
    """Copy the small manifest of every complete run (and zoo.json) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for m_path in sorted(zoo.glob("*/manifest.json")):
        m = json.loads(m_path.read_text())
        if m.get("complete"):
            save_json(dest / f"{m['run']}.json", m)
            n += 1
    if (zoo / "zoo.json").is_file():
        z = json.loads((zoo / "zoo.json").read_text())
        z.pop("splits", None)  # indices: large, and rebuilt by the script
        save_json(dest / "zoo.json", z)
    print(f"copied {n} manifests to {dest}")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/work/zoo"), help="zoo folder")
    p.add_argument("--runs", default="all",
                   help="'all' (issue 18's plan), 'legacy' (issue 7's zoo), or comma-separated "
                        "run names and shell patterns ('resnet18-tail*'); --list shows them")
    p.add_argument("--list", action="store_true", help="list the selected runs and exit")
    p.add_argument("--data-dir", type=Path, default=ms.DATA_DIR)
    p.add_argument("--n-train", type=int, default=5000, help="training subset size")
    p.add_argument("--n-calib", type=int, default=1000)
    p.add_argument("--n-eval", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--width-scale", type=float, default=1.0,
                   help="multiply every documented width (tests use a tiny scale)")
    p.add_argument("--epochs-scale", type=float, default=1.0,
                   help="multiply every schedule's epochs and checkpoint epochs")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a schedule entry for the selected runs, e.g. epochs=40 "
                        "(for trials; recorded in the manifest)")
    p.add_argument("--copy-manifests", type=Path, default=None, metavar="DIR",
                   help="only copy every complete run's manifest.json to DIR/<run>.json "
                        "(e.g. models/zoo/manifests) and exit")
    p.add_argument("--time-epoch", action="store_true",
                   help="only time one training epoch per selected run and exit")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.set = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    return args


def time_epoch(arch: str, data: dict, args) -> float:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build(arch, arch_widths(arch, args.width_scale)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
    t = time.time()
    for i in range(0, len(x), args.batch_size):
        loss = F.cross_entropy(model(x[i:i + args.batch_size]), y[i:i + args.batch_size])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return time.time() - t


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.copy_manifests is not None:
        return copy_manifests(args.out, args.copy_manifests)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # denormals made some steps 10x slower
    runs = all_runs()
    names = select_runs(args.runs)
    if args.list:
        for r in names:
            done = (args.out / r / "manifest.json").is_file()
            print(f"{r}\t{runs[r]}\t{'complete' if done else ''}")
        return 0
    data = load_data(args.data_dir, args.n_train, args.n_calib, args.n_eval)
    if args.time_epoch:
        for r in names:
            arch = runs[r].arch
            n = sum(p.numel() for p in build(arch, arch_widths(arch, args.width_scale))
                    .parameters())
            print(f"{r}: {n} params, one epoch of {args.n_train} images "
                  f"{time_epoch(arch, data, args):.1f}s", flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    write_probe_sets(args.out, data)
    t_all = time.time()
    for r in names:
        run = runs[r]
        train_run(r, run.arch, run.schedule, run.seed, data, args, width=run.width, bn=run.bn)
    summary = {}  # every complete run in OUT (other processes may train other runs)
    for m_path in sorted(args.out.glob("*/manifest.json")):
        m = json.loads(m_path.read_text())
        if m.get("complete"):
            summary[m["run"]] = {"arch": m["arch"], "schedule": m["schedule"], "seed": m["seed"],
                                 "width": m.get("width", 1.0),
                                 "batchnorm": m.get("batchnorm", True),
                                 "n_parameters": m["n_parameters"], **m["results"]}
    zoo = {"about": "onnxdiag zoo on Fashion-MNIST made by tools/train_zoo.py; calib.npz = "
                    "held-out training images (probe set), eval.npz = test subset (test_acc)",
           "command": "python tools/train_zoo.py " + " ".join(args.argv),
           "splits": {k: v.tolist() for k, v in data["splits"].items() if k != "train"},
           "runs": summary}
    save_json(args.out / "zoo.json", zoo)
    print(f"zoo done in {time.time() - t_all:.0f}s: {', '.join(names)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
