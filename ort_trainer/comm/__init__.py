"""Collectives on flat tensors for data-parallel training: the ``Communicator`` interface with its
deadline (``base.py``) and its two implementations, MPI (``mpi.py``) and torch.distributed
(``torch.py``). ``distributed.make_communicator`` picks one."""
