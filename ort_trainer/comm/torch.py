"""Collectives through ``torch.distributed``: NCCL on CUDA buffers, gloo on host or CUDA buffers.

The process group comes from the ranks the launcher started, through the world's store
(``World.make_store``): under ``mpirun`` a ``TCPStore`` that rank 0 serves and announces over MPI,
under ``torchrun`` the launcher's own. Each collective still starts with ``Communicator``'s header
exchange through the world, so a rank that left, skipped a step or hangs is reported by name and
ends the job, whatever moves the data.
"""

from __future__ import annotations

import atexit
import sys
from datetime import timedelta

import torch

from .._logging import logger
from .base import Communicator

# One process group per backend and process: a second trainer in the same job reuses it.
_groups: dict[str, object] = {}


def _dist():
    return torch.distributed


def _cuda_device(device: str) -> torch.device:
    parsed = torch.device(device)
    return parsed if parsed.index is not None else torch.device("cuda", torch.cuda.current_device())


def _buffer_device(backend: str, device: str) -> torch.device:
    """Where the buffers ``backend`` moves for an engine on ``device`` are: NCCL's always on a GPU,
    gloo's on the engine's device (a GPU, or the host)."""
    on_cuda = backend == "nccl" or torch.device(device).type == "cuda"
    return _cuda_device(device) if on_cuda else torch.device("cpu")


class TorchDistributedCommunicator(Communicator):
    """Moves flat buffers with ``torch.distributed``, in place.

    ``all_reduce(SUM)`` and ``broadcast`` run on the buffer itself. NCCL moves CUDA buffers in
    device memory. Gloo moves host buffers, and CUDA buffers too: for every collective used here
    (``allreduce``, ``broadcast``, and ``allgather``, which ``_allgather_base`` calls) its CUDA
    work copies the tensor to pinned host memory on a stream of its own, runs the host algorithm
    and copies the result back (``ProcessGroupGloo.cpp``/``ProcessGroupGlooCuda.cpp``:
    ``AsyncAllreduceCUDAHostWork``, ``AsyncBroadcastCUDAWork``, ``AsyncAllgatherCUDAWork``), so no
    collective needs a host copy of its own here. That is how two ranks share one GPU, which NCCL
    refuses.

    The ZeRO stage 1 all-gather uses ``all_gather_single`` (``all_gather_into_tensor`` before torch
    2.13; both reach gloo's ``_allgather_base``), which needs the same size from every rank: with
    equal ranges it runs in place on the flat buffer (each rank's range is the input, the whole
    buffer the output); with unequal ranges (Lamb keeps whole tensors on one rank) each rank's
    range is padded to the largest one in a scratch buffer and copied back.
    Padding, rather than ``all_gather`` of a list of unequal views: gloo refuses unequal sizes, and
    NCCL runs unequal ones as one broadcast per rank, where padding keeps NCCL's single ring
    all-gather at the cost of one device-local copy of the buffer.

    Gradients are all-reduced whole (also under ZeRO stage 1) rather than reduce-scattered: the
    optimizer graph needs the whole gradient for the global norm, clipping and the all-finite check.

    Args:
        world: this process's ``World`` (the launcher's ranks and store).
        world_size: the number of ranks ``options.distributed`` declares (checked against the world).
        world_rank: this process's rank ``options.distributed`` declares (checked against the world).
        backend: ``"gloo"`` (host or CUDA buffers) or ``"nccl"`` (CUDA buffers).
        device: the engine's device, where every buffer must be: ``"cpu"`` (gloo), or
            ``"cuda[:N]"`` (NCCL or gloo).

    Raises:
        ValueError: the launcher disagrees with ``world_size``/``world_rank``, or torch.distributed
            was already initialised by the script for another world.
        CollectiveError: the process group could not be set up on some rank.
    """

    def __init__(self, world, world_size: int, world_rank: int, backend: str, device: str):
        super().__init__(world, world_size, world_rank)
        self.backend = backend
        self.device = _buffer_device(backend, device)
        _process_group(self)
        self._padded: torch.Tensor | None = None
        self._gather = getattr(_dist(), "all_gather_single", None) or _dist().all_gather_into_tensor

    @property
    def _group(self):
        # Looked up, not held: the group must be freed when the process group is destroyed at exit
        # (gloo's threads are then joined; a group freed later, at interpreter teardown, was seen
        # to end the process with std::terminate in 1 run of 4).
        return _groups[self.backend]

    def _check(self, buffer: torch.Tensor) -> None:
        super()._check(buffer)
        if buffer.device != self.device:
            fix = ("use distributed.backend='gloo' or 'mpi' for host buffers" if self.backend == "nccl"
                   else "make it for the device the engine's buffers are on (device.id); on CUDA, "
                        "distributed.backend='nccl' moves them without host copies")
            raise RuntimeError(f"the {self.backend} communicator moves buffers on {self.device}, and this buffer is on "
                               f"{buffer.device}: {fix}")

    def _done(self, buffer: torch.Tensor) -> None:
        # NCCL runs on its own stream, which torch's current stream waits on; ONNX Runtime's stream
        # waits on neither, so the result must be complete before the next session run reads it.
        # Gloo copies the result back to a CUDA buffer on a stream from torch's pool and makes a
        # stream wait on that copy (the caller's, or the default stream of its worker thread,
        # depending on the collective and the torch version): waiting for the whole device covers
        # every case.
        if buffer.is_cuda:
            if self.backend == "nccl":
                torch.cuda.current_stream(buffer.device).synchronize()
            else:
                torch.cuda.synchronize(buffer.device)

    def _allreduce_sum(self, buffer: torch.Tensor) -> None:
        _dist().all_reduce(buffer, op=_dist().ReduceOp.SUM, group=self._group)
        self._done(buffer)

    def _broadcast(self, buffer: torch.Tensor, root: int) -> None:
        _dist().broadcast(buffer, src=root, group=self._group)
        self._done(buffer)

    def _allgather(self, buffer: torch.Tensor, counts: list[int]) -> None:
        rank = self.rank
        if len(set(counts)) == 1:
            width = counts[0]
            self._gather(buffer, buffer[rank * width:(rank + 1) * width], group=self._group)
            self._done(buffer)
            return
        width = max(counts)
        size = width * self.size
        padded = self._padded
        if padded is None or padded.numel() != size or padded.dtype != buffer.dtype:
            padded = self._padded = torch.zeros(size, dtype=buffer.dtype, device=buffer.device)
        offsets = [sum(counts[:r]) for r in range(self.size)]
        mine = padded[rank * width:(rank + 1) * width]
        mine[:counts[rank]].copy_(buffer[offsets[rank]:offsets[rank] + counts[rank]])
        self._gather(padded, mine, group=self._group)
        for r, (offset, count) in enumerate(zip(offsets, counts)):
            if r != rank:
                buffer[offset:offset + count].copy_(padded[r * width:r * width + count])
        self._done(buffer)


