"""The process-wide host arena of ONNX Runtime's CPU sessions (``devices.CPUDevice``): one arena that grows by
what is asked for, shared by every session, and its free regions handed back to the system."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import onnx
import onnxruntime as ort

_SHARED_ARENA = False


def use_shared_arena(options: ort.SessionOptions) -> None:
    """Let the session allocate from one process-wide CPU arena that grows by what is requested.

    Every session otherwise has its own arena growing in powers of two; sharing one that grows
    exactly was measured on the BERT-like benchmark at 248 ms/step and 737 MB peak RSS, against
    263 ms and 995 MB with per-session arenas (``docs/benchmarks.md``).
    """
    global _SHARED_ARENA
    if not _SHARED_ARENA:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        # max_mem 0: no limit; extend strategy 1: kSameAsRequested; defaults for the chunk sizes
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
        _SHARED_ARENA = True
    options.add_session_config_entry("session.use_env_allocators", "1")


_SHRINKER: tuple[ort.InferenceSession, ort.RunOptions] | None = None


@functools.cache
def _malloc_trim():
    """The C library's ``malloc_trim`` (glibc's), or None where it has none."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # no C library to load by that name (Windows)
        return None


def shrink_shared_arena() -> None:
    """Hand the shared CPU arena's wholly free regions back to the system.

    ONNX Runtime shrinks an arena at the end of a run whose options ask for it
    (``memory.enable_memory_arena_shrinkage``, onnxruntime_run_options_config_keys.h); a one-node
    session on the shared arena runs for that. The regions go back to ``malloc``, and glibc's keeps
    those it did not map apart (under its mmap threshold, which rises to 32 MB once a larger block was
    freed) resident until ``malloc_trim``: BERT-base (B4×S128) after its training steps went
    2440 -> 2399 MB by the shrink alone, 2440 -> 2132 MB with the trim.
    """
    global _SHRINKER
    if not _SHARED_ARENA:
        return
    if _SHRINKER is None:
        value = onnx.helper.make_tensor_value_info
        graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "shrink",
                                       [value("x", onnx.TensorProto.FLOAT, [1])],
                                       [value("y", onnx.TensorProto.FLOAT, [1])])
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=7)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        use_shared_arena(options)
        run_options = ort.RunOptions()
        run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        _SHRINKER = (ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]),
                     run_options)
    session, run_options = _SHRINKER
    session.run(None, {"x": np.zeros(1, np.float32)}, run_options)
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


__all__ = ["shrink_shared_arena", "use_shared_arena"]
