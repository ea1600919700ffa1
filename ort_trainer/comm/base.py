"""The collectives' interface (``Communicator``), its errors, and the deadline no collective waits
past (``ORT_TRAINER_COLLECTIVE_TIMEOUT``).

What the communicators need from the launcher that started the ranks (the header exchange before
each collective, small objects, a store for ``torch.distributed``, ending the job) is a ``World``
(``world.py``; ``mpi.MPIWorld`` under ``mpirun``, ``torchrun.TorchrunWorld`` under ``torchrun``).
The data movers live beside it (``mpi.py``, ``torch.py``); ``distributed.make_communicator``
picks one.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch


TIMEOUT_VARIABLE = "ORT_TRAINER_COLLECTIVE_TIMEOUT"

DEFAULT_TIMEOUT_S = 600.0


def collective_timeout() -> float:
    """Seconds a collective waits for the other ranks: ``ORT_TRAINER_COLLECTIVE_TIMEOUT`` or 600.

    Raises:
        ValueError: when the variable is set to something that is not a positive number of seconds.
    """
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # also false for NaN
        raise ValueError(f"{TIMEOUT_VARIABLE}={text!r}: expected a positive number of seconds (e.g. 600); "
                         "unset it for the default of 600 s")
    return value


class CollectiveError(RuntimeError):
    """The ranks of a data-parallel job stopped agreeing: a collective can never complete.

    Raised on every rank that notices; uncaught, it ends the job (``install_abort_on_error``).
    """


class CollectiveMismatchError(CollectiveError):
    """The ranks arrived at different collectives, or at the same one at different steps."""


class CollectiveTimeoutError(CollectiveError):
    """Some ranks did not arrive at a collective within ``ORT_TRAINER_COLLECTIVE_TIMEOUT`` seconds."""


class Communicator:
    """Collectives between the ranks of an ``mpirun`` or ``torchrun`` job, in place on flat buffers
    (torch tensors).

    One interface; the subclasses move the data: ``MPICommunicator`` (mpi4py, host buffers; under
    ``mpirun``) and ``TorchDistributedCommunicator`` (``torch.distributed``: NCCL for CUDA buffers,
    gloo for host or CUDA buffers; under either launcher). ``make_communicator`` picks one for
    ``distributed.backend``. Small Python objects (``allgather_object``) and ``barrier`` go through
    the world (MPI messages, or the ``torchrun`` store) with every backend.

    Every collective first exchanges a small header with every other rank through the world:
    which collective it is, how many collectives this process has made, the caller's
    ``train_step`` count and the buffer size; a rank whose script ends sends a last header saying
    so. Ranks that disagree, or a rank that has left, raise ``CollectiveMismatchError`` naming each
    rank's collective and step; no collective waits longer than ``ORT_TRAINER_COLLECTIVE_TIMEOUT``
    seconds (default 600) for the others, after which ``CollectiveTimeoutError`` names the ranks
    that never arrived. After either error every later collective raises at once, and the job
    ends (``MPI_Abort``; under ``torchrun`` this rank exits with status 1 and the launcher ends the
    others) even if the error was caught.

    Args:
        world: the ``World`` of this process (``distributed.current_world()``).
        world_size: the number of ranks ``options.distributed`` declares.
        world_rank: this process's rank ``options.distributed`` declares.

    Raises:
        ValueError: when the launcher disagrees with ``world_size``/``world_rank``, or the timeout
            variable is malformed.
    """

    backend = ""

    def __init__(self, world, world_size: int, world_rank: int):
        if world.size != world_size or world.rank != world_rank:
            raise ValueError(
                f"options.distributed says rank {world_rank} of {world_size}, but {world.launcher} says rank "
                f"{world.rank} of {world.size}: launch with `{world.launch_command(world_size)}` and fill the "
                "options from setup_distributed() (DistributedContext.trainer_options)"
            )
        self.world = world
        self.size, self.rank = world_size, world_rank
        self.timeout = collective_timeout()
        self._headers = world.headers
        world.install_abort_on_error()

    def _run(self, operation: str, step: int | None, count: int, call: Callable[[], Any]) -> Any:
        # The header exchange is the rendezvous, and the only wait that can be on an absent rank:
        # once every rank has announced this very collective, the blocking call that moves the
        # data starts on all of them together (a rank that dies inside it ends the job through the
        # launcher). Polling a non-blocking Iallreduce from Python instead was 1.5-2.5x slower on
        # buffers of 10^5-10^6 floats: MPICH progresses it only inside MPI calls.
        self._headers.exchange(operation, step, count, self.timeout)
        return call()

    def _check(self, buffer: torch.Tensor) -> None:
        """Refuse, before the header exchange, a buffer this backend cannot move (the same on every rank)."""
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: expected a torch.Tensor buffer, got {type(buffer).__name__}")
        if not buffer.is_contiguous():
            raise ValueError(f"{type(self).__name__}: the buffer must be contiguous (a flat buffer or a "
                             "contiguous slice of one)")

    def allreduce_sum(self, buffer: torch.Tensor, step: int | None = None) -> None:
        """Sum ``buffer`` over all ranks, in place (one call for the whole buffer).

        Args:
            buffer: a contiguous tensor on the engine's device, the same size on every rank.
            step: the caller's ``train_step`` count, checked to be the same on every rank.

        Raises:
            CollectiveMismatchError, CollectiveTimeoutError: see the class.
            RuntimeError: the buffer is on a device this backend does not move.
        """
        self._check(buffer)
        self._run("allreduce_sum", step, buffer.numel(), lambda: self._allreduce_sum(buffer))

    def broadcast(self, buffer: torch.Tensor, root: int = 0, step: int | None = None) -> None:
        """Overwrite ``buffer`` with rank ``root``'s, in place (checked as ``allreduce_sum`` is)."""
        self._check(buffer)
        self._run("broadcast", step, buffer.numel(), lambda: self._broadcast(buffer, root))

    def allgather(self, buffer: torch.Tensor, counts: list[int], step: int | None = None) -> None:
        """Each rank owns the ``counts[rank]`` elements after the previous ranks'; share them all, in place.

        Args:
            buffer: a flat contiguous float32 tensor of ``sum(counts)`` elements on every rank.
            counts: elements per rank (ZeRO stage 1 ranges; they may differ).
            step: as in ``allreduce_sum``.

        Raises:
            ValueError: ``counts`` does not have one entry per rank summing to the buffer's size.
            CollectiveMismatchError, CollectiveTimeoutError: see the class.
        """
        self._check(buffer)
        counts = [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != buffer.numel() or buffer.dim() != 1:
            raise ValueError(f"allgather: counts {counts} must give one range per rank ({self.size}) covering the "
                             f"flat buffer ({list(buffer.shape)})")
        self._run("allgather", step, buffer.numel(), lambda: self._allgather(buffer, counts))

    def allgather_object(self, value: Any, step: int | None = None) -> list:
        """Every rank's ``value`` (small picklable Python objects only), in rank order."""
        return self._run("allgather_object", step, -1, lambda: self.world.allgather_object(value))

    def barrier(self, step: int | None = None) -> None:
        """Wait for every rank (the header exchange is itself the barrier)."""
        self._headers.exchange("barrier", step, 0, self.timeout)

    # ---- what the backends implement: the data movement, after the header exchange --------------
    def _allreduce_sum(self, buffer: torch.Tensor) -> None:
        raise NotImplementedError

    def _broadcast(self, buffer: torch.Tensor, root: int) -> None:
        raise NotImplementedError

    def _allgather(self, buffer: torch.Tensor, counts: list[int]) -> None:
        raise NotImplementedError


__all__ = ["CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError", "Communicator", "DEFAULT_TIMEOUT_S",
           "TIMEOUT_VARIABLE", "collective_timeout"]
