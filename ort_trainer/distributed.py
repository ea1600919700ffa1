"""Data-parallel training under ``mpirun`` or ``torchrun`` (api.md section 8).

``setup_distributed()`` (also under its ORTTrainer name, ``setup_onnxruntime_with_mpi()``) finds
this process's rank from the launcher that started it (``torchrun``'s ``env://`` variables, or
mpi4py under ``mpirun``; a plain process is rank 0 of 1), picks the device, seeds, splits the CPU
threads between the ranks of a node, and makes an uncaught exception on any rank end the whole
job. The trainer uses a ``Communicator`` for the collectives: one call per step on one flat
buffer (gradients all-reduced, weights broadcast and, with ZeRO stage 1, all-gathered), moved by
MPI (host buffers, under ``mpirun``) or by ``torch.distributed`` (NCCL for CUDA buffers; gloo for
host buffers, and for CUDA buffers through pinned host copies, as when ranks share a GPU), as
``distributed.backend`` says. No collective waits forever: each starts with a header exchange
through the launcher's world (MPI messages, or torchrun's store) that checks every rank is in the
same collective at the same step and gives up after ``ORT_TRAINER_COLLECTIVE_TIMEOUT`` seconds
(default 600).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._logging import logger
from .comm.base import Communicator, collective_timeout
from .comm.mpi import MPICommunicator, MPIWorld
from .comm.torch import TorchDistributedCommunicator
from .comm.torchrun import REQUIRED as _TORCHRUN_VARIABLES
from .comm.torchrun import TorchrunWorld
from .comm.world import World

LAUNCHERS = ("mpirun", "torchrun")
"""The launchers whose ranks ort_trainer runs as one job."""

# what MPICH's hydra, Open MPI and PMIx launchers set for each rank
_MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")

_world: World | None = None


def launcher_of_environment(environ=os.environ) -> str:
    """The launcher that started this process, from its environment alone (no MPI started).

    ``"torchrun"`` when the ``env://`` variables are set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, or ``TORCHELASTIC_RUN_ID``) and no MPI launcher's are; else ``"mpirun"`` (a plain
    process counts as a one-rank ``mpirun`` job, as before ``torchrun`` existed).
    """
    if any(environ.get(name, "").strip() for name in _MPI_RANK_VARIABLES):
        return "mpirun"
    if environ.get("TORCHELASTIC_RUN_ID") or all(environ.get(name, "").strip() for name in _TORCHRUN_VARIABLES):
        return "torchrun"
    return "mpirun"


def launcher_rank(environ=os.environ) -> int:
    """This process's rank as its launcher set it (0 outside a launcher), without starting MPI."""
    names = ("RANK",) if launcher_of_environment(environ) == "torchrun" else _MPI_RANK_VARIABLES
    for name in names:
        if environ.get(name, "").strip().isdigit():
            return int(environ[name])
    return 0


def current_world() -> World:
    """This process's ``World``, made on first use: ``TorchrunWorld`` under ``torchrun``, else
    ``MPIWorld`` (which starts MPI).

    Raises:
        ImportError: outside ``torchrun`` without mpi4py (the message says what to install).
        ValueError: ``torchrun``'s variables are malformed.
    """
    global _world
    if _world is None:
        _world = TorchrunWorld(collective_timeout()) if launcher_of_environment() == "torchrun" else MPIWorld()
    return _world


def running_world() -> World | None:
    """The world this process has already set up, when it has several ranks (else None)."""
    return _world if _world is not None and _world.size > 1 else None


# Threads each ONNX Runtime session may use in this process (0: ONNX Runtime's default).
_intra_op_threads = 0


def intra_op_threads() -> int:
    """The intra-op thread count set by ``setup_onnxruntime_with_mpi`` (0 when not set)."""
    return _intra_op_threads


@dataclass
class DistributedContext:
    """What ``setup_distributed`` found and set.

    Attributes:
        world_rank: this process's rank.
        world_size: the number of processes.
        local_rank: this process's rank among the processes on its node.
        local_size: the number of processes on this node.
        device: ``"cuda:<local_rank % gpus>"`` or ``"cpu"``.
        threads: intra-op threads given to each of this process's ONNX Runtime sessions.
        launcher: ``"mpirun"`` or ``"torchrun"`` (a plain process: ``"mpirun"``, rank 0 of 1).
    """

    world_rank: int
    world_size: int
    local_rank: int
    local_size: int
    device: str
    threads: int
    launcher: str = "mpirun"

    def distributed_options(self) -> dict:
        """The ``distributed`` group of ``ORTTrainerOptions``."""
        return {"world_rank": self.world_rank, "world_size": self.world_size, "local_rank": self.local_rank}

    def trainer_options(self, **extra: Any) -> dict:
        """An ``ORTTrainerOptions`` dict with ``device`` and ``distributed`` filled in, merged with ``extra``."""
        options = {key: dict(value) if isinstance(value, dict) else value for key, value in extra.items()}
        options.setdefault("device", {})["id"] = self.device
        options.setdefault("distributed", {}).update(self.distributed_options())
        return options


