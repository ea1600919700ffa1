"""ort_trainer's operators that run torch's own kernels inside ONNX Runtime (``graph_optimizations.fused_attention``,
``graph_optimizations.torch_products``, CTC loss).

ONNX Runtime's standard builds have no fused attention with a backward (its ``MultiHeadAttention`` contrib
operator is a forward for inference), and a training graph spells attention out: the scores' product, the mask
added, a softmax, the product with the values, and their gradients, each a pass over a ``[batch, heads, seq_q,
seq_k]`` tensor (GPT-2 small in float16 at 8 x 512: about a third of the bytes its step moves). torch has fused
attention kernels with backwards; ``csrc/torch_ops.cc`` runs them as ONNX Runtime custom operators of the domain
``DOMAIN`` (``Attention``, ``BiasAttention`` and their ``...Grad``; the tensors ONNX Runtime gives a run are wrapped
without a copy, and on a GPU the kernels run on the session's CUDA stream): torch's memory-efficient attention on
CUDA, its flash attention for the CPU on the CPU. Neither keeps a ``[seq_q, seq_k]`` tensor: the backward
recomputes the probabilities from the forward's per-row log-sum-exp. ``Gemm``, ``BiasGemm`` and ``MatMul`` run a graph's
products by torch's BLAS (``torch_products``: on a GPU cuBLAS, which adds a bias vector in the product's epilogue).
``CTCLoss`` and ``CTCLossGrad`` run torch's CTC kernels (``graph/export/ctc.py``: ``torch.export`` cannot trace
``F.ctc_loss`` itself, and ONNX has no CTC operator). ``LSTMLayer`` and ``LSTMLayerGrad`` run oneDNN's LSTM
kernels as torch does on the CPU (``graph/export/fused_lstm.py``, ``graph_optimizations.fused_lstm``); ``Conv``,
``BiasConv``, ``ConvGrad``, ``ConvWeightGrad`` and ``ThresholdGrad`` a CNN's convolutions and ReLU gradients, and
``BatchNormTraining`` and ``BatchNormGrad`` its batch norms (``graph_optimizations.torch_convolutions`` and
``torch_batch_norm``).

The library is built on first use against the torch that runs (its headers and libraries; with a CUDA build of
torch, CUDA kernels too) into ``$ORT_TRAINER_CACHE_DIR/kernels/torch_ops/<hash>/`` (about a minute with the C++
compiler: torch's headers are large), like ``torch_allocator.py``'s functions.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from pathlib import Path

from . import TORCH_OPS_DOMAIN as DOMAIN  # the operators' ONNX domain
from . import KernelsUnavailable, _built, _compilers, _root
from .torch_allocator import cuda_include_dir
_SOURCE = Path(__file__).resolve().parent / "csrc" / "torch_ops.cc"
_HEADERS = [Path(__file__).resolve().parent / "csrc" / name
            for name in ("ort_abi.h", "ort_io.h", "torch_io.h", "torch_conv.h", "torch_norm.h", "torch_rnn.h")]
_NAME = "libort_trainer_torch_ops.so"
_SWITCHES = ("graph_optimizations.fused_attention, torch_products, fused_lstm, torch_convolutions and "
             "torch_batch_norm, and a CTC loss (F.ctc_loss),")
_FIX = "or turn those options off (a CTC loss has no other implementation)"


def _command(cxx: str, output: Path, torch_root: Path, cxx11_abi: bool, cuda_include: Path | None,
             extra_includes: tuple[Path, ...] = ()) -> list[str]:
    """The compiler's command: ``output`` built from ``csrc/torch_ops.cc`` against the torch installed at
    ``torch_root`` (with its CUDA libraries where ``cuda_include`` is given; ``-c``: an object file alone, when
    ``output`` ends in .o)."""
    include = torch_root / "include"
    lib = torch_root / "lib"
    flags = ["-O2", "-std=c++20", "-fPIC", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}",
             f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
             *(f"-I{folder}" for folder in extra_includes)]
    libraries = ["-lc10", "-ltorch_cpu", "-ltorch"]
    if cuda_include is not None:
        flags += ["-DORT_TRAINER_TORCH_CUDA", f"-I{cuda_include}"]
        libraries = ["-lc10_cuda", "-ltorch_cuda", *libraries]
    if output.suffix == ".o":
        return [cxx, *flags, "-c", str(_SOURCE), "-o", str(output)]
    return [cxx, *flags, "-shared", str(_SOURCE), f"-L{lib}", *libraries, f"-Wl,-rpath,{lib}", "-o", str(output)]


def build() -> Path:
    """Build the operators against the running torch (or find them built) and return the library's path.

    Raises:
        KernelsUnavailable: no C++ compiler, a CUDA torch without the CUDA runtime's headers, or the build failed.
    """
    import torch

    _, cxx = _compilers()
    if cxx is None:
        raise KernelsUnavailable(f"{_SWITCHES} build a library against torch and found no C++ compiler (c++, g++ or "
                                 f"$CXX): install one, {_FIX}")
    cuda_include = None
    if torch.version.cuda is not None:
        cuda_include = cuda_include_dir()
        if cuda_include is None:
            raise KernelsUnavailable(f"{_SWITCHES} build against torch's CUDA headers, which "
                                     "include the CUDA runtime's: none found in $CUDA_HOME, nvcc's toolkit, "
                                     f"/usr/local/cuda or the nvidia wheels; set CUDA_HOME to a CUDA toolkit, {_FIX}")
    torch_root = Path(torch.__file__).resolve().parent
    abi = torch._C._GLIBCXX_USE_CXX11_ABI
    command = _command(cxx, Path(_NAME), torch_root, abi, cuda_include)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (_SOURCE, *_HEADERS))
                            + " ".join([*command, torch.__version__]).encode())
    path = _root() / "torch_ops" / digest.hexdigest()[:16] / _NAME
    return _built(path, lambda output: _command(cxx, output, torch_root, abi, cuda_include),
                  "ort_trainer's torch operators (fused attention, torch's products, CTC loss, LSTM layers)", _FIX)


@functools.lru_cache(maxsize=None)
def library() -> Path:
    """The operators' library of this process (``build()``'s)."""
    return build()


@functools.lru_cache(maxsize=None)
def has_cuda_kernels(path: Path | None = None) -> bool:
    """Whether the library (default: ``library()``) runs its operators on CUDA too (built against a CUDA torch)."""
    return bool(ctypes.CDLL(str(path or library())).OrtTrainerTorchOpsHaveCuda())


def uses_torch_ops(model) -> bool:
    """Whether an ONNX model has a node of these operators' domain (its sessions need ``register``)."""
    return any(node.domain == DOMAIN for node in model.graph.node)


_REGISTERED: list = []  # the session options the library is registered with


def register(options, cuda: bool = False) -> None:
    """Register the operators with ``options`` (an ``onnxruntime.SessionOptions``), once per options.

    Raises:
        KernelsUnavailable: the library cannot be built here, or ``cuda`` and it has no CUDA kernels (a CPU torch).
    """
    if any(known is options for known in _REGISTERED):
        return
    path = library()
    if cuda and not has_cuda_kernels(path):
        raise KernelsUnavailable(f"{_SWITCHES} on a GPU run torch's CUDA kernels, and this torch has none (a CPU "
                                 f"build): install a CUDA build of torch, {_FIX}")
    options.register_custom_ops_library(str(path))
    _REGISTERED.append(options)


__all__ = ["DOMAIN", "build", "has_cuda_kernels", "library", "register", "uses_torch_ops"]
