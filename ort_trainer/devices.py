"""The devices the engine runs on: one class per device behind one interface (``Device``).

A device says where the engine's buffers live (a torch device), which execution providers run its
sessions and with which options, how a buffer is bound to a session so that ONNX Runtime reads or
writes it in place, and how a run is ordered after the torch work that wrote its buffers. The
engine calls this interface and holds no per-device branches.

``device_problem`` checks a ``device.id`` before anything is built: the CUDA runtime, a CUDA build
of torch and the GPU asked for must all be there, or the error says what to install or which GPUs
exist.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator

import numpy as np
import onnx
import onnxruntime as ort
import torch

from . import _runtime
from ._host_arena import shrink_shared_arena, use_shared_arena
from .graph.onnx_graph import largest_tensors
from .kernels.torch_allocator import provider_options as torch_allocator_options

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_CUDA_PROVIDER = "CUDAExecutionProvider"
_CUDA_INDEX_LIMIT = 2**31 - 1  # the largest element count ONNX Runtime's CUDA kernels index (int32)

# IOBinding.bind_input/bind_output with a pointer take a numpy type, or an ONNX type for bfloat16
_ELEMENT_TYPES = {
    torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
    torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: np.int64, torch.int32: np.int32,
    torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.uint16: np.uint16,
    torch.uint32: np.uint32, torch.uint64: np.uint64, torch.bool: np.bool_,
}


def _element_type(tensor: torch.Tensor):
    try:
        return _ELEMENT_TYPES[tensor.dtype]
    except KeyError:
        raise TypeError(f"a {tensor.dtype} buffer cannot be bound to ONNX Runtime; supported: "
                        f"{sorted(str(t) for t in _ELEMENT_TYPES)}") from None


def parse_device_id(value: str) -> tuple[str, int | None]:
    """``"cpu"`` → ``("cpu", None)``, ``"cuda:1"`` → ``("cuda", 1)``.

    Raises:
        ValueError: for anything but ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    """
    match = _DEVICE_RE.match(value) if isinstance(value, str) else None
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise ValueError(f"expected 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    return match.group(1), None if match.group(2) is None else int(match.group(2))


def cuda_missing() -> str | None:
    """What keeps training off CUDA on this machine (None: the CUDA provider, a CUDA build of torch
    and at least one GPU are all there)."""
    if _CUDA_PROVIDER not in ort.get_available_providers():
        return f"the installed ONNX Runtime has no {_CUDA_PROVIDER} (installed: {_runtime.runtime_description()})"
    if not torch.backends.cuda.is_built():
        return f"torch {torch.__version__} is a CPU build"
    if torch.cuda.device_count() == 0:
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return None


def default_device_id() -> str:
    """``"cuda"`` when the CUDA runtime, a CUDA build of torch and a GPU are all present, else ``"cpu"``."""
    return "cuda" if cuda_missing() is None else "cpu"


def device_problem(value: str) -> str | None:
    """Why ``device.id = value`` cannot be used here, with what to do about it (None: it can).

    Checked when the options are made, before any graph is built.
    """
    try:
        kind, index = parse_device_id(value)
    except ValueError as exc:
        return str(exc)
    if kind == "cpu":
        return None
    if _CUDA_PROVIDER not in ort.get_available_providers():
        return (
            f"{value!r} was asked for but the installed ONNX Runtime has no CUDA provider "
            f"(installed: {_runtime.runtime_description()}); install the CUDA runtime instead "
            "(pip uninstall -y the installed one, then pip install \"ort_trainer[cuda]\") or use device.id='cpu'"
        )
    if not torch.backends.cuda.is_built():
        return (
            f"{value!r} needs a CUDA build of torch: the trainer keeps its weights, gradients and optimizer "
            f"states in torch CUDA tensors, and the installed torch {torch.__version__} is a CPU build. Install "
            "a CUDA 13 build (the CUDA version of onnxruntime-gpu 1.31), e.g. pip install torch --index-url "
            "https://download.pytorch.org/whl/cu130, or use device.id='cpu'"
        )
    count = torch.cuda.device_count()
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        return (f"{value!r}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU on this machine{where}; "
                "run where a GPU is visible, or use device.id='cpu'")
    if index is not None and index >= count:
        names = ", ".join(f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(count))
        return f"{value!r}: there is no GPU {index}; this machine has {count}: {names}"
    return None


def capture_memory_problem() -> str | None:
    """Why this torch cannot keep what it allocates during a captured step in a private pool
    (``CUDADevice.capture_memory``), which torch's attention kernels and ``device.torch_allocator`` need under
    ``device.cuda_graph`` (None: it can). That takes ``torch.cuda.use_mem_pool`` routing the current thread's
    allocations, whatever their stream (torch 2.8 and later): ONNX Runtime's kernels run on a stream of its own."""
    if hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool") and hasattr(torch.cuda, "use_mem_pool"):
        return None
    return (f"torch {torch.__version__} cannot give one thread's allocations a private memory pool "
            "(torch.cuda.use_mem_pool for the current thread, torch 2.8 and later)")


