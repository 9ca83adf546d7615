"""One CPU memory arena shared by the many short-lived sessions of a segmented pass.

Every ONNX Runtime session has its own CPU arena for its intermediate tensors; a new
session's arena is fresh memory, page-faulted in on its first runs and given back when
the session is dropped. The sequential repair passes (:mod:`onnxdiag.sparsity.segments`)
open one session per measured layer — 54 on a ResNet-50 — so that cost recurs for every
segment. A session that opts in (:func:`use_shared_arena`) draws from one arena
registered with ONNX Runtime's environment instead (``CreateAndRegisterAllocator`` and
the session option ``session.use_env_allocators``), whose memory is touched once and
reused by every later segment.

The arena grows by what is requested (not the next power of two): it ends the size of
the largest segment's working set and is kept for the life of the process (ONNX
Runtime's environment owns it). Kernels and results are those of a session with its own
arena. Measured (benchmarks/RESULTS.md): ResNet-50's segmented pass 2.65–2.81× → 1.93–2.10×
a dense pass, minor page faults 1.1 M → 0.28 M, peak memory unchanged.
"""

from __future__ import annotations

#: Whether this process's environment has the shared CPU arena (None: not tried yet).
_REGISTERED: bool | None = None


def shared_cpu_arena() -> bool:
    """Register the shared CPU arena with ONNX Runtime's environment (once per process);
    whether sessions can use it. False when this ONNX Runtime cannot register one."""
    global _REGISTERED
    if _REGISTERED is None:
        import onnxruntime as ort  # lazily, as everywhere: the callers have imported it

        try:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                     ort.OrtMemType.DEFAULT)
            # max memory 0 (no limit), extend strategy 1 (kSameAsRequested), defaults
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
            _REGISTERED = True
        except Exception:  # an ONNX Runtime without it: sessions keep their own arenas
            _REGISTERED = False
    return _REGISTERED


def use_shared_arena(options, providers: list[str]) -> bool:
    """Let a session with ``options`` draw CPU memory from the shared arena; only for a
    CPU-only session (``providers``), where the arena holds all of its tensors. Whether
    it was set."""
    if list(providers) != ["CPUExecutionProvider"] or not shared_cpu_arena():
        return False
    options.add_session_config_entry("session.use_env_allocators", "1")
    return True
