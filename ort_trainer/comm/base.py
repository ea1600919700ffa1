"""The collectives' interface (``Communicator``) and what keeps a job from waiting forever: a header
exchange over MPI before each collective, with a deadline (``ORT_TRAINER_COLLECTIVE_TIMEOUT``), and
an uncaught exception on one rank ending every rank (``install_abort_on_error``).

The implementations live beside it (``mpi.py``, ``torch.py``); ``distributed.make_communicator``
picks one.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch

from .._logging import logger


def _let_the_launcher_forward_output() -> None:
    """Give mpiexec time to forward what this rank just wrote before MPI_Abort kills every rank.

    The launcher relays each rank's stderr through a pipe; an abort right after the write was
    seen to lose the whole message on a loaded machine, leaving a failed job with no reason.
    """
    time.sleep(0.5)


_previous_hook = None

_aborting = False  # the excepthook is ending the job (it has printed the error)


def install_abort_on_error() -> None:
    """Make an uncaught exception on this rank print its traceback and abort every rank.

    Without it the other ranks would wait in their next collective until its timeout. In a
    process that is not part of a multi-rank job the exception is reported as usual (no
    ``MPI_Abort``).
    """
    global _previous_hook
    if _previous_hook is not None:
        return
    _previous_hook = sys.excepthook

    def hook(kind, value, tb):
        global _aborting
        world = _mpi().COMM_WORLD
        if world.Get_size() == 1:
            _previous_hook(kind, value, tb)
            return
        _aborting = True
        try:
            sys.stderr.write(f"[rank {world.Get_rank()}] uncaught exception; aborting the MPI job\n")
            traceback.print_exception(kind, value, tb, file=sys.stderr)
            sys.stderr.flush()
            sys.stdout.flush()
            _let_the_launcher_forward_output()
        finally:
            world.Abort(1)

    sys.excepthook = hook


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "distributed training needs mpi4py and an MPI library: pip install -e \".[mpi]\" "
            "(installs mpi4py and mpich, which provides mpirun)"
        ) from exc
    return MPI


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


_HEADER_TAG = 0x6F7274  # point-to-point tag of the collective headers ("ort")

_OPERATIONS = ("barrier", "broadcast", "allreduce_sum", "allgather", "allgather_object", "init_process_group",
               "exit")


_EXIT = _OPERATIONS.index("exit")

_FIX = ("Every rank must make the same train_step calls in the same order (and the same "
        "state_dict/save_checkpoint calls): a rank that skips a batch, for example after catching its error, "
        "or leaves its loop early, leaves the others waiting. Skip or stop on every rank together (agree with "
        "an allreduce on a flag), or repair the data")


def _describe(rank: int, header: np.ndarray) -> str:
    op, sequence, step, _ = (int(v) for v in header)
    if op == _EXIT:
        done = f"after train_step {step}" if step >= 0 else "before its first train_step"
        return f"rank {rank} has left the job: its script ended {done} (collective #{sequence - 1} was its last)"
    where = f"at train_step {step}" if step >= 0 else "outside train_step"
    return f"rank {rank} is in {_OPERATIONS[op]} {where} (collective #{sequence})"


class _Headers:
    """The process's side of the header exchange that precedes every collective.

    One per process (all communicators share ``COMM_WORLD`` and the header tag, so they share
    the count of collectives too).
    """

    def __init__(self, comm, mpi):
        self.comm, self.mpi = comm, mpi
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.peers = [r for r in range(self.size) if r != self.rank]
        self.sequence = 0
        self.last_step = -1
        self.failure: CollectiveError | None = None
        self.received = np.zeros((self.size, 4), np.int64)
        self.mine = self.received[self.rank]
        # persistent requests on fixed buffers: each exchange only restarts them
        self.requests = [comm.Recv_init(self.received[peer], source=peer, tag=_HEADER_TAG) for peer in self.peers]
        self.requests += [comm.Send_init(self.mine, dest=peer, tag=_HEADER_TAG) for peer in self.peers]
        atexit.register(self._announce_exit)

    def exchange(self, operation: str, step: int | None, count: int, timeout: float) -> None:
        """Send this rank's header to every rank and check theirs, waiting at most ``timeout`` seconds.

        Raises:
            CollectiveMismatchError: when a rank is in another collective, at another step, or has left.
            CollectiveTimeoutError: when a rank does not arrive in time.
        """
        if self.failure is not None:
            raise type(self.failure)(f"an earlier collective failed, so this {operation} cannot run: {self.failure}")
        self.sequence += 1
        if step is not None:
            self.last_step = step
        mine, received = self.mine, self.received
        mine[:] = (_OPERATIONS.index(operation), self.sequence, -1 if step is None else step, count)
        self.mpi.Prequest.Startall(self.requests)
        try:
            self._wait(self.requests, operation, step, timeout)
        except KeyboardInterrupt:  # the exchange is half done: no later collective can match up
            self.failure = CollectiveError(f"rank {self.rank} was interrupted in {operation}")
            atexit.register(self._abort_at_exit)
            raise
        if (received != mine).any():
            sizes_differ = (received[:, 3] != mine[3]).any() and not (received[:, 0] == _EXIT).any()
            lines = [_describe(r, received[r]) + (f" with {int(received[r][3])} elements" if sizes_differ else "")
                     for r in range(self.size)]
            self.fail(CollectiveMismatchError(f"rank {self.rank}: the ranks are out of step: " + "; ".join(lines)
                                              + f". {_FIX}"))

    def _wait(self, requests: list, operation: str, step: int | None, timeout: float) -> None:
        """Poll the header requests until all are complete, or raise after ``timeout`` seconds.

        Polling, not a blocking wait, so a rank that never arrives cannot hang this one. The first
        20 ms poll without pause (yielding the core to any other runnable process), as MPI's own
        blocking calls do: ranks a few milliseconds apart meet with no added latency. Longer waits
        (a graph build, a save on one rank) then pause between polls, growing to 2 ms.
        """
        test_all = self.mpi.Request.Testall
        if test_all(requests):
            return
        now = time.monotonic()
        spin_until, deadline = now + 0.02, now + timeout
        pause = 1e-4
        while not test_all(requests):
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            if now > deadline:
                # Testall leaves every request as it was when it returns False
                missing = [self.peers[i] for i, r in enumerate(requests[:len(self.peers)]) if not r.Test()]
                who = f"rank(s) {missing} never arrived" if missing else "the other ranks did not complete it"
                where = f"at train_step {step}" if step is not None else "outside train_step"
                self.fail(CollectiveTimeoutError(
                    f"rank {self.rank}: waited {timeout:g} s in {operation} {where} (collective #{self.sequence}), "
                    f"but {who}: a rank has crashed, is stuck, or is busy with work the others do not wait for. "
                    f"{_FIX}. If a rank legitimately needs longer (a long evaluation or save on one rank), raise "
                    f"{TIMEOUT_VARIABLE} (seconds, now {timeout:g})"))
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)

    def fail(self, error: CollectiveError) -> None:
        """Record ``error``, make sure the job cannot end with status 0, and raise it."""
        self.failure = error
        atexit.register(self._abort_at_exit)
        raise error

    def _abort_at_exit(self) -> None:
        # The error was caught and the script ran on to its end: the job is still broken.
        if _aborting:
            return
        logger.error("ending the MPI job after a failed collective: %s", self.failure)
        sys.stderr.flush()
        _let_the_launcher_forward_output()
        self.comm.Abort(1)

    def _announce_exit(self) -> None:
        """Tell every rank this one has left, so a rank still waiting in a collective stops at once."""
        if self.failure is not None or not self.mpi.Is_initialized() or self.mpi.Is_finalized():
            return
        for request in self.requests:
            request.Free()
        notice = np.array([_EXIT, self.sequence + 1, self.last_step, -1], np.int64)
        requests = [self.comm.Isend(notice, dest=peer, tag=_HEADER_TAG) for peer in self.peers]
        deadline = time.monotonic() + 5.0
        while not self.mpi.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(1e-3)


_headers: _Headers | None = None


class Communicator:
    """Collectives between the ranks of an ``mpirun`` job, in place on flat buffers (torch tensors).

    One interface; the subclasses move the data: ``MPICommunicator`` (mpi4py, host buffers) and
    ``TorchDistributedCommunicator`` (``torch.distributed``: NCCL for CUDA buffers, gloo for host
    or CUDA buffers). ``make_communicator`` picks one for ``distributed.backend``. Small Python objects
    (``allgather_object``) and ``barrier`` go over MPI with every backend.

    Every collective first exchanges a small header over MPI with every other rank: which
    collective it is, how many collectives this process has made, the caller's ``train_step``
    count and the buffer size; a rank whose script ends sends a last header saying so. Ranks that
    disagree, or a rank that has left, raise ``CollectiveMismatchError`` naming each rank's
    collective and step; no collective waits longer than ``ORT_TRAINER_COLLECTIVE_TIMEOUT`` seconds
    (default 600) for the others, after which ``CollectiveTimeoutError`` names the ranks that never
    arrived. After either error every later collective raises at once, and the process ends
    with ``MPI_Abort`` even if the error was caught.

    Args:
        world_size: the number of ranks ``options.distributed`` declares.
        world_rank: this process's rank ``options.distributed`` declares.

    Raises:
        ValueError: when MPI disagrees with ``world_size``/``world_rank``, or the timeout variable
            is malformed.
    """

    backend = ""

    def __init__(self, world_size: int, world_rank: int):
        global _headers
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
        self.timeout = collective_timeout()
        if _headers is None:
            _headers = _Headers(self.comm, MPI)
        self._headers = _headers
        install_abort_on_error()

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
        return self._run("allgather_object", step, -1, lambda: self.comm.allgather(value))

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
           "TIMEOUT_VARIABLE", "collective_timeout", "install_abort_on_error"]
