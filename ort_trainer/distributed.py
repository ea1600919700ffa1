"""Data-parallel training under ``mpirun`` (api.md section 8).

``setup_onnxruntime_with_mpi()`` reads rank, size and local rank from mpi4py, picks the device,
seeds, splits the CPU threads between the ranks of a node, and makes an uncaught exception on
any rank end the whole job. The trainer uses a ``Communicator`` for the collectives: one call per
step on one flat buffer (gradients all-reduced, weights broadcast and, with ZeRO stage 1,
all-gathered), moved by MPI (host buffers) or by ``torch.distributed`` (NCCL for CUDA buffers; gloo
for host buffers, and for CUDA buffers through pinned host copies, as when ranks share a GPU), as
``distributed.backend`` says. No collective waits forever: each starts
with a header exchange over MPI that checks every rank is in the same collective at the same
step and gives up after ``ORT_TRAINER_COLLECTIVE_TIMEOUT`` seconds (default 600).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._logging import logger
from .comm.base import Communicator, _mpi, install_abort_on_error
from .comm.mpi import MPICommunicator


# Threads each ONNX Runtime session may use in this process (0: ONNX Runtime's default).
_intra_op_threads = 0


def intra_op_threads() -> int:
    """The intra-op thread count set by ``setup_onnxruntime_with_mpi`` (0 when not set)."""
    return _intra_op_threads


@dataclass
class MPIContext:
    """What ``setup_onnxruntime_with_mpi`` found and set.

    Attributes:
        world_rank, world_size: this process's rank and the number of processes.
        local_rank, local_size: the same among the processes on this node.
        device: ``"cuda:<local_rank % gpus>"`` or ``"cpu"``.
        threads: intra-op threads given to each of this process's ONNX Runtime sessions.
    """

    world_rank: int
    world_size: int
    local_rank: int
    local_size: int
    device: str
    threads: int

    def distributed_options(self) -> dict:
        """The ``distributed`` group of ``ORTTrainerOptions``."""
        return {"world_rank": self.world_rank, "world_size": self.world_size, "local_rank": self.local_rank}

    def trainer_options(self, **extra: Any) -> dict:
        """An ``ORTTrainerOptions`` dict with ``device`` and ``distributed`` filled in, merged with ``extra``."""
        options = {key: dict(value) if isinstance(value, dict) else value for key, value in extra.items()}
        options.setdefault("device", {})["id"] = self.device
        options.setdefault("distributed", {}).update(self.distributed_options())
        return options


def setup_onnxruntime_with_mpi(seed: int | None = None) -> MPIContext:
    """Set this process up as one rank of an ``mpirun -n N`` job.

    Reads rank/size from ``MPI.COMM_WORLD`` and the local rank from the node-local communicator;
    picks ``cuda:<local_rank % gpus>`` when the CUDA build sees GPUs, else ``cpu``; seeds torch,
    numpy, Python and ONNX Runtime with ``seed + world_rank`` when ``seed`` is given; gives each
    rank ``cores // ranks_on_this_node`` threads (torch and ONNX Runtime) so 2 ranks on 2 cores
    do not oversubscribe; and installs a hook that aborts the whole job when any rank raises.

    Works in a plain process too (rank 0 of 1).

    Returns:
        An ``MPIContext``; ``ctx.trainer_options(...)`` gives the options dict for ``ORTTrainer``.
    """
    global _intra_op_threads
    import onnxruntime as ort
    import torch

    MPI = _mpi()
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    rank, size = world.Get_rank(), world.Get_size()
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    install_abort_on_error()

    device = "cpu"
    if "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available():
        device = f"cuda:{local_rank % torch.cuda.device_count()}"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    threads = max(1, cores // local_size)
    _intra_op_threads = threads
    torch.set_num_threads(threads)
    if seed is not None:
        rank_seed = seed + rank
        random.seed(rank_seed)
        np.random.seed(rank_seed)
        torch.manual_seed(rank_seed)
        ort.set_seed(rank_seed)
    context = MPIContext(rank, size, local_rank, local_size, device, threads)
    logger.info("rank %d of %d (local %d of %d) on %s with %d threads", rank, size, local_rank, local_size,
                device, threads)
    return context


BACKENDS = ("auto", "mpi", "gloo", "nccl")


def resolve_backend(backend: str, device: str) -> str:
    """The backend ``distributed.backend`` names for ``device``: ``"auto"`` is NCCL on CUDA, else MPI."""
    if backend != "auto":
        return backend
    return "nccl" if device.startswith("cuda") else "mpi"


def backend_problem(backend: str, device: str, world_size: int) -> str | None:
    """What is wrong with ``distributed.backend`` for ``device`` (None when it fits).

    ``"nccl"`` moves CUDA buffers only and ``"mpi"`` host buffers only; ``"gloo"`` moves either
    (CUDA buffers through pinned host copies that gloo makes itself: the way for several ranks that
    share one GPU, where NCCL refuses two ranks on one device). A backend named explicitly must be
    available in this torch build; ``"auto"`` only when there are several ranks (a single process
    makes no collectives).
    """
    chosen = resolve_backend(backend, device)
    on_cuda = device.startswith("cuda")
    if chosen == "nccl" and not on_cuda:
        return (f"'nccl' moves CUDA buffers, but device.id is {device!r}; on the CPU use 'gloo' or 'mpi' "
                "(or 'auto', which picks 'mpi')")
    if chosen == "mpi" and on_cuda:
        return (f"'mpi' moves host buffers, but device.id is {device!r} and the engine's buffers live in device "
                "memory; use 'nccl' (or 'auto', which picks it on CUDA), or 'gloo', which copies them through "
                "host memory (ranks that share a GPU)")
    if chosen in ("gloo", "nccl") and (backend != "auto" or world_size > 1):
        if not torch.distributed.is_available():
            return (f"{chosen!r} runs through torch.distributed, which this torch build ({torch.__version__}) does "
                    "not have; install a torch build with it, or use 'mpi' on the CPU")
        if not torch.distributed.is_backend_available(chosen):
            build = "a CUDA build of torch on Linux" if chosen == "nccl" else "a torch build with gloo"
            return (f"torch.distributed in this torch build ({torch.__version__}) has no {chosen!r} backend; "
                    f"install {build}" + ("" if chosen == "nccl" else ", or use 'nccl'" if on_cuda
                                            else ", or use 'mpi' on the CPU"))
    return None


def make_communicator(backend: str, device: str, world_size: int, world_rank: int) -> "Communicator":
    """The communicator of ``distributed.backend`` for buffers on ``device``.

    Args:
        backend: ``"auto"``, ``"mpi"``, ``"gloo"`` or ``"nccl"``.
        device: the engine's device, ``"cpu"`` or ``"cuda[:N]"``.
        world_size, world_rank: as ``options.distributed`` declares them.

    Returns:
        An ``MPICommunicator`` or a ``TorchDistributedCommunicator``.

    Raises:
        ValueError: the backend does not fit the device, is not available in this torch build, or
            MPI disagrees with ``world_size``/``world_rank``.
    """
    problem = backend_problem(backend, device, world_size)
    if problem:
        raise ValueError(f"distributed.backend: {problem}")
    chosen = resolve_backend(backend, device)
    if chosen == "mpi":
        return MPICommunicator(world_size, world_rank)
    from .comm.torch import TorchDistributedCommunicator

    return TorchDistributedCommunicator(world_size, world_rank, chosen, device)


__all__ = ["BACKENDS", "MPIContext", "backend_problem", "intra_op_threads", "make_communicator", "resolve_backend",
           "setup_onnxruntime_with_mpi"]
