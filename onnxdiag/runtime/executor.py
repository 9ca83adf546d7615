"""Where independent units of work run: this machine's cores, or a Ray cluster.

``--executor local`` (default) uses worker processes on this machine;
``--executor ray`` starts a local Ray instance and ``--executor ray=HOST:PORT`` connects
to a running cluster (``ray start --head`` on one machine, ``ray start --address=…`` on
the others).  Both run the same worker functions on the same inputs, so the results
are identical; Ray only changes where they run.

:meth:`Executor.map` runs ``fn(item, *shared)`` for every item and yields
``(position, result, error)`` as units finish: a failing unit is reported with its
error message and never loses the others' results (:class:`UnitError` keeps the
original exception's type and traceback).  ``shared`` arguments (a probe
batch, a captured layer input, …) are shipped once: through Ray's object store, or
copied once per worker process locally.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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


class UnitError(str):
    """A failed unit's message, which keeps the original exception's type and traceback.

    It is the ``str`` the reports show (the user error's own message, or
    ``"Type: message"`` for anything else), so it serialises like one; ``type_name``,
    ``traceback`` (the worker's formatted traceback) and ``user_error`` (an
    OnnxDiagError: the user can fix it) travel with it for ``--debug`` and for
    :func:`raise_failures`.
    """

    type_name: str
    traceback: str
    user_error: bool

    def __new__(cls, message: str, *, type_name: str = "", traceback: str = "",
                user_error: bool = False):
        obj = super().__new__(cls, message)
        obj.type_name, obj.traceback, obj.user_error = type_name, traceback, user_error
        return obj

    def __reduce__(self):  # keep the attributes across processes (pickle)
        return (_unit_error, (str(self), self.type_name, self.traceback, self.user_error))

    @classmethod
    def of(cls, exc: BaseException) -> UnitError:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        user = isinstance(exc, OnnxDiagError)
        text = str(exc) if user else f"{type(exc).__name__}: {exc}"
        return cls(text, type_name=type(exc).__name__, traceback=tb, user_error=user)


def _unit_error(message, type_name, tb, user_error):
    return UnitError(message, type_name=type_name, traceback=tb, user_error=user_error)


class UnitFailure(RuntimeError):
    """A unit of work failed with a bug (not a user error): the command stops and the CLI
    reports an internal error; ``remote_traceback`` is the worker's traceback."""

    def __init__(self, message: str, error: UnitError):
        super().__init__(message)
        self.error = error
        self.remote_traceback = error.traceback


def raise_failures(errors, message: str) -> None:
    """Stop a command whose failed units it cannot do without.

    ``errors``: the failed units' :class:`UnitError` (or plain str) values, first first;
    ``message`` says what failed (``{first}`` is replaced by the first error). When every
    failure is a user error this raises OnnxDiagError(message); otherwise
    :class:`UnitFailure` carrying the first bug's traceback.
    """
    errors = list(errors)
    if not errors:
        return
    text = message.replace("{first}", str(errors[0]))
    bugs = [e for e in errors if not getattr(e, "user_error", True)]
    if not bugs:
        raise OnnxDiagError(text)
    raise UnitFailure(text, bugs[0])


def _call(fn, item, shared):
    """Run one unit; an exception becomes the unit's :class:`UnitError`."""
    try:
        return fn(item, *shared), None
    except Exception as exc:  # noqa: BLE001 - one unit must not stop the others
        return None, UnitError.of(exc)


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

    @property
    def in_process(self) -> bool:
        """Whether every unit runs in this process, one after the other (no copies)."""
        return False

    @property
    def capacity(self) -> int:
        """How many units can run at once."""
        return 1

    @property
    def reads_paths(self) -> bool:
        """Whether every worker can open this machine's file paths (local processes: yes;
        a Ray cluster: only with a shared filesystem, so data are shipped instead)."""
        return False

    def ship(self, request, source):
        """What to send workers so that each can read the data of ``request`` (a
        :class:`~onnxdiag.commands.base.DataRequest`) that this process opened as
        ``source``: the source itself in this process; the request, when workers on this
        machine can reopen its path; else its samples, read once here (shipped once as a
        shared argument). Workers turn it back into a source with :func:`receive`."""
        if self.in_process:
            return source
        if self.reads_paths and request.by_path:
            return request
        return request.in_memory(source)

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

    @property
    def in_process(self) -> bool:
        return self.capacity == 1

    @property
    def capacity(self) -> int:
        return max(1, self.jobs or os.cpu_count() or 1)

    @property
    def reads_paths(self) -> bool:
        return True

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
                    error = UnitError.of(exc)
                    result, error = None, UnitError(f"worker failed: {error}",
                                                    type_name=error.type_name,
                                                    traceback=error.traceback)
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

    @property
    def capacity(self) -> int:
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

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
                first = str(exc).splitlines()[0] if str(exc) else ""
                result, error = None, UnitError(
                    f"Ray task failed: {type(exc).__name__}: {first}",
                    type_name=type(exc).__name__, traceback=str(exc))
            yield i, result, error

    def close(self) -> None:
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()
        self._started = False


def _ray_unit(fn, item, *shared):
    # Ray resolves top-level ObjectRef arguments before the call.
    return _call(fn, item, shared)


def receive(shipped, specs):
    """A worker's DataSource from what :meth:`Executor.ship` sent: the source itself, or a
    request opened here for the model inputs ``specs``."""
    from ..data.request import DataRequest

    return shipped.open(specs) if isinstance(shipped, DataRequest) else shipped


def wants_gpu(providers) -> bool:
    """Whether ``providers`` (a list or a comma string) request CUDA / TensorRT: only then
    does a task ask Ray for a GPU."""
    text = ",".join(providers) if isinstance(providers, (list, tuple)) else str(providers or "")
    return "cuda" in text.lower() or "tensorrt" in text.lower()


@contextmanager
def open_executor(executor=None, jobs: int | None = None, *,
                  local_jobs: int | None = None) -> Iterator[Executor]:
    """The executor for a verb's ``executor`` argument, as a context manager: an
    :class:`Executor` is used as given (and left open); a spec string or None is made
    here and closed on exit. ``local_jobs``: worker processes for ``local`` when ``jobs``
    is None (None = one per core, 1 = everything in this process)."""
    if isinstance(executor, Executor):
        yield executor
        return
    spec = parse_executor(executor)
    n = jobs if jobs is not None or spec.kind != "local" else local_jobs
    made = make_executor(spec, jobs=n)
    try:
        yield made
    finally:
        made.close()


def make_executor(spec: str | ExecutorSpec | None = None, *, jobs: int | None = None) -> Executor:
    """The executor for a ``--executor`` value (``jobs``: local worker processes)."""
    spec = parse_executor(spec)
    if spec.kind == "local":
        return LocalExecutor(jobs)
    return RayExecutor(spec.address, num_cpus=jobs)
