"""Data-parallel training under ``mpirun`` (api.md section 8).

``setup_onnxruntime_with_mpi()`` reads rank, size and local rank from mpi4py, picks the device,
seeds, splits the CPU threads between the ranks of a node, and makes an uncaught exception on
any rank end the whole job. The trainer uses a ``Communicator`` for the collectives: one call per
step on one flat buffer (gradients all-reduced, weights broadcast and, with ZeRO stage 1,
all-gathered), moved by MPI (host buffers) or by ``torch.distributed`` (gloo for host buffers,
NCCL for CUDA buffers), as ``distributed.backend`` says. No collective waits forever: each starts
with a header exchange over MPI that checks every rank is in the same collective at the same
step and gives up after ``ORT_TRAINER_COLLECTIVE_TIMEOUT`` seconds (default 600).
"""

from __future__ import annotations

import atexit
import math
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

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


BACKENDS = ("auto", "mpi", "gloo", "nccl")


def resolve_backend(backend: str, device: str) -> str:
    """The backend ``distributed.backend`` names for ``device``: ``"auto"`` is NCCL on CUDA, else MPI."""
    if backend != "auto":
        return backend
    return "nccl" if device.startswith("cuda") else "mpi"


def backend_problem(backend: str, device: str, world_size: int) -> str | None:
    """What is wrong with ``distributed.backend`` for ``device`` (None when it fits).

    A backend named explicitly must be available in this torch build; ``"auto"`` only when there
    are several ranks (a single process makes no collectives).
    """
    chosen = resolve_backend(backend, device)
    on_cuda = device.startswith("cuda")
    if chosen == "nccl" and not on_cuda:
        return (f"'nccl' moves CUDA buffers, but device.id is {device!r}; on the CPU use 'gloo' or 'mpi' "
                "(or 'auto', which picks 'mpi')")
    if chosen in ("mpi", "gloo") and on_cuda:
        return (f"{chosen!r} moves host buffers, but device.id is {device!r} and the engine's buffers live in "
                "device memory; use 'nccl' (or 'auto', which picks it on CUDA)")
    if chosen in ("gloo", "nccl") and (backend != "auto" or world_size > 1):
        if not torch.distributed.is_available():
            return (f"{chosen!r} runs through torch.distributed, which this torch build ({torch.__version__}) does "
                    "not have; install a torch build with it, or use 'mpi' on the CPU")
        if not torch.distributed.is_backend_available(chosen):
            build = "a CUDA build of torch on Linux" if chosen == "nccl" else "a torch build with gloo"
            return (f"torch.distributed in this torch build ({torch.__version__}) has no {chosen!r} backend; "
                    f"install {build}" + (", or use 'mpi' on the CPU" if chosen == "gloo" else ""))
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
    from ._torch_distributed import TorchDistributedCommunicator

    return TorchDistributedCommunicator(world_size, world_rank, chosen, device)


class Communicator:
    """Collectives between the ranks of an ``mpirun`` job, in place on flat buffers (torch tensors).

    One interface; the subclasses move the data: ``MPICommunicator`` (mpi4py, host buffers) and
    ``TorchDistributedCommunicator`` (``torch.distributed``: gloo for host buffers, NCCL for CUDA
    buffers). ``make_communicator`` picks one for ``distributed.backend``. Small Python objects
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


class MPICommunicator(Communicator):
    """Collectives with MPI on host buffers: ``MPI_Allreduce``, ``MPI_Bcast`` and ``MPI_Allgatherv``
    on NumPy views of the tensors (no copy). CPU buffers only (see ``Communicator``)."""

    backend = "mpi"

    def _check(self, buffer: torch.Tensor) -> None:
        super()._check(buffer)
        if buffer.device.type != "cpu":
            raise RuntimeError(
                f"the MPI backend moves host buffers, and this buffer is on {buffer.device}: use "
                "distributed.backend='nccl' (or 'auto', which picks it on CUDA) to all-reduce device buffers "
                "through torch.distributed")

    def _allreduce_sum(self, buffer: torch.Tensor) -> None:
        self.comm.Allreduce(self._mpi.IN_PLACE, buffer.detach().numpy(), op=self._mpi.SUM)

    def _broadcast(self, buffer: torch.Tensor, root: int) -> None:
        self.comm.Bcast(buffer.detach().numpy(), root=root)

    def _allgather(self, buffer: torch.Tensor, counts: list[int]) -> None:
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        array = buffer.detach().numpy()
        self.comm.Allgatherv(self._mpi.IN_PLACE, [array, counts, displacements, self._mpi._typedict[array.dtype.char]])
