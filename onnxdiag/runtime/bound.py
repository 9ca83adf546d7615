"""A session's outputs written into buffers that are reused from batch to batch (IO binding).

A pass that exposes large tensors (the RR capture: every prunable layer's input) and
folds each batch before the next gets fresh output arrays from ONNX Runtime on every
run; above glibc's mmap threshold (32 MiB) each is page-faulted anew, which costs system
time of the order of the run itself on a 224×224 net. :class:`BoundRunner` runs a batch
in pieces of at most ``rows`` samples whose outputs ONNX Runtime writes straight into
slices of one buffer per output, allocated on the first batch and reused: the arrays it
returns are views of those buffers, valid until the next :meth:`BoundRunner.run`.
The outputs are those of :meth:`~onnxdiag.runtime.runner.OrtRunner.run` on the same
pieces (same kernels; tested). Anything else — a non-CPU provider, a graph that runs at
one batch size only, outputs whose trailing shape changes — falls back to the plain run.
"""

from __future__ import annotations

import numpy as np

from .batching import batch_len
from .runner import OrtRunner

#: Samples per ONNX Runtime run of a bound pass (8 images at 224×224 keep the session's
#: own working memory small; the batch the caller folds is unchanged).
BOUND_ROWS = 8


class BoundRunner:
    """Run ``runner`` on batches, fetching ``names`` into reused buffers (see the module
    docstring); ``rows``: samples per run."""

    def __init__(self, runner: OrtRunner, names, rows: int = BOUND_ROWS):
        self.runner = runner
        self.names = list(names)
        self.rows = max(1, int(rows))
        self.buffers: dict[str, np.ndarray] | None = None
        self.enabled = bool(self.names) and runner.providers[:1] == ["CPUExecutionProvider"]

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        """``{name: output}`` of one batch: views of the buffers when bound."""
        if not self.enabled:
            return self.runner.run(feeds, self.names)
        feeds = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
        n = batch_len(feeds)
        try:
            for i in range(0, n, self.rows):
                self._run_piece({k: v[i:i + self.rows] for k, v in feeds.items()}, i, n)
        except Exception:  # a shape or provider the binding cannot serve: run plainly
            self.enabled, self.buffers = False, None
            return self.runner.run(feeds, self.names)
        return {k: b[:n] for k, b in self.buffers.items()}

    def _run_piece(self, piece: dict, start: int, n: int) -> None:
        m = batch_len(piece)
        if self.buffers is None or len(next(iter(self.buffers.values()))) < n:
            if start:
                raise ValueError("the buffers are sized on a batch's first piece")
            out = self.runner.run(piece, self.names)
            if m == n and all(_reusable(v, m) for v in out.values()):
                self.buffers = dict(out)  # a one-piece batch: the run's own arrays, no copy
                return
            self.buffers = {k: np.empty((n, *np.shape(v)[1:]), np.asarray(v).dtype)
                            for k, v in out.items()}
            for k, v in out.items():
                self.buffers[k][:m] = v
            return
        session = self.runner.session
        binding = session.io_binding()
        for k, v in piece.items():
            binding.bind_cpu_input(k, v)
        for k in self.names:
            view = self.buffers[k][start:start + m]
            binding.bind_output(k, "cpu", 0, view.dtype.type, list(view.shape),
                                view.ctypes.data)
        session.run_with_iobinding(binding)


def _reusable(v, rows: int) -> bool:
    """Whether a run's output of ``rows`` samples can serve as a buffer later runs write
    into (an output whose first axis is not the samples' fails the binding as before)."""
    return (isinstance(v, np.ndarray) and v.ndim > 0 and v.shape[0] == rows
            and v.flags.c_contiguous and v.flags.writeable)
