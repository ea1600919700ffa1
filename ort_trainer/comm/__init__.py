"""Collectives on flat tensors for data-parallel training: the ``Communicator`` interface with its
deadline (``base.py``), the launcher's ``World`` it runs in (``world.py``: ``mpirun``'s in ``mpi.py``,
``torchrun``'s in ``torchrun.py``), and the two data movers, MPI (``mpi.py``) and torch.distributed
(``torch.py``). ``distributed.make_communicator`` picks one."""
