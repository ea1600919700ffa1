"""The seam between the collectives and the launcher that started the ranks: a ``World``.

A world knows this process's rank among the others, carries the header exchange that precedes
every collective (``HeaderExchange``: which collective, at which step, with a deadline), moves
small Python objects, hands ``torch.distributed`` a store to meet through, and ends the whole job
when one rank fails. Two launchers, two worlds: ``mpirun`` (``mpi.MPIWorld``: point-to-point MPI
messages, ``MPI_Abort``) and ``torchrun`` (``torchrun.TorchrunWorld``: keys in the launcher's
``TCPStore``, the launcher ending the other ranks). ``distributed.current_world`` picks one from
the environment the launcher set.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

from .._logging import logger
from .base import TIMEOUT_VARIABLE, CollectiveError, CollectiveMismatchError, CollectiveTimeoutError

_OPERATIONS = ("barrier", "broadcast", "allreduce_sum", "allgather", "allgather_object", "init_process_group",
               "exit")

_EXIT = _OPERATIONS.index("exit")

_FIX = ("Every rank must make the same train_step calls in the same order (and the same "
        "state_dict/save_checkpoint calls): a rank that skips a batch, for example after catching its error, "
        "or leaves its loop early, leaves the others waiting. Skip or stop on every rank together (agree with "
        "an allreduce on a flag), or repair the data")

_aborting = False  # the excepthook is ending the job (it has printed the error)


def _describe(rank: int, header: np.ndarray) -> str:
    op, sequence, step, _ = (int(v) for v in header)
    if op == _EXIT:
        done = f"after train_step {step}" if step >= 0 else "before its first train_step"
        return f"rank {rank} has left the job: its script ended {done} (collective #{sequence - 1} was its last)"
    where = f"at train_step {step}" if step >= 0 else "outside train_step"
    return f"rank {rank} is in {_OPERATIONS[op]} {where} (collective #{sequence})"


class HeaderExchange:
    """The process's side of the header exchange that precedes every collective.

    Every rank sends every other rank four numbers (the collective, how many collectives this
    process has made, the caller's ``train_step`` count, the buffer size) and checks theirs; a
    rank whose script ends sends a last header saying so. One per process: every communicator of
    the process shares it, and so the count of collectives. The transport is the world's: the
    subclasses implement ``_start`` (send this rank's header), ``_test`` (have all the others'
    arrived? then they are in ``received``), ``_missing`` (the ranks whose header has not) and
    ``_send_exit``.
    """

    def __init__(self, world: "World"):
        self.world = world
        self.rank, self.size = world.rank, world.size
        self.peers = [r for r in range(self.size) if r != self.rank]
        self.sequence = 0
        self.last_step = -1
        self.failure: CollectiveError | None = None
        self.received = np.zeros((self.size, 4), np.int64)
        self.mine = self.received[self.rank]
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
        try:
            self._start()
            self._wait(operation, step, timeout)
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

    def _wait(self, operation: str, step: int | None, timeout: float) -> None:
        """Poll ``_test`` until every header has arrived, or raise after ``timeout`` seconds.

        Polling, not a blocking wait, so a rank that never arrives cannot hang this one. The first
        20 ms poll without pause (yielding the core to any other runnable process), as MPI's own
        blocking calls do: ranks a few milliseconds apart meet with no added latency. Longer waits
        (a graph build, a save on one rank) then pause between polls, growing to 2 ms.
        """
        if self._test():
            return
        now = time.monotonic()
        spin_until, deadline = now + 0.02, now + timeout
        pause = 1e-4
        while not self._test():
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            if now > deadline:
                missing = self._missing()
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
        logger.error("ending the %s after a failed collective: %s", self.world.job, self.failure)
        self.world.abort(1)

    def _announce_exit(self) -> None:
        """Tell every rank this one has left, so a rank still waiting in a collective stops at once."""
        if self.failure is not None:
            return
        notice = np.array([_EXIT, self.sequence + 1, self.last_step, -1], np.int64)
        try:
            self._send_exit(notice)
        except Exception as exc:  # the others may be gone already: nothing is waiting for the notice
            logger.debug("rank %d: the exit notice did not go out: %s", self.rank, exc)

    # ---- the transport ---------------------------------------------------------------------------
    def _start(self) -> None:
        raise NotImplementedError

    def _test(self) -> bool:
        raise NotImplementedError

    def _missing(self) -> list[int]:
        raise NotImplementedError

    def _send_exit(self, notice: np.ndarray) -> None:
        raise NotImplementedError


class World:
    """This process among the ranks a launcher started (``mpirun`` or ``torchrun``).

    Attributes:
        launcher: ``"mpirun"`` or ``"torchrun"``.
        job: what the messages call the job (``"MPI job"``, ``"torchrun job"``).
        rank: this process's rank.
        size: the number of ranks.
        local_rank: this process's rank among the ranks on its node.
        local_size: the number of ranks on this node.
    """

    launcher = ""
    job = ""

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int):
        self.rank, self.size, self.local_rank, self.local_size = rank, size, local_rank, local_size
        self._headers: HeaderExchange | None = None

    @property
    def headers(self) -> HeaderExchange:
        """The process's header exchange, made on first use."""
        if self._headers is None:
            self._headers = self._make_headers()
        return self._headers

    def launch_command(self, size: int) -> str:
        """The command line that starts ``size`` ranks with this launcher."""
        raise NotImplementedError

    def allgather_object(self, value: Any) -> list:
        """Every rank's ``value`` (small picklable objects), in rank order; after a header exchange."""
        raise NotImplementedError

    def make_store(self, timeout: float):
        """A ``torch.distributed`` store shared by every rank, for ``init_process_group``."""
        raise NotImplementedError

    def abort(self, status: int) -> None:
        """End every rank of the job now, with ``status``; does not return."""
        raise NotImplementedError

    def _make_headers(self) -> HeaderExchange:
        raise NotImplementedError

    def install_abort_on_error(self) -> None:
        """Make an uncaught exception on this rank print its traceback and end every rank.

        Without it the other ranks would wait in their next collective until its timeout. In a
        process that is the only rank the exception is reported as usual.
        """
        global _previous_hook
        if _previous_hook is not None:
            return
        _previous_hook = previous = sys.excepthook

        def hook(kind, value, tb):
            global _aborting
            if self.size == 1:
                previous(kind, value, tb)
                return
            _aborting = True
            try:
                sys.stderr.write(f"[rank {self.rank}] uncaught exception; aborting the {self.job}\n")
                traceback.print_exception(kind, value, tb, file=sys.stderr)
                sys.stderr.flush()
                sys.stdout.flush()
            finally:
                self.abort(1)

        sys.excepthook = hook


_previous_hook = None


__all__ = ["HeaderExchange", "World"]
