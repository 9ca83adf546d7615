#!/usr/bin/env python3
"""A MobileNetV2-class export at 224×224 for the benchmarks (issue 20), in plain torch.

    python benchmarks/mobilenetv2.py OUT_DIR [--width 1.0] [--size 224] [--n-calib 64]

Writes OUT_DIR/model.onnx (MobileNetV2 layout: a 3×3 stride-2 stem of 32·width channels,
17 inverted residual blocks with the (expansion, channels, repeats, stride) settings
(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
(6, 320, 1, 1), a 1×1 conv to 1280 channels, global average pool and a 1000-way linear
head; ReLU6; BatchNormalization kept unfused; random weights from a fixed seed, BN
statistics randomised so that BN is not the identity) and OUT_DIR/calib.npz (``input``
float32 (n, 3, size, size) uniform in [0, 1), ``labels`` random). torchvision is not
needed; at width 1 the network has the ~3.5 M parameters, ~0.3 GMACs and 52 convs of
torchvision's ``mobilenet_v2``. tools/train_zoo.py's ``mobilenetv2`` is the same family
for 28×28 inputs, whose last stages run on 2×2 and 1×1 maps. ``--smoke`` builds a
width-1/4, 64×64 net in seconds.
"""

from __future__ import annotations

import sys

from resnet50 import main, randomise_bn

#: (expansion t, output channels c, repeats n, first stride s) per stage, as torchvision.
SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
            (6, 160, 3, 2), (6, 320, 1, 1))


def _div8(c: float) -> int:
    """torchvision's _make_divisible(c, 8): the nearest multiple of 8, never 10 % below."""
    v = max(8, int(c + 4) // 8 * 8)
    return v + 8 if v < 0.9 * c else v


def build(width: float = 1.0, n_classes: int = 1000):
    """The torch module (eval mode), seeded."""
    import torch
    from torch import nn

    def conv_bn(c_in, c_out, k, stride=1, groups=1, act=True):
        layers = [nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(c_out)]
        return nn.Sequential(*layers, nn.ReLU6()) if act else nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, c_in, c_out, stride, t):
            super().__init__()
            mid = c_in * t
            layers = [conv_bn(c_in, mid, 1)] if t != 1 else []
            layers += [conv_bn(mid, mid, 3, stride, groups=mid), conv_bn(mid, c_out, 1, act=False)]
            self.body = nn.Sequential(*layers)
            self.residual = stride == 1 and c_in == c_out

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            c = _div8(32 * width)
            blocks = [conv_bn(3, c, 3, 2)]
            for t, ch, n, s in SETTINGS:
                out = _div8(ch * width)
                for i in range(n):
                    blocks.append(InvertedResidual(c, out, s if i == 0 else 1, t))
                    c = out
            last = _div8(1280 * max(1.0, width))
            blocks.append(conv_bn(c, last, 1))
            self.features = nn.Sequential(*blocks)
            self.fc = nn.Linear(last, n_classes)

        def forward(self, x):
            return self.fc(torch.flatten(self.features(x).mean(dim=(2, 3)), 1))

    torch.manual_seed(0)
    return randomise_bn(MobileNetV2())


if __name__ == "__main__":
    sys.exit(main(build=build, smoke_width=0.25, doc=__doc__))