def setup_distributed(seed: int | None = None) -> DistributedContext:
    """Set this process up as one rank of a ``torchrun --nproc_per_node N`` or ``mpirun -n N`` job.

    Reads rank, size and local rank from the launcher (``torchrun``'s ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; under ``mpirun`` from ``MPI.COMM_WORLD`` and the node-local
    communicator); picks ``cuda:<local_rank % gpus>`` when the CUDA build sees GPUs, else ``cpu``;
    seeds torch, numpy, Python and ONNX Runtime with ``seed + world_rank`` when ``seed`` is given;
    gives each rank ``cores // ranks_on_this_node`` threads (torch and ONNX Runtime) so 2 ranks on 2
    cores do not oversubscribe; and installs a hook that ends the whole job when any rank raises.

    Works in a plain process too (rank 0 of 1).

    Returns:
        A ``DistributedContext``; ``ctx.trainer_options(...)`` gives the options dict for
        ``ORTTrainer``.

    Raises:
        ImportError: outside ``torchrun`` without mpi4py.
        ValueError: ``torchrun``'s variables are malformed.
    """
    global _intra_op_threads
    import onnxruntime as ort

    world = current_world()
    rank, size, local_rank, local_size = world.rank, world.size, world.local_rank, world.local_size
    world.install_abort_on_error()

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
    context = DistributedContext(rank, size, local_rank, local_size, device, threads, world.launcher)
    logger.info("rank %d of %d (local %d of %d, %s) on %s with %d threads", rank, size, local_rank, local_size,
                world.launcher, device, threads)
    return context


def setup_onnxruntime_with_mpi(seed: int | None = None) -> DistributedContext:
    """ORTTrainer's name for ``setup_distributed``: the same, under ``mpirun`` and ``torchrun`` alike,
    so a script written for ``mpirun`` runs under ``torchrun`` unchanged."""
    return setup_distributed(seed)


MPIContext = DistributedContext
"""ORTTrainer's name for ``DistributedContext``."""


BACKENDS = ("auto", "mpi", "gloo", "nccl")
"""The values of ``distributed.backend``."""


def resolve_backend(backend: str, device: str, launcher: str | None = None) -> str:
    """The backend ``distributed.backend`` names for ``device``: ``"auto"`` is NCCL on CUDA, else
    MPI under ``mpirun`` and gloo under ``torchrun`` (``launcher``; by default the environment's)."""
    if backend != "auto":
        return backend
    if device.startswith("cuda"):
        return "nccl"
    return "gloo" if (launcher or launcher_of_environment()) == "torchrun" else "mpi"


def backend_problem(backend: str, device: str, world_size: int, launcher: str | None = None) -> str | None:
    """What is wrong with ``distributed.backend`` for ``device`` (None when it fits).

    ``"nccl"`` moves CUDA buffers only and ``"mpi"`` host buffers only; ``"gloo"`` moves either
    (CUDA buffers through pinned host copies that gloo makes itself: the way for several ranks that
    share one GPU, where NCCL refuses two ranks on one device). A backend named explicitly must be
    available in this torch build; ``"auto"`` only when there are several ranks (a single process
    makes no collectives). ``"mpi"`` needs ranks that ``mpirun`` started (``launcher``; by default
    the environment's).
    """
    launcher = launcher or launcher_of_environment()
    chosen = resolve_backend(backend, device, launcher)
    on_cuda = device.startswith("cuda")
    if chosen == "mpi" and launcher == "torchrun" and world_size > 1:
        return ("'mpi' moves buffers between ranks that mpirun started, and torchrun started this one; use "
                "'gloo' on the CPU (or 'auto', which picks it under torchrun), 'nccl' on CUDA, or launch with "
                "`mpirun -n N`")
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
        world_size: the number of ranks, as ``options.distributed`` declares it.
        world_rank: this process's rank, as ``options.distributed`` declares it.

    Returns:
        An ``MPICommunicator`` or a ``TorchDistributedCommunicator``.

    Raises:
        ValueError: the backend does not fit the device, is not available in this torch build, or
            the launcher disagrees with ``world_size``/``world_rank``.
    """
    world = current_world()
    problem = backend_problem(backend, device, world_size, world.launcher)
    if problem:
        raise ValueError(f"distributed.backend: {problem}")
    chosen = resolve_backend(backend, device, world.launcher)
    if chosen == "mpi":
        return MPICommunicator(world, world_size, world_rank)
    return TorchDistributedCommunicator(world, world_size, world_rank, chosen, device)


__all__ = ["BACKENDS", "LAUNCHERS", "DistributedContext", "MPIContext", "backend_problem", "current_world",
           "intra_op_threads", "launcher_of_environment", "launcher_rank", "make_communicator", "resolve_backend",
           "running_world", "setup_distributed", "setup_onnxruntime_with_mpi"]
