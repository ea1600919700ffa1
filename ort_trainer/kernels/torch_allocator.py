"""ONNX Runtime's GPU memory from torch's caching allocator (``device.torch_allocator``).

By default ONNX Runtime's CUDA execution provider keeps an arena of its own beside torch's caching
allocator: the process then holds two pools, torch's (the trainer's weights, gradients and optimizer
states, the optimizer's temporaries) and ONNX Runtime's (the graph's activations), each at its own peak,
and ONNX Runtime's arena (a BFC arena that grows by what is asked for, whose regions never merge) keeps
what fragmentation costs it. The provider can instead allocate through three functions given by address
(its ``gpu_external_alloc``, ``gpu_external_free`` and ``gpu_external_empty_cache`` options, an allocator
with no arena around it: ``CUDAExternalAllocator``); ``csrc/torch_allocator.cc`` makes them from torch's
``c10::cuda::CUDACachingAllocator`` (``raw_alloc``, ``raw_delete``, ``emptyCache``), as ONNX Runtime's own
ORTModule did. One pool then serves both, and ``torch.cuda.max_memory_allocated()`` counts the graph's
activations too.

The functions are built on first use, like the kernel library, against the headers of the torch that runs
(its ``include/`` folder and the CUDA toolkit's headers) and linked to its ``libc10_cuda``, into
``$ORT_TRAINER_CACHE_DIR/kernels/torch_allocator/<hash>/`` (seconds, with the C++ compiler).

Allocations follow torch's current stream, and ONNX Runtime runs its kernels on a stream of its own: a
block one run frees is taken again by the same run (one stream: ordered), and the engine's runs end with
their stream synchronized before torch touches the memory (``devices.CUDADevice``), so no block is reused
while a kernel still reads it. A CUDA graph captured by ONNX Runtime (``device.cuda_graph``) keeps pointers to
the memory of its capture run, which torch could hand out again: the trainer routes that run's allocations to a
private pool of torch's (``devices.CUDADevice.capture_memory``), and an allocation here may ``cudaMalloc`` while
ONNX Runtime's stream is capturing (the thread's capture mode relaxed for it, as torch does for its own captures).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from pathlib import Path

from . import KernelsUnavailable, _built, _compilers, _root

_SOURCE = Path(__file__).resolve().parent / "csrc" / "torch_allocator.cc"
_NAME = "libort_trainer_torch_allocator.so"
_HEADER = "cuda_runtime_api.h"


def cuda_include_dir() -> Path | None:
    """A folder holding the CUDA runtime's headers, which torch's CUDA headers include: ``$CUDA_HOME``'s or
    ``$CUDA_PATH``'s, ``nvcc``'s toolkit's, ``/usr/local/cuda``'s, or the ``nvidia`` wheels' that CUDA builds of
    torch install; None where none is found."""
    nvcc, _ = _compilers()
    candidates = [Path(os.environ[name]) / "include" for name in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(name)]
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    try:
        import nvidia  # the CUDA wheels torch depends on (namespace package)

        for root in map(Path, nvidia.__path__):
            candidates += sorted(root.glob("*/include"))
    except ImportError:
        pass
    return next((folder for folder in candidates if (folder / _HEADER).is_file()), None)


def _command(cxx: str, output: Path, torch_root: Path, cuda_include: Path, cxx11_abi: bool,
             extra_includes: tuple[Path, ...] = ()) -> list[str]:
    """The compiler's command: ``output`` built from ``csrc/torch_allocator.cc`` against the torch installed at
    ``torch_root`` (its headers, its ``lib/libc10_cuda``; ``-c``: an object file alone, when ``output`` ends in .o)."""
    includes = [f"-I{folder}" for folder in (torch_root / "include", *extra_includes, cuda_include)]
    flags = ["-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}",
             *includes]
    if output.suffix == ".o":
        return [cxx, *flags, "-c", str(_SOURCE), "-o", str(output)]
    lib = torch_root / "lib"
    return [cxx, *flags, "-shared", str(_SOURCE), f"-L{lib}", "-lc10_cuda", "-lc10", f"-Wl,-rpath,{lib}",
            "-o", str(output)]


def build() -> Path:
    """Build the functions against the running torch (or find them built) and return the library's path.

    Raises:
        KernelsUnavailable: no C++ compiler, no CUDA headers, a torch without CUDA, or the build failed.
    """
    import torch

    fix = "or leave device.torch_allocator off (ONNX Runtime's own arena)"
    if torch.version.cuda is None:
        raise KernelsUnavailable(f"device.torch_allocator needs a CUDA build of torch (this is {torch.__version__}); "
                                 f"{fix}")
    _, cxx = _compilers()
    if cxx is None:
        raise KernelsUnavailable(f"device.torch_allocator builds a small library against torch and found no C++ "
                                 f"compiler (c++, g++ or $CXX): install one, {fix}")
    cuda_include = cuda_include_dir()
    if cuda_include is None:
        raise KernelsUnavailable(f"device.torch_allocator builds against torch's CUDA headers, which include the CUDA "
                                 f"runtime's ({_HEADER}): none found in $CUDA_HOME, nvcc's toolkit, /usr/local/cuda "
                                 f"or the nvidia wheels; set CUDA_HOME to a CUDA toolkit, {fix}")
    torch_root = Path(torch.__file__).resolve().parent
    command = _command(cxx, Path(_NAME), torch_root, cuda_include, torch._C._GLIBCXX_USE_CXX11_ABI)
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join([*command, torch.__version__]).encode())
    path = _root() / "torch_allocator" / digest.hexdigest()[:16] / _NAME
    return _built(path, lambda output: _command(cxx, output, torch_root, cuda_include, torch._C._GLIBCXX_USE_CXX11_ABI),
                  "ort_trainer's torch allocator functions", fix)


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """The built functions, loaded once (and kept loaded: ONNX Runtime holds their addresses)."""
    import torch

    torch.cuda.init()  # torch's allocator is made with its CUDA state
    return ctypes.CDLL(str(build()))


def provider_options() -> dict[str, str]:
    """The CUDA execution provider's options that make ONNX Runtime allocate through torch's caching allocator.

    Raises:
        KernelsUnavailable: the functions cannot be built here (the message says why and what to do).
    """
    library = _library()
    address = lambda name: str(ctypes.cast(getattr(library, name), ctypes.c_void_p).value)  # noqa: E731
    return {"gpu_external_alloc": address("OrtTrainerTorchAlloc"), "gpu_external_free": address("OrtTrainerTorchFree"),
            "gpu_external_empty_cache": address("OrtTrainerTorchEmptyCache")}


__all__ = ["build", "cuda_include_dir", "provider_options"]
