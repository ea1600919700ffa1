"""Data-parallel training under ``mpirun`` (api.md section 8).

``setup_onnxruntime_with_mpi()`` reads rank, size and local rank from mpi4py, picks the device,
seeds, splits the CPU threads between the ranks of a node, and makes an uncaught exception on
any rank end the whole job. The trainer uses ``Communicator`` for the collectives: one call per
step on one flat buffer (gradients all-reduced, weights broadcast and, with ZeRO stage 1,
all-gathered).
"""

from __future__ import annotations

import os
import random
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._logging import logger


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "distributed training needs mpi4py and an MPI library: pip install -e \".[mpi]\" "
            "(installs mpi4py and mpich, which provides mpirun)"
        ) from exc
    return MPI


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


_previous_hook = None


def install_abort_on_error() -> None:
    """Make an uncaught exception on this rank print its traceback and abort every rank.

    Without it the other ranks would wait forever in their next collective.
    """
    global _previous_hook
    if _previous_hook is not None:
        return
    _previous_hook = sys.excepthook

    def hook(kind, value, tb):
        try:
            rank = _mpi().COMM_WORLD.Get_rank()
            sys.stderr.write(f"[rank {rank}] uncaught exception; aborting the MPI job\n")
            traceback.print_exception(kind, value, tb, file=sys.stderr)
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            _mpi().COMM_WORLD.Abort(1)

    sys.excepthook = hook


class Communicator:
    """Collectives over ``MPI.COMM_WORLD`` on flat float32 numpy buffers, in place."""

    def __init__(self, world_size: int, world_rank: int):
        MPI = _mpi()
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD
        if self.comm.Get_size() != world_size or self.comm.Get_rank() != world_rank:
            raise ValueError(
                f"options.distributed says rank {world_rank} of {world_size}, but MPI says rank "
                f"{self.comm.Get_rank()} of {self.comm.Get_size()}: launch with `mpirun -n {world_size}` and fill "
                "the options from setup_onnxruntime_with_mpi()"
            )
        self.size, self.rank = world_size, world_rank
        install_abort_on_error()

    def allreduce_sum(self, buffer: np.ndarray) -> None:
        """Sum ``buffer`` over all ranks, in place (one call for the whole buffer)."""
        self.comm.Allreduce(self._mpi.IN_PLACE, buffer, op=self._mpi.SUM)

    def broadcast(self, buffer: np.ndarray, root: int = 0) -> None:
        """Overwrite ``buffer`` with rank ``root``'s, in place."""
        self.comm.Bcast(buffer, root=root)

    def allgather(self, buffer: np.ndarray, counts: list[int]) -> None:
        """Each rank owns the ``counts[rank]`` elements after the previous ranks'; share them all."""
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        self.comm.Allgatherv(self._mpi.IN_PLACE, [buffer, counts, displacements, self._mpi.FLOAT])

    def allgather_object(self, value: Any) -> list:
        """Every rank's ``value`` (small Python objects only)."""
        return self.comm.allgather(value)

    def barrier(self) -> None:
        """Wait for every rank."""
        self.comm.Barrier()
