#!/usr/bin/env python3
"""The pilot that sized the zoo's ``tail`` schedule (tools/train_zoo.py, issue 18): one seed-0 run
per architecture, test accuracy (eval.npz, running BN statistics) and accuracy on the noisy
training labels every half epoch, printed as ``epoch:test/train_noisy``.

    python tools/study_pilot.py ARCH OPTIMIZER LR NOISE N_TRAIN EPOCHS [SEED]
    python tools/study_pilot.py resnet18 sgd 0.05 0.15 2000 20

Run once (2026-12-01, 1 thread, nice 19) for resnet18 / vgg16_bn / mobilenetv2 with SGD
(momentum 0.9, weight decay 5e-4) and for resnet18 / vgg16_bn with Adam lr 1e-3; the parsed
curves are docs/studies/pilot/pilot.csv.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    import make_sample as ms
    import torch
    import torch.nn.functional as F
    import train_zoo as tz

    argv = sys.argv[1:] if argv is None else argv
    arch, opt_name = argv[0], argv[1]
    lr, noise, n_train, epochs = float(argv[2]), float(argv[3]), int(argv[4]), float(argv[5])
    seed = int(argv[6]) if len(argv) > 6 else 0
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    data = tz.load_data(ms.DATA_DIR, 5000, 1000, 2000)
    torch.manual_seed(seed)
    m = tz.build(arch, tz.arch_widths(arch, 1.0))
    xtr, ytr = data["x_train"][:n_train], data["y_train"][:n_train]
    yn = ms.corrupt_labels(ytr, noise, seed + 2) if noise else ytr
    if opt_name == "sgd":
        opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    else:
        opt = torch.optim.Adam(m.parameters(), lr=lr)
    xt, yt = torch.from_numpy(xtr), torch.from_numpy(yn)
    spe = math.ceil(n_train / 128)
    t0, out = time.time(), []
    for half in range(int(epochs * 2)):
        order = tz.epoch_order(seed, half // 2, n_train)
        m.train()
        for b in range(0, spe // 2) if half % 2 == 0 else range(spe // 2, spe):
            idx = order[b * 128:(b + 1) * 128]
            loss = F.cross_entropy(m(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        m.eval()
        with torch.no_grad():
            p = m(torch.from_numpy(data["x_eval"])).argmax(1).numpy()
            ptr = m(xt[:1000]).argmax(1).numpy()
        out.append(((half + 1) / 2, round(100 * (p == data["y_eval"]).mean(), 1),
                    round(100 * (ptr == yn[:1000]).mean(), 1)))
    print(argv, f"{time.time() - t0:.0f}s", " ".join(f"{e:g}:{a}/{t}" for e, a, t in out),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
