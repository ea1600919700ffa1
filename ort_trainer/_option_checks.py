"""The checks of ``ORTTrainerOptions`` that involve more than one option (``options.py`` checks each
option's own type and range): the gradient source's runtime, mixed precision's source, the ranks, the
device's options together, the distributed backend."""

from __future__ import annotations

from typing import Any

from . import _runtime, devices
from .distributed import backend_problem


def cross_field_problems(values: dict[str, Any], problems: list[str]) -> list[str]:
    """Problems that involve more than one option (each option's own problems are in ``problems``, whose
    options are not checked again here)."""
    own = {p.split(":")[0] for p in problems}
    found = []
    if "graph.gradient_source" not in own:
        # the default is checked too: "auto" on a runtime without the training build needs onnxscript
        problem = _runtime.gradient_source_problem(values["graph.gradient_source"])
        if problem:
            found.append(f"graph.gradient_source: {problem}")
    found += _mixed_precision_problems(values, own)
    rank, size = values["distributed.world_rank"], values["distributed.world_size"]
    if not own & {"distributed.world_rank", "distributed.world_size"} and rank >= size:
        found.append(f"distributed.world_rank: {rank} must be < distributed.world_size ({size}); "
                     "fill both from setup_distributed() (DistributedContext.trainer_options)")
    found += _device_problems(values, own)
    if not own & {"distributed.backend", "device.id", "distributed.world_size"}:
        problem = backend_problem(values["distributed.backend"], values["device.id"], values["distributed.world_size"])
        if problem:
            found.append(f"distributed.backend: {problem}")
    return found


def _device_problems(values: dict[str, Any], own: set[str]) -> list[str]:
    """The device block: a CUDA graph and torch's allocator need a GPU; a capture of a step in which torch
    allocates (torch's allocator, torch's attention kernels and products) needs a torch that keeps those allocations
    in a pool of their own (their replays write where the capture run's memory was); the allocator excludes the
    arena's limit (there is no arena to cap)."""
    found = []
    cuda = "device.id" in own or devices.parse_device_id(values["device.id"])[0] == "cuda"
    if values["device.cuda_graph"] is True and not cuda:
        found.append(f"device.cuda_graph: CUDA graphs need a GPU; device.id is {values['device.id']!r} (use 'cuda')")
    # what torch allocates during a capture is kept in a private pool (devices.CUDADevice.capture_memory)
    pool_problem = devices.capture_memory_problem() if values["device.cuda_graph"] is True else None
    for switch, kernels in (("fused_attention", "torch's attention kernels allocate"),
                            ("torch_products", "torch's products allocate cuBLAS's workspace")):
        if pool_problem and values[f"graph_optimizations.{switch}"] is True:
            found.append(f"graph_optimizations.{switch}: {kernels} from torch's caching allocator while they run, "
                         f"which a CUDA graph captured by ONNX Runtime (device.cuda_graph) replays only from a pool of "
                         f"its own, and {pool_problem}: upgrade torch or turn one of the two off")
    if "provider_options" not in own and "enable_cuda_graph" in values["provider_options"]:
        found.append("provider_options: enable_cuda_graph needs fixed buffers for every input and output of the "
                     "step: ask for it with device.cuda_graph=True")
    if values["device.torch_allocator"] is not True:
        return found
    if not cuda:
        found.append(f"device.torch_allocator: torch's caching allocator serves GPU memory; device.id is "
                     f"{values['device.id']!r} (use 'cuda', or leave it off)")
    if pool_problem:
        found.append(f"device.torch_allocator: a captured CUDA graph (device.cuda_graph) replays into the memory of "
                     f"its capture run, which must then come from a pool of its own, and {pool_problem}: upgrade "
                     "torch or turn one of the two off")
    if "device.mem_limit" not in own and values["device.mem_limit"]:
        found.append("device.torch_allocator: device.mem_limit caps ONNX Runtime's own arena, which torch's allocator "
                     "replaces: leave it 0 and cap torch's pool (torch.cuda.set_per_process_memory_fraction)")
    return found


def _mixed_precision_problems(values: dict[str, Any], own: set[str]) -> list[str]:
    """The mixed-precision block: only the 'torch' gradient source records autocast."""
    if values["mixed_precision.enabled"] is not True or "graph.gradient_source" in own:
        return []
    source = values["graph.gradient_source"]
    if _runtime.gradient_source_problem(source) is None and _runtime.resolve_gradient_source(source) == "onnxruntime":
        chosen = "'onnxruntime'" if source == "onnxruntime" else "'auto' (here 'onnxruntime': the training build)"
        return [
            f"mixed_precision.enabled: True computes in half precision the way torch.autocast does, which only the "
            f"'torch' gradient source records; graph.gradient_source is {chosen}, whose TorchScript export and "
            "gradient builder would train in fp32. Set graph.gradient_source='torch' (it runs on every runtime, "
            "the training build included), or leave mixed_precision.enabled False"
        ]
    return []


__all__ = ["cross_field_problems"]
