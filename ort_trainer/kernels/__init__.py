"""ort_trainer's own ONNX Runtime kernels: a custom-operator library for what the standard
``onnxruntime`` / ``onnxruntime-gpu`` builds have no kernel for.

ONNX Runtime's gradient kernels (``GeluGrad``, ``LayerNormalizationGrad``, ``SoftmaxGrad``...) are
compiled only into its training builds, which stopped at 1.19; in today's builds a graph spells a
backward out of element-wise nodes, each one pass over memory. ``csrc/`` holds fused kernels for
the largest of those regions, registered with ONNX Runtime as custom operators of the domain
``DOMAIN`` (``SessionOptions.register_custom_ops_library``), each with a CPU kernel and, where the
library is built by ``nvcc``, a CUDA kernel that runs on the session's own CUDA stream (so CUDA
graph capture takes it in):

- ``GeluGrad(dy, x) -> dx`` and ``TanhGeluGrad(dy, x) -> dx``: ``dy`` times GELU's derivative at
  ``x`` (erf and tanh forms), float32, float16 and bfloat16, computed in float32 and rounded once,
  as torch's ``gelu_backward`` computes it on CUDA (``csrc/gelu.h``).

The library is built on first use from ``csrc/`` into ``$ORT_TRAINER_CACHE_DIR/kernels/<hash of
the sources and compiler>/`` (``~/.cache/ort_trainer`` by default; a temporary folder where caching is off,
``ORT_TRAINER_CACHE_DIR=off``): with ``nvcc`` where one is found (CPU and CUDA kernels, for
compute capability 8.0 and 9.0 and PTX for later GPUs; about a minute), else with the C++
compiler (CPU kernels only; seconds); processes that need it at once (a job's ranks on one machine)
build it once. ``$ORT_TRAINER_KERNELS_LIBRARY`` names a library built elsewhere instead (a GPU
machine without a compiler: ``make kernels`` writes one).

The C++ side declares only the parts of ONNX Runtime's C ABI it calls (``csrc/ort_abi.h``: the API
table's slots by index, which ONNX Runtime never moves, and the custom operator's struct).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from .._cache_root import cache_dir
from .._logging import logger

DOMAIN = "ort_trainer"  # the custom operators' ONNX domain
TORCH_OPS_DOMAIN = "ort_trainer.torch"  # torch_ops.py's operators' (torch's kernels: fused_attention, torch_products)
OPSET = 1
LIBRARY_ENV = "ORT_TRAINER_KERNELS_LIBRARY"
_CSRC = Path(__file__).resolve().parent / "csrc"
_NAME = "libort_trainer_kernels.so"
_CUDA_SOURCES = ("gelu.cu", "layer_norm.cu", "softmax.cu", "cross_entropy.cu", "add_half.cu", "half_copies.cu",
                 "dropout.cu")
# the operators' runs and registration (their CPU kernels: headers)
_SOURCES = ("ops.cc", "layer_norm_ops.cc", "elementwise_ops.cc")
_CUDA_ARCHS = ("-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
               "-gencode", "arch=compute_90,code=compute_90")


class KernelsUnavailable(RuntimeError):
    """ort_trainer's kernel library cannot be built or loaded here (the message says why and what to do)."""


def _compilers() -> tuple[str | None, str | None]:
    """(nvcc, C++ compiler): the paths of those found, None for the others."""
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    return nvcc, cxx


def _root() -> Path:
    """The cache's ``kernels/`` folder, or ``_scratch_root()`` where caching is off."""
    root = cache_dir()
    return root / "kernels" if root is not None else _scratch_root()


def _scratch_root() -> Path:
    """The kernels' folder where caching is off: one of the user's in the temporary folder."""
    return Path(tempfile.gettempdir()) / f"ort_trainer-kernels-{os.getuid()}"


def _command(nvcc: str | None, cxx: str | None, output: Path) -> list[str]:
    sources = [str(_CSRC / name) for name in _SOURCES]
    if nvcc:
        # the CUDA runtime linked in (cudart_static, nvcc's default) and C++'s too: the library runs beside any
        # libstdc++, as on a GPU machine it was not built on, and any driver of nvcc's CUDA version or newer (CUDA 13's
        # runtime asks for a 580 driver or newer)
        return [nvcc, "-O3", "-std=c++20", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden", *_CUDA_ARCHS,
                "-Xlinker", "--exclude-libs,ALL", "-Xcompiler", "-static-libstdc++,-static-libgcc",
                "-DORT_TRAINER_KERNELS_CUDA", *sources, *(str(_CSRC / name) for name in _CUDA_SOURCES),
                "-o", str(output)]
    return [cxx, "-O3", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-static-libstdc++", "-static-libgcc",
            *sources, "-o", str(output)]


