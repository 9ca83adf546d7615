"""Where independent units of work run: this machine's cores, or a Ray cluster.

``--executor local`` (default) uses worker processes on this machine;
``--executor ray`` starts a local Ray instance and ``--executor ray=HOST:PORT`` connects
to a running cluster (``ray start --head`` on one machine, ``ray start --address=…`` on
the others).  Both run the same worker functions on the same inputs, so the results
are identical; Ray only changes where they run.

:meth:`Executor.map` runs ``fn(item, *shared)`` for every item and yields
``(position, result, error)`` as units finish: a failing unit is reported with its
error message and never loses the others' results.  ``shared`` arguments (a probe
batch, a captured layer input, …) are shipped once: through Ray's object store, or
copied once per worker process locally.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..errors import MissingExtraError, OnnxDiagError

RAY_HINT = "pip install 'onnxdiag[ray]'"


@dataclass(frozen=True)
class ExecutorSpec:
    """A parsed ``--executor`` value."""

    kind: str  # "local" or "ray"
    address: str | None = None

    def __str__(self) -> str:
        return self.kind if self.address is None else f"{self.kind}={self.address}"


def parse_executor(value: str | ExecutorSpec | None) -> ExecutorSpec:
    """``local``, ``ray`` or ``ray=ADDRESS`` (``ray=auto`` joins the cluster of this node)."""
    if value is None:
        return ExecutorSpec("local")
    if isinstance(value, ExecutorSpec):
        return value
    kind, _, address = str(value).strip().partition("=")
    kind = kind.strip().lower()
    if kind == "local" and not address:
        return ExecutorSpec("local")
    if kind == "ray":
        return ExecutorSpec("ray", address.strip() or None)
    raise OnnxDiagError(f"Unknown executor '{value}'; use local, ray, or ray=HOST:PORT.")


def _call(fn, item, shared):
    """Run one unit; an exception becomes the unit's error message."""
    try:
        return fn(item, *shared), None
    except OnnxDiagError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - one unit must not stop the others
        return None, f"{type(exc).__name__}: {exc}"


# Local process pool: the shared arguments are sent once per worker process through the
# pool initializer, not once per unit.
_WORKER_SHARED: tuple = ()


def _init_worker(shared: tuple) -> None:
    global _WORKER_SHARED
    _WORKER_SHARED = shared


def _call_in_worker(fn, item):
    return _call(fn, item, _WORKER_SHARED)


