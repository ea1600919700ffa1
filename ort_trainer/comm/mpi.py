"""The ranks ``mpirun`` started (``MPIWorld``) and the collectives MPI moves (``MPICommunicator``).

The world: rank and size from ``MPI.COMM_WORLD``, the local rank from the node's shared-memory
communicator, the header exchange as point-to-point messages, a ``torch.distributed`` store that
rank 0 serves and announces over MPI, and ``MPI_Abort`` to end the job.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from .base import CollectiveError, Communicator
from .world import HeaderExchange, World

_HEADER_TAG = 0x6F7274  # point-to-point tag of the collective headers ("ort")
_LOOPBACK = "127.0.0.1"


def mpi():
    """``mpi4py.MPI`` (initialising MPI), or an ImportError that says what to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "distributed training under mpirun needs mpi4py and an MPI library: pip install -e \".[mpi]\" "
            "(installs mpi4py and mpich, which provides mpirun); or launch with torchrun"
        ) from exc
    return MPI


class _MPIHeaders(HeaderExchange):
    """The header exchange as persistent point-to-point requests on fixed buffers: each exchange
    only restarts them."""

    def __init__(self, world: "MPIWorld"):
        super().__init__(world)
        comm, self.mpi = world.comm, world.mpi
        self.requests = [comm.Recv_init(self.received[peer], source=peer, tag=_HEADER_TAG) for peer in self.peers]
        self.requests += [comm.Send_init(self.mine, dest=peer, tag=_HEADER_TAG) for peer in self.peers]

    def _start(self) -> None:
        self.mpi.Prequest.Startall(self.requests)

    def _test(self) -> bool:
        return self.mpi.Request.Testall(self.requests)

    def _missing(self) -> list[int]:
        # Testall leaves every request as it was when it returns False
        return [self.peers[i] for i, r in enumerate(self.requests[:len(self.peers)]) if not r.Test()]

    def _send_exit(self, notice: np.ndarray) -> None:
        if not self.mpi.Is_initialized() or self.mpi.Is_finalized():
            return
        for request in self.requests:
            request.Free()
        requests = [self.world.comm.Isend(notice, dest=peer, tag=_HEADER_TAG) for peer in self.peers]
        deadline = time.monotonic() + 5.0
        while not self.mpi.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(1e-3)


class MPIWorld(World):
    """The ranks of an ``mpirun -n N`` job (a plain process is rank 0 of 1)."""

    launcher = "mpirun"
    job = "MPI job"

    def __init__(self):
        self.mpi = mpi()
        self.comm = self.mpi.COMM_WORLD
        local = self.comm.Split_type(self.mpi.COMM_TYPE_SHARED, key=self.comm.Get_rank())
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), local.Get_rank(), local.Get_size())
        local.Free()

    def launch_command(self, size: int) -> str:
        """``mpirun -n SIZE``."""
        return f"mpirun -n {size}"

    def _make_headers(self) -> HeaderExchange:
        return _MPIHeaders(self)

    def allgather_object(self, value: Any) -> list:
        """Every rank's ``value``, in rank order (``MPI_Allgather`` of pickles)."""
        return self.comm.allgather(value)

    def abort(self, status: int) -> None:
        """``MPI_Abort``, after giving mpiexec time to forward what this rank just wrote.

        The launcher relays each rank's stderr through a pipe; an abort right after the write was
        seen to lose the whole message on a loaded machine, leaving a failed job with no reason.
        """
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(0.5)
        self.comm.Abort(status)

    def make_store(self, timeout: float):
        """A ``TCPStore`` served by rank 0 on a port the operating system picks (no free-port race),
        its address sent to the other ranks over MPI. ``MASTER_ADDR``/``MASTER_PORT``, when set, are
        used instead (a firewall that opens one port, a node whose hostname others cannot resolve).

        Raises:
            CollectiveError: on every rank, when rank 0 could not serve the store.
            ValueError: ``MASTER_PORT`` is not a port number.
        """
        dist = torch.distributed
        wait = timedelta(seconds=timeout)
        given_host = os.environ.get("MASTER_ADDR", "").strip()
        text = os.environ.get("MASTER_PORT", "").strip() or "0"
        if not text.isdigit() or int(text) > 65535:
            raise ValueError(f"MASTER_PORT={text!r}: expected a TCP port number (0-65535); unset it to let rank 0 "
                             "pick a free port")
        store, message = None, None
        if self.rank == 0:
            try:
                # The server listens on every interface; host is where rank 0's own client connects.
                store = dist.TCPStore(given_host or _LOOPBACK, int(text), self.size, is_master=True, timeout=wait,
                                      wait_for_workers=False)
                message = (given_host or socket.gethostname(), store.port, None)
            except Exception as exc:  # every rank must hear of it, or the others would wait in bcast
                message = (None, None, f"{type(exc).__name__}: {exc}")
        host, port, failure = self.comm.bcast(message, root=0)
        if failure is not None:
            where = f" on port {text} (MASTER_PORT)" if text != "0" else ""
            raise CollectiveError(f"rank 0 could not serve the torch.distributed store{where}: {failure}. Unset "
                                  "MASTER_PORT (rank 0 then picks a free port) or choose a free one")
        if self.rank != 0:
            if not given_host and host == socket.gethostname():
                host = _LOOPBACK  # rank 0 is on this node
            store = dist.TCPStore(host, port, self.size, is_master=False, timeout=wait)
        return store


class MPICommunicator(Communicator):
    """Collectives with MPI on host buffers: ``MPI_Allreduce``, ``MPI_Bcast`` and ``MPI_Allgatherv``
    on NumPy views of the tensors (no copy). CPU buffers only, under ``mpirun`` only (see
    ``Communicator``)."""

    backend = "mpi"

    def __init__(self, world: MPIWorld, world_size: int, world_rank: int):
        super().__init__(world, world_size, world_rank)
        self.comm, self._mpi = world.comm, world.mpi

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


__all__ = ["MPICommunicator", "MPIWorld", "mpi"]
