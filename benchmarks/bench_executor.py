"""Checkpoint-series scoring with --executor local vs a 2-worker local Ray (issue 9).

    python benchmarks/bench_executor.py --repeat 3
    python benchmarks/bench_executor.py --smoke      # 4 checkpoints, small samples, seconds

Reports the wall time of `select` on the bundled 16-checkpoint series with local worker
processes and with Ray, the Ray start-up (ray.init of a 2-CPU local instance) and
shutdown separately, and whether the two give identical readouts.

Channels row: the `channels` statistics pass over the 1,000 calibration images of the
sample (batch 64; ``--channels-n N`` tiles them to N images) in one process, sharded
over local worker processes and over the Ray workers (workers read their batch range
from the .npz path), with the largest difference of the merged moments from the single
pass.

Consistency checks (every run): identical readouts from local processes and Ray, merged
moments equal to the single pass within 1e-9 relative. Requires Ray (the [ray] extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import SAMPLE, check  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--channels-n", type=int, default=1000,
                    help="images of the channels row (above 1,000: the calibration set "
                         "tiled into a temporary .npz)")
    ap.add_argument("--smoke", action="store_true",
                    help="one repeat, 4 checkpoints, 256 probe / 500 eval / 256 channels "
                         "images (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeat, args.channels_n = 1, 256

    import ray

    from onnxdiag.runtime.executor import LocalExecutor, RayExecutor

    run_select = select_runner(args)
    t_local, local = best(lambda: run_select(LocalExecutor(args.workers)), args.repeat)
    t0 = time.perf_counter()
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    t_start = time.perf_counter() - t0
    executor = RayExecutor()
    run_select(executor)  # warm-up: first tasks import onnxruntime in fresh workers
    t_ray, on_ray = best(lambda: run_select(executor), args.repeat)
    t_ch_single, t_ch_local, t_ch_ray, ch_diff = channels_rows(args, executor, LocalExecutor)
    t0 = time.perf_counter()
    ray.shutdown()
    t_stop = time.perf_counter() - t0

    def values(rep):
        return [c["result"]["readouts"]["values"] for c in rep["selection"]["checkpoints"]]

    n_ckpt = len(local["selection"]["checkpoints"])
    same = json.dumps(values(local), sort_keys=True) == json.dumps(values(on_ray),
                                                                   sort_keys=True)
    print(f"| scoring {n_ckpt} checkpoints ({args.probe_n:,} probe + {args.eval_n:,} eval "
          f"images) | seconds |\n"
          f"|---|---:|\n"
          f"| local, {args.workers} worker processes | {t_local:.2f} |\n"
          f"| Ray, {args.workers} workers (warm), tasks only | {t_ray:.2f} |\n"
          f"| Ray start-up (`ray.init`, local {args.workers}-CPU instance) | {t_start:.2f} |\n"
          f"| Ray shutdown | {t_stop:.2f} |\n\n"
          f"Identical readouts (JSON, all {n_ckpt} checkpoints): {same}\n\n"
          f"| channels statistics, {args.channels_n:,} images (batches of 64) | seconds |\n"
          f"|---|---:|\n"
          f"| one pass in this process (`--executor local`, default) | {t_ch_single:.2f} |\n"
          f"| local, {args.workers} worker processes, {args.workers} shards | "
          f"{t_ch_local:.2f} |\n"
          f"| Ray, {args.workers} workers (warm), {args.workers} shards | {t_ch_ray:.2f} |\n\n"
          f"Largest relative difference of the merged moments (mean, covariance; all "
          f"layers) from the single pass: {ch_diff:.1e}")
    check(same, f"identical readouts of {n_ckpt} checkpoints from local processes and Ray")
    check(ch_diff < 1e-9, f"merged moments = single pass ({ch_diff:.1e} < 1e-9 relative)")
    return 0


def select_runner(args):
    """``run(executor) -> report`` of `select` on the series (a subset with --smoke)."""
    from onnxdiag import DataRequest, ReportTarget, Runtime
    from onnxdiag.commands.select import select_report

    series = str(SAMPLE / "checkpoints" / "checkpoints.json")
    probe, evaluation = DataRequest(str(SAMPLE / "calib.npz")), str(SAMPLE / "eval.npz")
    args.probe_n, args.eval_n = 1000, 2000
    if args.smoke:
        series = [str(SAMPLE / "checkpoints" / f"ckpt_{i:03d}.onnx") for i in (0, 5, 10, 15)]
        probe, evaluation = (DataRequest(probe.source, limit=256),
                             DataRequest(evaluation, limit=500))
        args.probe_n, args.eval_n = 256, 500

    def run(executor):
        return select_report(series, data=probe, eval_data=evaluation,
                             runtime=Runtime(executor=executor, progress=False),
                             report=ReportTarget(write=False)).report
    return run


def best(run, repeat: int):
    """(best wall time of ``repeat`` calls, the last call's result)."""
    t, out = float("inf"), None
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        out = run()
        t = min(t, time.perf_counter() - t0)
    return t, out


def channels_rows(args, ray_executor, LocalExecutor):
    """Best-of-``repeat`` times of the statistics pass: single, local shards, Ray shards."""
    import numpy as np

    from onnxdiag.channels.collect import collect_channel_moments, collect_channel_moments_sharded
    from onnxdiag.commands.base import DataRequest
    from onnxdiag.graph import analyze_structure
    from onnxdiag.model.io import get_input_specs, load_model

    calib = str(SAMPLE / "calib.npz")
    n = args.channels_n
    if n != 1000:
        import tempfile

        with np.load(calib) as z:
            arrays = {k: np.resize(z[k], (n, *z[k].shape[1:])) for k in z.files}
        calib = str(Path(tempfile.mkdtemp()) / f"calib_{n}.npz")
        np.savez(calib, **arrays)
    model = load_model(SAMPLE / "model.onnx")
    structure = analyze_structure(model)
    request = DataRequest(calib, batch_size=64)

    def single():
        return collect_channel_moments(model, structure, request.open(get_input_specs(model)),
                                       seed=0)

    def sharded(executor):
        return lambda: collect_channel_moments_sharded(model, structure, request,
                                                       executor=executor, seed=0)

    sharded(ray_executor)()  # warm-up of the Ray workers
    (t1, ref), (t2, loc), (t3, ray_) = (best(single, args.repeat),
                                        best(sharded(LocalExecutor(args.workers)), args.repeat),
                                        best(sharded(ray_executor), args.repeat))
    diff = 0.0
    for other in (loc, ray_):
        for name, a in ref.layers.items():
            b = other.layers[name]
            assert a.n_images == b.n_images == n
            for x, y in ((a.task.mean, b.task.mean), (a.task.cov(), b.task.cov())):
                diff = max(diff, float(np.abs(x - y).max() / np.abs(x).max()))
    return t1, t2, t3, diff


if __name__ == "__main__":
    sys.exit(main())