def build(output_dir: Path | None = None, cuda: bool | None = None) -> Path:
    """Build the library from ``csrc/`` (or find it built) and return its path.

    Args:
        output_dir: where to put it; default: a folder of the kernels cache named by the hash of the sources,
            the compiler and its command, so that a change of any of them builds anew.
        cuda: True: with ``nvcc`` (an error without one); False: CPU kernels only; None: ``nvcc`` where found.

    Raises:
        KernelsUnavailable: no compiler, or the build failed (with the compiler's message).
    """
    nvcc, cxx = _compilers()
    if cuda is False:
        nvcc = None
    if cuda and not nvcc:
        raise KernelsUnavailable("building ort_trainer's CUDA kernels needs nvcc (the CUDA toolkit) on PATH or in "
                                 "$NVCC")
    if not nvcc and not cxx:
        raise KernelsUnavailable(
            "ort_trainer's kernel library is not built and no C++ compiler was found (c++, g++ or $CXX): install one "
            f"(e.g. apt-get install g++), or set ${LIBRARY_ENV} to a library built elsewhere (make kernels)")
    digest = hashlib.sha256()
    # the headers and what _command compiles (csrc/torch_allocator.cc is torch_allocator.py's, built apart)
    built = (*_SOURCES, *_CUDA_SOURCES)
    for source in sorted(p for p in _CSRC.iterdir() if p.suffix in (".h", ".cuh") or p.name in built):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update(" ".join(_command(nvcc, cxx, Path(_NAME))).encode())
    folder = output_dir or _root() / digest.hexdigest()[:16]
    return _built(folder / _NAME, lambda output: _command(nvcc, cxx, output),
                  f"ort_trainer's kernel library ({'CUDA and CPU' if nvcc else 'CPU'})")


def _built(path: Path, command: Callable[[Path], list[str]], what: str, fix: str = "") -> Path:
    """``path``, built by ``command(output)`` unless it exists: under a name of its own in a scratch folder beside
    it, then renamed, so that a reader never sees half a library. Processes that need it at once (the ranks of a
    job on one machine, test workers) build it once: each takes the folder's lock (``flock``, released by the
    system when its holder ends, so that a build killed midway blocks no one) and looks again before building.

    Raises:
        KernelsUnavailable: the build failed (with the compiler's message, then ``fix``).
    """
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # built by the process that held the lock before
            return path
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            partial = Path(scratch) / path.name
            logger.info("building %s into %s", what, path.parent)
            done = subprocess.run(command(partial), capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise KernelsUnavailable(f"building {what} failed ({done.args[0]}):\n"
                                         f"{(done.stderr or done.stdout)[-4000:]}" + (f"\n{fix}" if fix else ""))
            os.replace(partial, path)
    return path


@functools.lru_cache(maxsize=None)
def library() -> Path:
    """The kernel library of this process: ``$ORT_TRAINER_KERNELS_LIBRARY``, or ``build()``'s."""
    named = os.environ.get(LIBRARY_ENV)
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise KernelsUnavailable(f"${LIBRARY_ENV} names {path}, which is not a file: build one with "
                                     f"`make kernels`, or unset ${LIBRARY_ENV} to build it here")
        return path
    return build()


@functools.lru_cache(maxsize=None)
def has_cuda_kernels(path: Path | None = None) -> bool:
    """Whether the library (default: ``library()``) holds CUDA kernels (it was built by ``nvcc``)."""
    handle = ctypes.CDLL(str(path or library()))
    return bool(handle.OrtTrainerKernelsHaveCuda())


def cuda_kernels_at_hand() -> bool:
    """Whether a library with CUDA kernels can be had here without a failed build: one named by
    ``$ORT_TRAINER_KERNELS_LIBRARY`` (``register`` checks it holds them), or ``nvcc`` to build it."""
    return bool(os.environ.get(LIBRARY_ENV)) or _compilers()[0] is not None


def uses_kernels(model) -> bool:
    """Whether an ONNX model has a node of the kernels' domain (its sessions need ``register``)."""
    return any(node.domain == DOMAIN for node in model.graph.node)


_REGISTERED: list = []  # the session options the library is registered with (kept: a second registration fails)


def register(options, cuda: bool = False) -> None:
    """Register the library's operators with ``options`` (an ``onnxruntime.SessionOptions``), once per options.

    Args:
        cuda: the sessions run on a GPU: the library must hold CUDA kernels (else every node of it would run on
            the CPU, its tensors copied both ways each step).

    Raises:
        KernelsUnavailable: no library can be built or loaded, or ``cuda`` and it holds no CUDA kernels.
    """
    if any(known is options for known in _REGISTERED):
        return
    path = library()
    if cuda and not has_cuda_kernels(path):
        raise KernelsUnavailable(
            f"ort_trainer's kernel library {path} has no CUDA kernels (it was built without nvcc): install the CUDA "
            f"toolkit's nvcc (or set $NVCC) and delete that file to build it anew, set ${LIBRARY_ENV} to a library "
            "`make kernels` built on a machine with nvcc, or turn off the graph_optimizations switches that use it "
            "(fused_gelu_gradient, device_barriers...)")
    options.register_custom_ops_library(str(path))
    _REGISTERED.append(options)
