"""Collectives moved by MPI (mpi4py) on NumPy views of host buffers."""

from __future__ import annotations

import numpy as np
import torch

from .base import Communicator


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


__all__ = ["MPICommunicator"]
