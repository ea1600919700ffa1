"""Half-precision kernels ONNX Runtime lacks: its session-creation error, said in the user's terms.

A mixed-precision graph (``mixed_precision.enabled``) computes matmuls, linear layers and
convolutions in float16 or bfloat16. ONNX Runtime's CPU execution provider has float16 kernels
for them but almost no bfloat16 ones (1.31.1: no bfloat16 ``MatMul``, ``Gemm``, ``Neg``...), and
the session then fails with ``NOT_IMPLEMENTED : Could not find an implementation for MatMul(13)
node with name '...'``. ``missing_kernels_explained`` turns that into an error that names the
dtype, the device, the operator, the node and the fix. Sessions are made when a shape signature
is first selected, before anything runs, so the error leaves the trainer's state unchanged.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

_MISSING = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
# where the operator's schema at the graph's opset takes no such type at all (ONNX Runtime's CPU Conv, TopK in
# bfloat16): the graph is refused as invalid when the session loads it
_REFUSED_TYPE = re.compile(r"Type 'tensor\((?:b?float16)\)' of input parameter \([^)]*\) of operator \((\w+)\) in node "
                           r"\(([^)]*)\) is invalid")


class MissingKernelError(RuntimeError):
    """The execution provider has no kernel for an operator in the mixed-precision dtype."""


def missing_kernel_error(exc: BaseException, dtype: str, device: str) -> MissingKernelError | None:
    """The error to raise instead of ``exc``, or None when ``exc`` is not a missing kernel.

    Args:
        exc: what ONNX Runtime raised while creating a session.
        dtype: ``mixed_precision.dtype`` (``"float16"`` or ``"bfloat16"``).
        device: ``device.id`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``).

    Returns:
        A ``MissingKernelError`` naming the operator, its node and the fix, or None.
    """
    found = _MISSING.search(str(exc))
    if found is not None:
        op, opset, node = found.groups()
        where = f"opset {opset}; node {node!r}"
    else:
        found = _REFUSED_TYPE.search(str(exc))
        if found is None:
            return None
        op, node = found.groups()
        where = f"node {node!r}: its schema refuses the type"
    provider = "CPU" if device == "cpu" else "CUDA"
    other = "float16" if dtype == "bfloat16" else "bfloat16"
    if device == "cpu" and dtype == "bfloat16":
        # docs/performance.md, "Half precision on the CPU": MLAS has no x86 kernel that uses AVX512-BF16, AMX or
        # AVX512-FP16, and its float16 products run no faster than float32
        fix = ("no ONNX Runtime CPU kernel multiplies bfloat16 (its x86 matrix products use none of AVX512-BF16, "
               "AMX or AVX512-FP16; float16 runs at float32's speed there): train in fp32 on the CPU "
               "(mixed_precision.enabled=False), or use device 'cuda'")
    elif device == "cpu":
        fix = "use device 'cuda', or train in fp32 on the CPU (mixed_precision.enabled=False)"
    else:
        fix = f"use dtype '{other}', or train in fp32 (mixed_precision.enabled=False)"
    return MissingKernelError(
        f"mixed_precision.dtype={dtype!r} on device {device!r}: ONNX Runtime's {provider} execution provider has "
        f"no {dtype} kernel for {op} ({where}); {fix}")


_UNCHANGED = contextlib.nullcontext()  # fp32: nothing to translate (reusable: it holds no state)


def missing_kernels_explained(dtype: str | None, device: str) -> contextlib.AbstractContextManager[None]:
    """A block that re-raises ONNX Runtime's missing-kernel error of a mixed-precision graph as a
    ``MissingKernelError`` (``missing_kernel_error``); anything else, and everything when
    ``dtype`` is None (fp32), passes through unchanged.

    Every step enters one, so fp32 gets a shared no-op block: entering a generator-based one costs
    ~3 µs in a loop of calls, and several times that after a real-size step has left the caches cold.

    Raises:
        MissingKernelError: when a session of the block cannot be created for want of a kernel.
    """
    return _UNCHANGED if dtype is None else _explained(dtype, device)


@contextlib.contextmanager
def _explained(dtype: str, device: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # onnxruntime's pybind exception types are not importable by a stable path
        translated = missing_kernel_error(exc, dtype, device)
        if translated is None:
            raise
        raise translated from exc


__all__ = ["MissingKernelError", "missing_kernel_error", "missing_kernels_explained"]
