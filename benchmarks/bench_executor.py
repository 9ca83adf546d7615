"""Checkpoint-series scoring with --executor local vs a 2-worker local Ray (issue 9).

    python benchmarks/bench_executor.py --repeat 3

Reports the wall time of `select` on the bundled 16-checkpoint series with local worker
processes and with Ray, the Ray start-up (ray.init of a 2-CPU local instance) and
shutdown separately, and whether the two give identical readouts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "models" / "sample"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)

    import ray

    from onnxdiag.analysis import select_report
    from onnxdiag.executor import LocalExecutor, RayExecutor

    common = dict(data=str(SAMPLE / "calib.npz"), eval_data=str(SAMPLE / "eval.npz"),
                  write=False, progress=False)
    series = str(SAMPLE / "checkpoints" / "checkpoints.json")

    def timed(executor):
        best, report = float("inf"), None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            report = select_report(series, executor=executor, **common).report
            best = min(best, time.perf_counter() - t0)
        return best, report

    t_local, local = timed(LocalExecutor(args.workers))
    t0 = time.perf_counter()
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    t_start = time.perf_counter() - t0
    executor = RayExecutor()
    timed(executor)  # warm-up: first tasks import onnxruntime in fresh workers
    t_ray, on_ray = timed(executor)
    t0 = time.perf_counter()
    ray.shutdown()
    t_stop = time.perf_counter() - t0

    def values(rep):
        return [c["result"]["readouts"]["values"] for c in rep["selection"]["checkpoints"]]

    same = json.dumps(values(local), sort_keys=True) == json.dumps(values(on_ray),
                                                                   sort_keys=True)
    print(f"| scoring 16 checkpoints (1,000 probe + 2,000 eval images) | seconds |\n"
          f"|---|---:|\n"
          f"| local, {args.workers} worker processes | {t_local:.2f} |\n"
          f"| Ray, {args.workers} workers (warm), tasks only | {t_ray:.2f} |\n"
          f"| Ray start-up (`ray.init`, local {args.workers}-CPU instance) | {t_start:.2f} |\n"
          f"| Ray shutdown | {t_stop:.2f} |\n\n"
          f"Identical readouts (JSON, all 16 checkpoints): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
