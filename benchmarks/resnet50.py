#!/usr/bin/env python3
"""A ResNet-50-class export for the full-size benchmarks (issue 20), in plain torch.

    python benchmarks/resnet50.py OUT_DIR [--width 1.0] [--size 224] [--n-calib 64]

Writes OUT_DIR/model.onnx (ResNet-50 v1.5 layout: 7×7 stem, max-pool, bottleneck stages
[3, 4, 6, 3] with 64·width base channels and ×4 expansion, global average pool, a
1000-way linear head; BatchNormalization kept unfused; random weights from a fixed seed,
BN statistics randomised so that BN is not the identity) and OUT_DIR/calib.npz (``input``
float32 (n, 3, size, size) uniform in [0, 1), ``labels`` random). torchvision is not
needed; at width 1 the network has the ~25.6 M parameters and ~4.1 GMACs of
torchvision's ``resnet50``. ``--smoke`` builds a width-1/16, 64×64 net in seconds.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np


def build(width: float = 1.0, n_classes: int = 1000):
    """The torch module (eval mode), seeded."""
    import torch
    from torch import nn

    def w(c):
        return max(4, int(round(c * width)))

    class Bottleneck(nn.Module):
        def __init__(self, c_in, mid, stride):
            super().__init__()
            out = mid * 4
            self.conv1, self.bn1 = nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid)
            self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(mid)
            self.conv3, self.bn3 = nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out)
            self.down = None
            if stride != 1 or c_in != out:
                self.down = nn.Sequential(nn.Conv2d(c_in, out, 1, stride, bias=False),
                                          nn.BatchNorm2d(out))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = torch.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    class ResNet50(nn.Module):
        def __init__(self):
            super().__init__()
            c = w(64)
            self.stem = nn.Sequential(nn.Conv2d(3, c, 7, 2, 3, bias=False), nn.BatchNorm2d(c),
                                      nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            blocks = []
            for i, (mid, n) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
                for j in range(n):
                    blocks.append(Bottleneck(c, w(mid), 2 if (i > 0 and j == 0) else 1))
                    c = w(mid) * 4
            self.features = nn.Sequential(*blocks)
            self.fc = nn.Linear(c, n_classes)

        def forward(self, x):
            x = self.features(self.stem(x))
            return self.fc(torch.flatten(x.mean(dim=(2, 3)), 1))

    torch.manual_seed(0)
    return randomise_bn(ResNet50())


def randomise_bn(net):
    """``net`` in eval mode with random BN statistics and affine (not the identity), from
    torch's current seed."""
    import torch

    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.0)
                m.bias.uniform_(-0.1, 0.1)
    return net.eval()


def export(net, path: Path, size: int) -> None:
    """torch.onnx export, BN kept, dynamic batch; opset 17."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(1, 3, size, size),), str(path), dynamo=False,
                          opset_version=17, training=torch.onnx.TrainingMode.EVAL,
                          do_constant_folding=False, input_names=["input"],
                          output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})


def make(out: Path, width: float = 1.0, size: int = 224, n_calib: int = 64, *,
         build=build) -> Path:
    """OUT/model.onnx and OUT/calib.npz (see the module docstring) of ``build(width)``;
    returns the model path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.onnx"
    export(build(width), path, size)
    rng = np.random.default_rng(0)
    np.savez(out / "calib.npz", input=rng.random((n_calib, 3, size, size), np.float32),
             labels=rng.integers(0, 1000, n_calib))
    return path


def main(argv=None, *, build=build, smoke_width: float = 1 / 16, doc: str = __doc__) -> int:
    """The command line of this builder (and of benchmarks/mobilenetv2.py's)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--n-calib", type=int, default=64)
    ap.add_argument("--smoke", action="store_true",
                    help=f"width {smoke_width:g}, 64×64, 8 images")
    args = ap.parse_args(argv)
    if args.smoke:
        args.width, args.size, args.n_calib = smoke_width, 64, 8
    print(make(args.out, args.width, args.size, args.n_calib, build=build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