def _process_group(comm: TorchDistributedCommunicator):
    """This process's group for ``comm.backend``, set up on first use (collective over all ranks)."""
    group = _groups.get(comm.backend)
    if group is not None:
        return group
    dist = _dist()
    comm._headers.exchange("init_process_group", None, 0, comm.timeout)
    timeout = timedelta(seconds=comm.timeout)
    if comm.device.type == "cuda":  # NCCL's device; gloo's pinned copies and events on CUDA buffers
        torch.cuda.set_device(comm.device)
    if dist.is_initialized():  # the script set torch.distributed up itself: it must be this job's world
        if (dist.get_world_size(), dist.get_rank()) != (comm.size, comm.rank):
            raise ValueError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, but {comm.world.launcher} says rank {comm.rank} of "
                             f"{comm.size}: initialise it from the same {comm.world.launcher} job, or leave it to "
                             "ort_trainer")
        group = dist.group.WORLD if dist.get_backend() == comm.backend else dist.new_group(
            backend=comm.backend, timeout=timeout)
        atexit.register(_groups.clear)  # the script destroys what it set up
    else:
        store = comm.world.make_store(comm.timeout)
        extra = {"device_id": comm.device} if comm.backend == "nccl" else {}
        hook = sys.excepthook
        dist.init_process_group(comm.backend, store=store, rank=comm.rank, world_size=comm.size, timeout=timeout,
                                **extra)
        # init_process_group wraps the excepthook to buffer the traceback until the hook returns;
        # ours ends the job with MPI_Abort inside it, so the traceback was lost
        sys.excepthook = hook
        group = dist.group.WORLD
        atexit.register(_destroy)
    logger.info("rank %d of %d: torch.distributed %s process group ready on %s", comm.rank, comm.size, comm.backend,
                comm.device)
    _groups[comm.backend] = group
    return group


def _destroy() -> None:
    _groups.clear()
    dist = _dist()
    if dist.is_initialized():
        dist.destroy_process_group()