def device_class(value: str) -> type["Device"]:
    """The ``Device`` class of a valid ``device.id`` (no device is made, nothing is checked)."""
    return CPUDevice if parse_device_id(value)[0] == "cpu" else CUDADevice


def make_device(value: str) -> "Device":
    """The ``Device`` of a ``device.id``.

    Raises:
        RuntimeError: saying what is missing (``device_problem``).
    """
    problem = device_problem(value)
    if problem:
        raise RuntimeError(f"device.id: {problem}")
    kind, index = parse_device_id(value)
    if kind == "cpu":
        return CPUDevice()
    return CUDADevice(torch.cuda.current_device() if index is None else index)


def _ortvalue(tensor: torch.Tensor) -> ort.OrtValue:
    """An OrtValue over ``tensor``'s memory (DLPack: no copy)."""
    if tensor.dtype == torch.bool:  # DLPack's bool code is unknown to ONNX Runtime: same bytes as uint8
        return ort.OrtValue(ort.capi._pybind_state.OrtValue.from_dlpack(
            tensor.view(torch.uint8).__dlpack__(), True))
    return ort.OrtValue(ort.capi._pybind_state.OrtValue.from_dlpack(tensor.__dlpack__(), False))


class Device:
    """Where the engine's buffers live and how ONNX Runtime's sessions see them.

    Attributes:
        kind: ``"cpu"`` or ``"cuda"`` (also ONNX Runtime's device name in IOBinding).
        index: the device ordinal.
        torch_device: the torch device of every engine buffer.
    """

    kind = ""
    #: ONNX Runtime's execution provider of this device: every node that computes values should run on it
    provider = ""
    #: whether training graphs for this device take their dropout masks as inputs the host draws
    #: (``graph_optimizations.host_dropout_masks``)
    host_dropout_masks = False
    #: whether sessions load ONNX Runtime's optimized graphs that an earlier process saved
    #: (``_optimized_graphs.py``): only where they are known to load back and run alike
    reuses_optimized_graphs = False
    #: whether the recomputations' waits need ort_trainer's kernel node to stay on the device: a Reshape's shape is
    #: read on the host (``graph_optimizations.device_barriers``)
    device_barriers = False
    #: whether a training graph whose step must draw repeatable masks (a captured step, layer_recompute's copies)
    #: draws them with ort_trainer's SeededDropout kernel (``graph_optimizations.seeded_dropout``)
    seeded_dropout = False
    #: whether graphs run torch's CPU kernels (oneDNN's): nn.LSTM's layers (``graph_optimizations.fused_lstm``),
    #: convolutions (``torch_convolutions``) and training's batch norm (``torch_batch_norm``)
    onednn_kernels = False
    #: whether a graph with nodes of torch's kernels keeps ONNX Runtime's spinning intra-op threads
    torch_kernels_spin = True

    def __init__(self, index: int = 0):
        self.index = index
        self.torch_device = torch.device(self.kind, index) if self.kind != "cpu" else torch.device("cpu")

    def __repr__(self) -> str:
        return str(self.torch_device)

    def providers(self, provider_options: dict | None, mem_limit: int, deterministic: bool,
                  torch_allocator: bool = False) -> list[tuple[str, dict]]:
        """The execution providers of every session, each with its options (the user's on top);
        ``torch_allocator``: ONNX Runtime's device memory from torch's caching allocator (a GPU's)."""
        raise NotImplementedError

    def capture_providers(self, providers: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
        """``providers`` for a session whose runs are captured as a graph and replayed (``device.cuda_graph``);
        unchanged where the device has no capture (the engine's fixed bindings then rehearse one)."""
        return providers

    def capture_memory(self) -> contextlib.AbstractContextManager:
        """The context of the run in which ONNX Runtime captures a graph (``device.cuda_graph``): where what
        torch allocates while it runs comes from. Nothing to arrange on a device without capture."""
        return contextlib.nullcontext()

    def release_idle_memory(self) -> None:
        """Return the host memory ONNX Runtime holds free between runs to the system, before work that
        needs memory of its own (``save_as_onnx``'s first export of a process imports ~90 MB of torch's
        export stack; a phase of eval runs after training, or back: ``Sessions.begin_run``): the next
        run takes it again. Nothing on a device without a shared host arena."""

    def check_graph(self, model: onnx.ModelProto) -> None:
        """Raise ``ValueError`` before a session of ``model`` is made when this device's kernels cannot
        run it (every device but CUDA runs any graph)."""

    def configure_session(self, options: ort.SessionOptions) -> None:
        """Settings for session options the engine made itself (the user's own are used as given).

        On every device: ONNX Runtime's intra-op threads may spin while a run is in flight but
        stop when it ends (``session.force_spinning_stop``). Between runs the trainer runs torch
        code (the fused optimizer update, the user's data loading and logging), and threads
        still spinning after a run take the cores from it: measured on the BERT-like model, the
        fused AdamW update took 9-17 ms right after a spinning run and 5.2 ms with spinning
        stopped (4.1-4.3 ms alone), while turning spinning off altogether slows the runs
        themselves (docs/benchmarks.md).

        No memory pattern, on every device. With ``enable_mem_pattern`` (ONNX Runtime's default)
        the first run allocates each intermediate from the arena, and the second allocates one
        block sized for the whole planned run on top, while the arena keeps the first run's
        chunks: the activations are held twice. Measured on the CPU (peak RSS after 4 steps,
        fresh processes): GPT-2-like 1080 -> 866 MB, BERT-like 822 -> 694 MB, against 813 and
        764 MB for eager PyTorch; step times within the machine's noise. On an H200 with the
        pattern on the process grew by 1.68 GB per GPT-2 small sample at sequence 512 against
        eager's 0.90 GB, and the second step took 1.6-2x the later ones (the block's
        ``cudaMalloc``): the same doubling. Without it, 0.75 GB per sample on an H100 against
        eager's 0.89 (docs/gpu.md, "What has been verified on a GPU").

        And nodes run in the graph's own order where their inputs allow (``PRIORITY_BASED``: the
        ready node of lowest index first). ONNX Runtime's default order is a depth-first walk from
        the graph outputs, which ran the GPT-2-like loss's ``GatherElements`` (its only reader
        being the ``loss`` output) after the whole backward: the [1024, 8000] log-probabilities
        stayed alive throughout, and the backward's ``Exp`` could not reuse their buffer. With the
        graph's order, the resident memory after each step went 810 -> 754-768 MB (GPT-2-like) with
        step times unchanged (248 and 252 ms median, alternating in one process).
        """
        options.add_session_config_entry("session.force_spinning_stop", "1")
        # which provider runs each node (InferenceSession.get_provider_graph_assignment_info; sessions.py reports
        # the nodes that land off the device)
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        options.enable_mem_pattern = False
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED

    def disabled_optimizers(self, unfused_skip_layer_norm: bool) -> list[str]:
        """ONNX Runtime graph optimizers that every session turns off (``disabled_optimizers``).

        Args:
            unfused_skip_layer_norm: ``graph_optimizations.unfused_skip_layer_norm``.
        """
        return []

    def bind_input(self, binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        """Bind a buffer that the session reads in place (no copy)."""
        raise NotImplementedError

    def bind_output(self, binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        """Bind a buffer that the session writes in place."""
        raise NotImplementedError

    def bind_fresh_output(self, binding: ort.IOBinding, name: str) -> None:
        """Bind an output that ONNX Runtime allocates on this device, anew each run."""
        binding.bind_output(name, self.kind, self.index)

    @staticmethod
    def bind_feed(binding: ort.IOBinding, name: str, array: np.ndarray) -> None:
        """Bind a step input that is in host memory; ``array`` must live until the run.

        IOBinding::BindInput copies a tensor to the device its consuming kernels read it from
        (utils::CopyOneInputAcrossDevices) when the input is bound: nothing on the CPU, one
        host-to-device copy on a GPU, none for inputs that CPU kernels read (shapes, scalars).
        """
        binding.bind_cpu_input(name, array)

    def inputs_copied_at_binding(self, session: ort.InferenceSession) -> set[str]:
        """The inputs of ``session`` that ONNX Runtime reads on another device than this one, so
        that binding one of this device's buffers to them copies its value at that moment."""
        return set()

    def synchronize(self) -> None:
        """Called before every session run: torch work that wrote a buffer must be done before
        ONNX Runtime reads it."""


class CPUDevice(Device):
    """Buffers in host memory, the CPU execution provider, zero-copy DLPack bindings."""

    kind = "cpu"
    provider = "CPUExecutionProvider"
    #: ONNX Runtime's CPU Dropout draws 4.6 ns per element on one thread, NumPy ~1.5 (dropout_masks.py)
    host_dropout_masks = True
    onednn_kernels = True
    #: torch's CPU kernels run on torch's own threads (OpenMP), whose cores spinning workers take: an LSTM's step
    #: (docs/performance.md, "LSTMs") 490-529 ms spinning, 325-342 ms not
    torch_kernels_spin = False
    #: the CPU provider's optimized graphs load back with optimizations off and run bit-equal
    #: (tests/test_optimized_graphs.py)
    reuses_optimized_graphs = True

    def providers(self, provider_options: dict | None, mem_limit: int, deterministic: bool,
                  torch_allocator: bool = False) -> list[tuple[str, dict]]:
        return [("CPUExecutionProvider", dict(provider_options or {}))]

    def configure_session(self, options: ort.SessionOptions) -> None:
        """Every device's settings (``Device.configure_session``) and the shared arena (``_host_arena``)."""
        super().configure_session(options)
        use_shared_arena(options)

    def release_idle_memory(self) -> None:
        """The shared arena's free regions, back to the system (``_host_arena.shrink_shared_arena``)."""
        shrink_shared_arena()

    def disabled_optimizers(self, unfused_skip_layer_norm: bool) -> list[str]:
        """``SkipLayerNormFusion`` with ``unfused_skip_layer_norm``: the CPU ``SkipLayerNormalization``
        kernel it fuses ``Add`` + ``LayerNormalization`` into took 0.68-0.73 ms per [1024, 256]
        (ONNX Runtime 1.31.1, 2 threads) against 0.11-0.13 ms for ``LayerNormalization`` and
        ~0.1 ms for the ``Add``: 5.5 -> 1.9 ms of the BERT-like eval graph's kernels. (The
        gradient graphs have no such pattern left for it: the ``Add``'s output is read twice.)
        """
        return ["SkipLayerNormFusion"] if unfused_skip_layer_norm else []

    def bind_input(self, binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        binding.bind_ortvalue_input(name, _ortvalue(tensor))

    def bind_output(self, binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        binding.bind_ortvalue_output(name, _ortvalue(tensor))


class CUDADevice(Device):
    """Buffers in the memory of GPU ``index``, the CUDA execution provider (CPU as fallback).

    Buffers are bound by pointer (``IOBinding.bind_input(name, "cuda", index, type, shape, ptr)``),
    the documented way to hand ONNX Runtime device memory: its OrtDevice (GPU, NVIDIA, index) is the
    one the CUDA provider allocates on, so binding copies nothing.

    Ordering with torch: each session run executes on a stream ONNX Runtime creates with
    ``cudaStreamNonBlocking``, which does not wait for torch's stream, so ``synchronize`` waits for
    torch's current stream before a run (the buffer copies and sums the engine makes with torch).
    A run ends with ``cudaStreamSynchronize`` on its stream (run option
    ``disable_synchronize_execution_providers`` left at "0": onnxruntime_run_options_config_keys.h),
    so its outputs are complete when ``run_with_iobinding`` returns and torch may read them on any
    stream.
    """

    kind = "cuda"
    provider = _CUDA_PROVIDER
    device_barriers = True
    seeded_dropout = True

    def __init__(self, index: int = 0):
        super().__init__(index)
        self._capture_pool = None  # capture_memory's, made on first use

    def providers(self, provider_options: dict | None, mem_limit: int, deterministic: bool,
                  torch_allocator: bool = False) -> list[tuple[str, dict]]:
        options = {
            "device_id": str(self.index),
            # grow the arena by what is asked for, not to the next power of two
            "arena_extend_strategy": "kSameAsRequested",
            # TF32 matmuls as torch does them: off unless torch.set_float32_matmul_precision allows them
            "use_tf32": "0" if torch.get_float32_matmul_precision() == "highest" else "1",
        }
        if mem_limit:
            options["gpu_mem_limit"] = str(mem_limit)
        if deterministic:
            # EXHAUSTIVE (the default) picks convolution algorithms by timing them, so two runs may
            # differ; DEFAULT always uses CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
            options["cudnn_conv_algo_search"] = "DEFAULT"
        if torch_allocator:  # no arena: every allocation through torch's caching allocator (kernels/torch_allocator.py)
            options.update(torch_allocator_options())
        user = {str(k): str(v) for k, v in (provider_options or {}).items()}
        if "device_id" in user and user["device_id"] != options["device_id"]:
            raise ValueError(
                f"provider_options: device_id {user['device_id']} contradicts device.id 'cuda:{self.index}', where "
                f"the trainer's buffers live; choose the GPU with device.id='cuda:{user['device_id']}' instead")
        return [(_CUDA_PROVIDER, {**options, **user}), ("CPUExecutionProvider", {})]

    def capture_providers(self, providers: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
        return [(name, {**options, "enable_cuda_graph": "1"} if name == _CUDA_PROVIDER else options)
                for name, options in providers]

    def capture_memory(self) -> contextlib.AbstractContextManager:
        """Every allocation this thread makes from torch's caching allocator while ONNX Runtime captures a step
        from a private pool of torch's (``torch.cuda.MemPool``), kept as long as this device: torch's attention
        kernels (``graph_optimizations.fused_attention``) and, under ``device.torch_allocator``, the graph's own
        tensors. A captured graph replays its kernels on the addresses they had when it was captured, after
        ONNX Runtime and torch have freed them: from torch's shared pool, the next tensor torch made (an
        optimizer temporary, a checkpoint's copy) could be given one of them and be overwritten by the next
        replay. A private pool's blocks go only to allocations routed to it again (a later capture's, replayed
        in turn, never at once), as ``torch.cuda.graph`` keeps its captures' memory."""
        if self._capture_pool is None:
            self._capture_pool = torch.cuda.MemPool()
        return torch.cuda.use_mem_pool(self._capture_pool, self.torch_device)

    def check_graph(self, model: onnx.ModelProto) -> None:
        """No tensor of more than 2³¹ - 1 elements. ONNX Runtime's CUDA kernels index elements with
        32-bit integers (``CUDA_LONG`` is ``int32_t``, ``cu_inc/common.cuh``): past that, runs fail
        (GPT-2 small at batch 128 × 512 tokens on an H200: ``cudaErrorInvalidValue`` in an
        ``Expand`` of the 3.3·10⁹-element logits, docs/gpu.md) or, for some kernels, write wrong
        values without an error (the warp softmax: microsoft/onnxruntime#32299). Graphs whose
        shapes are symbolic are checked only where a size is known."""
        problems = [f"{name} {shape} ({count:.3g} elements)" for name, shape, count in
                    largest_tensors(model.graph) if count > _CUDA_INDEX_LIMIT]
        if problems:
            raise ValueError(
                f"{len(problems)} tensor(s) of this graph hold more than 2^31 - 1 elements, past what ONNX "
                "Runtime's CUDA kernels index (they fail, or some write wrong values): "
                + "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
                + ". Fetch the loss alone (a language-model loss then runs in pieces: graph_optimizations.loss_pieces), "
                "or take a smaller batch (batch.gradient_accumulation_steps keeps the effective one) or shorter sequences")

    def bind_input(self, binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        binding.bind_input(name, self.kind, self.index, _element_type(tensor), tuple(tensor.shape), tensor.data_ptr())

    def bind_output(self, binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        binding.bind_output(name, self.kind, self.index, _element_type(tensor), tuple(tensor.shape),
                            tensor.data_ptr())

    def inputs_copied_at_binding(self, session: ort.InferenceSession) -> set[str]:
        # where each input is read: the memory of its consuming kernels, which is where binding
        # copies it to; a runtime without get_input_memory_infos (1.19.2) is CPU-only here
        memory_infos = getattr(session, "get_input_memory_infos", None)
        if memory_infos is None:
            return set()
        return {i.name for i, info in zip(session.get_inputs(), memory_infos())
                if not (info.name.lower() == "cuda" and info.device_id == self.index)}

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.torch_device).synchronize()


# the automatic rule's bound: an update of at most this many weights runs on one torch thread (host_threads)
ONE_THREAD_UPDATE_WEIGHTS = 4_000_000


def host_threads(option: int, trained_weights: int) -> int:
    """The torch threads of a training step's host work (``torch_threads``' count) for the option
    ``device.host_threads``: the option itself when set, else (0) one thread for an update of at most
    ``ONE_THREAD_UPDATE_WEIGHTS`` weights and torch's own count (0) above.

    A step's host work (the fused optimizer update, the gradient norm, copies) runs between two ONNX
    Runtime runs. torch runs it on its OpenMP workers (GNU libgomp in the PyPI wheels), which spin
    for milliseconds after each parallel piece of work (``GOMP_SPINCOUNT``'s default) unless
    ``OMP_WAIT_POLICY=PASSIVE`` was set before torch was loaded. On the CPU they then share the cores
    ONNX Runtime's threads need for the next run's matrix products. On this project's 2-core host,
    the compute-bound MLP of ``make bench-real`` (2.1 M weights) stepped in 16.8-17.5 ms with two
    torch threads and 10.1-10.5 ms with one: one or two of the run's five 1.5 ms products took
    3-8 ms, ~7 ms lost per step. One thread costs the update more the more weights it has: here
    0.6 ms more on 2.1 M weights and ~12 ms on GPT-2 small's 124 M (lost in its 2.3 s step), ~70 ms
    on 656 M (3% of its step). One thread of a many-core server reaches a smaller share of its memory
    bandwidth: at ~10 GB/s, AdamW's 28 bytes per weight take ~2.8 ms per million weights, so the
    single thread pays off below a few million weights there; the bound is set for that host. Here
    (``make bench-threads``) one thread was faster up to 16.8 M weights (1.26x at 4.2 M, 1.04x at 16.8 M)
    and level at 33.6 M (0.90-1.01x).
    """
    if option:
        return option
    return 1 if trained_weights <= ONE_THREAD_UPDATE_WEIGHTS else 0


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch threads (0: as they are), then restore torch's count
    (``host_threads`` says why a training step sets it)."""
    previous = torch.get_num_threads()
    if not count or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values in NumPy on the host (bfloat16, which NumPy lacks, as float32)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def host_dtype(tensor: torch.Tensor) -> np.dtype:
    """The NumPy dtype ``host_array`` gives ``tensor``."""
    return np.dtype(np.float32) if tensor.dtype == torch.bfloat16 else torch.empty((), dtype=tensor.dtype).numpy().dtype

__all__ = ["ONE_THREAD_UPDATE_WEIGHTS", "CPUDevice", "CUDADevice", "Device", "cuda_missing", "default_device_id",
           "device_class", "device_problem", "host_array", "host_dtype", "host_threads", "make_device",
           "parse_device_id", "torch_threads"]