class Executor:
    """Base class: run units, yield (position, result, error) as they finish."""

    name = "executor"

    def map(self, fn: Callable, items: Sequence, shared: tuple = (), *,
            label: str | None = None,
            gpu: bool = False) -> Iterator[tuple[int, object, str | None]]:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"kind": self.name}

    def close(self) -> None:
        """Release what this executor started (a local Ray instance)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalExecutor(Executor):
    """Worker processes on this machine (``jobs`` = 1 runs in this process)."""

    name = "local"

    def __init__(self, jobs: int | None = None):
        self.jobs = jobs

    def describe(self) -> dict:
        return {"kind": "local", "jobs": self.jobs or os.cpu_count()}

    def map(self, fn, items, shared=(), *, label=None, gpu=False):
        from .progress import progress

        items = list(items)
        jobs = max(1, min(self.jobs or os.cpu_count() or 1, len(items) or 1))
        if jobs == 1:
            seq = progress(enumerate(items), len(items), label) if label else enumerate(items)
            for i, item in seq:
                yield (i, *_call(fn, item, shared))
            return
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker,
                                 initargs=(tuple(shared),)) as pool:
            futures = {pool.submit(_call_in_worker, fn, item): i for i, item in enumerate(items)}
            done = as_completed(futures)
            if label:
                done = progress(done, len(futures), label)
            for future in done:
                try:
                    result, error = future.result()
                except Exception as exc:  # noqa: BLE001 - a crashed worker process
                    result, error = None, f"worker failed: {type(exc).__name__}: {exc}"
                yield futures[future], result, error


class RayExecutor(Executor):
    """Ray tasks: one per unit; ``shared`` arguments go to the object store once."""

    name = "ray"

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None):
        try:
            import ray
        except ImportError as exc:
            raise MissingExtraError(f"--executor ray needs Ray; install it with {RAY_HINT}.") \
                from exc
        self._ray = ray
        self.address = address
        self._started = False
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, log_to_driver=False,
                          configure_logging=False)
            try:
                if address:
                    ray.init(address=address, **kwargs)
                else:
                    ray.init(num_cpus=num_cpus, **kwargs)
            except Exception as exc:  # noqa: BLE001 - connection problems are user errors
                where = f"the Ray cluster at {address}" if address else "a local Ray instance"
                raise OnnxDiagError(f"Could not start or reach {where}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else exc!r}; check "
                                    "`ray status` on the head node and the address.") from exc
            self._started = True

    def describe(self) -> dict:
        res = self._ray.cluster_resources()
        return {"kind": "ray", "address": self.address or "local",
                "nodes": len(self._ray.nodes()), "cpus": res.get("CPU"), "gpus": res.get("GPU")}

    def map(self, fn, items, shared=(), *, label=None, gpu=False):
        from .progress import progress

        ray = self._ray
        items = list(items)
        refs = [ray.put(s) for s in shared]  # once, whatever the number of tasks
        task = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0, max_retries=0)(_ray_unit)
        pending = {task.remote(fn, item, *refs): i for i, item in enumerate(items)}

        def finished():
            remaining = list(pending)
            while remaining:
                done, remaining = ray.wait(remaining, num_returns=1)
                yield done[0]

        seq = progress(finished(), len(pending), label) if label else finished()
        for ref in seq:
            i = pending[ref]
            try:
                result, error = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a task or its worker died
                result, error = None, f"Ray task failed: {type(exc).__name__}: " \
                                      f"{str(exc).splitlines()[0] if str(exc) else ''}"
            yield i, result, error

    def close(self) -> None:
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()
        self._started = False


def _ray_unit(fn, item, *shared):
    # Ray resolves top-level ObjectRef arguments before the call.
    try:
        return _call(fn, item, shared)
    except BaseException:  # pragma: no cover - keep the message, drop the worker's frames
        return None, traceback.format_exc(limit=1)


def worker_count(executor: Executor) -> int:
    """How many units can run at once: local worker processes, or the Ray cluster's CPUs."""
    if isinstance(executor, LocalExecutor):
        return max(1, executor.jobs or os.cpu_count() or 1)
    if isinstance(executor, RayExecutor):
        return max(1, int(executor._ray.cluster_resources().get("CPU", 1)))
    return 1


def wants_gpu(providers) -> bool:
    """Whether ``providers`` (a list or a comma string) request CUDA / TensorRT: only then
    does a task ask Ray for a GPU."""
    text = ",".join(providers) if isinstance(providers, (list, tuple)) else str(providers or "")
    return "cuda" in text.lower() or "tensorrt" in text.lower()


def open_executor(executor, jobs: int | None = None, *,
                  local_jobs: int | None = None) -> tuple[Executor, bool]:
    """``(executor, own)`` for a verb's ``executor`` argument: an Executor is used as given
    (``own`` False); a spec string or None is made here (``own`` True: close it after).
    ``local_jobs``: worker processes for ``local`` when ``jobs`` is None (1 = in process)."""
    if isinstance(executor, Executor):
        return executor, False
    spec = parse_executor(executor)
    n = jobs if jobs is not None or spec.kind != "local" else local_jobs
    return make_executor(spec, jobs=n), True


def make_executor(spec: str | ExecutorSpec | None = None, *, jobs: int | None = None) -> Executor:
    """The executor for a ``--executor`` value (``jobs``: local worker processes)."""
    spec = parse_executor(spec)
    if spec.kind == "local":
        return LocalExecutor(jobs)
    return RayExecutor(spec.address, num_cpus=jobs)
