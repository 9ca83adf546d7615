#!/usr/bin/env python3
"""Readouts (METHODS §A) cost: onnxdiag vs plain ORT inference vs an equivalent PyTorch pipeline.

    python benchmarks/bench_readouts.py [--sample models/sample] [--n 5000]
    python benchmarks/bench_readouts.py --smoke      # 512 images, one repeat, seconds

On N real Fashion-MNIST test images and the bundled sample model:
  plain ORT       plain inference of the model (baseline)
  readout pass    onnxdiag's pass: head features + logits exposed, every readout accumulated
  readouts cmd    the whole `readouts` verb in-process (load, check, analyse, session, pass)
  torch pipeline  the same model in PyTorch eager (weights loaded from the ONNX initializers),
                  forward with the head's input detached, cross-entropy, backward through the
                  head only, the gradient norm accumulated (same threads as ORT)
Timings are the best of --repeat runs after a warm-up. Requires torch (pip install -e .[tools]).

Consistency checks (every run): the head-gradient norm of onnxdiag (float64 closed form) and
of the torch pipeline (float32 autograd) agree to 1e-5 relative, and the `readouts` verb
reports the readout pass's value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT, best_of, check, load_fashion_mnist_test  # noqa: E402


def torch_model(sample: Path):
    """The sample's PyTorch module (tools/make_sample.py) with the ONNX model's weights."""
    import onnx
    import torch
    from onnx import numpy_helper

    sys.path.insert(0, str(ROOT / "tools"))
    from make_sample import build_model

    manifest = json.loads((sample / "manifest.json").read_text())
    arch = manifest["architecture"]
    net = build_model(tuple(arch["widths"]), **({"stem_pool": arch["stem_pool"]}
                                                if "stem_pool" in arch else {}))
    init = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy())
            for t in onnx.load(sample / "model.onnx").graph.initializer}
    state = net.state_dict()
    missing = [k for k in state if k not in init and not k.endswith("num_batches_tracked")]
    if missing:
        raise SystemExit(f"ONNX initializers do not cover the torch weights: {missing[:5]}")
    net.load_state_dict({k: init.get(k, v).reshape(v.shape) for k, v in state.items()})
    return net.eval()


def torch_pipeline(net, x: np.ndarray, y: np.ndarray, batch_size: int) -> float:
    """Eager forward, features detached, CE loss, backward through the head: ‖G_W‖_F."""
    import torch

    feats = {}
    hook = net.fc.register_forward_pre_hook(lambda m, a: feats.__setitem__("z", a[0]))
    grad = torch.zeros_like(net.fc.weight)
    try:
        for start in range(0, len(x), batch_size):
            xb = torch.from_numpy(x[start:start + batch_size])
            yb = torch.from_numpy(y[start:start + batch_size])
            with torch.no_grad():
                net(xb)
            z = feats["z"].detach()
            w = net.fc.weight.detach().requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(z @ w.T + net.fc.bias.detach(), yb,
                                                     reduction="sum")
            (g,) = torch.autograd.grad(loss, w)
            grad += g
    finally:
        hook.remove()
    return float(torch.linalg.norm(grad / len(x)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--sample", default=str(ROOT / "models" / "sample"))
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="512 images, one repeat (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.n, args.repeat = 512, 1
    with tempfile.TemporaryDirectory(prefix="bench-readouts-") as tmp:
        result = measure(args, Path(tmp))
    for k, v in result["seconds"].items():
        print(f"{k:16s} {v:8.3f} s")
    for k, v in result["ratios"].items():
        print(f"{k:32s} {v:6.3f}")
    agree = result["agreement"]
    ours, theirs = agree["onnxdiag_head_grad"], agree["torch_head_grad"]
    print(f"head-gradient norm: onnxdiag {ours:.8f}, torch {theirs:.8f}")
    check(abs(ours - theirs) <= 1e-5 * abs(ours),
          f"head-gradient norm onnxdiag = torch to 1e-5 relative ({ours:.8f} vs {theirs:.8f})")
    verb = agree["readouts_verb_head_grad"]
    check(abs(verb - ours) <= 1e-9 * abs(ours),
          f"the readouts verb reports the readout pass's head-gradient norm ({verb:.8f})")
    return 0


def measure(args, tmp: Path) -> dict:
    """Every timing of the benchmark and the values the checks compare."""
    import onnxruntime as ort
    import torch

    from onnxdiag import DataRequest, ReportTarget, Runtime
    from onnxdiag.commands.analyze import readouts_report
    from onnxdiag.data.source import open_data
    from onnxdiag.evaluate import make_head_runner
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model
    from onnxdiag.runtime.runner import OrtRunner
    from onnxdiag.selection.probe import probe_model

    sample = Path(args.sample)
    x, y = load_fashion_mnist_test(args.n)
    npz = tmp / f"probe_{args.n}.npz"
    np.savez(npz, input=x, labels=y)
    model = load_model(sample / "model.onnx")
    structure = analyze_structure(model)
    source = open_data({"input": x, "labels": y}, get_input_specs(model),
                       batch_size=args.batch_size)
    plain, head_runner = OrtRunner(model), make_head_runner(model, structure.head)
    threads = ort.SessionOptions().intra_op_num_threads or os.cpu_count()
    torch.set_num_threads(threads)
    net = torch_model(sample)

    def run_plain():
        for batch in source.batches():
            plain.run(batch.feeds)

    def run_verb():
        return readouts_report(
            str(sample / "model.onnx"), data=DataRequest(str(npz), batch_size=args.batch_size),
            runtime=Runtime(progress=False), report=ReportTarget(write=False))

    result = {}
    ours = probe_model(model, structure, source, runner=head_runner, targets="labels",
                       norm="raw")
    theirs = torch_pipeline(net, x, y, args.batch_size)
    verb = run_verb().report["readouts"]["readouts"]["values"]["head_grad"]
    result["agreement"] = {"onnxdiag_head_grad": ours.readouts.values["head_grad"],
                           "torch_head_grad": theirs, "readouts_verb_head_grad": verb}
    result["seconds"] = {
        "plain ORT": best_of(run_plain, args.repeat),
        "readout pass": best_of(lambda: probe_model(model, structure, source,
                                                    runner=head_runner), args.repeat),
        "readouts cmd": best_of(run_verb, args.repeat),
        "torch pipeline": best_of(lambda: torch_pipeline(net, x, y, args.batch_size),
                                  args.repeat),
    }
    s = result["seconds"]
    result["ratios"] = {"readout pass / plain ORT": s["readout pass"] / s["plain ORT"],
                        "readouts cmd / torch pipeline": s["readouts cmd"] / s["torch pipeline"]}
    result.update(n_images=args.n, batch_size=args.batch_size, threads=threads,
                  torch=torch.__version__, onnxruntime=ort.__version__)
    return result


if __name__ == "__main__":
    sys.exit(main())
