"""The ranks ``torchrun`` started (``TorchrunWorld``): the ``env://`` contract and the launcher's store.

``torchrun --nproc_per_node N`` (PyTorch's elastic launcher) starts N processes and gives each
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
its agent serves a ``TCPStore`` there (``TORCHELASTIC_USE_AGENT_STORE``; without the agent, rank 0
serves it, as ``torch.distributed``'s ``env://`` rendezvous does). Everything this world does goes
through that store, under a prefix of its own: the collective headers are keys (``h<n>/<rank>``)
that each rank sets and polls for, small objects are pickles under ``o<n>/<rank>``, and
``torch.distributed``'s process group meets there too. When a rank fails it exits with status 1;
``torchrun`` then ends the other ranks (its monitor polls every 0.1 s by default).
"""

from __future__ import annotations

import os
import pickle
import sys
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from .base import CollectiveError
from .world import HeaderExchange, World

# What torchrun (and any env:// launcher) sets for every rank; the rest have defaults.
REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def environment_problem(environ=os.environ) -> str | None:
    """What is missing or malformed in the ``env://`` variables (None when they describe a rank)."""
    missing = [name for name in REQUIRED if not environ.get(name, "").strip()]
    if missing:
        return f"{', '.join(missing)} not set (torchrun sets {', '.join(REQUIRED)})"
    bad = [f"{name}={environ[name]!r}" for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                     "MASTER_PORT") if name in environ
           and not environ[name].strip().isdigit()]
    if bad:
        return f"{', '.join(bad)}: expected non-negative whole numbers"
    rank, size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    if not 0 <= rank < size:
        return f"RANK={rank} must be below WORLD_SIZE={size}"
    return None


class _StoreHeaders(HeaderExchange):
    """The header exchange through the store: set this rank's key, read the others' until they
    hold this collective's number.

    Two keys per rank, used in turn (``h<n % 2>/<rank>``): a rank sets its header of collective
    n + 2 only after collective n + 1, which needs every rank's header of n + 1, which each sets
    only after reading everyone's of n; so no header is overwritten before every rank has read
    it, the store never holds more than two per rank, and an exchange costs two round trips to
    the store (set, then one ``multi_get`` of the others' keys per poll). A key that still holds
    collective n - 2 means that rank has not arrived yet. A rank's notice that it has left takes
    the number of the collective after its last one, which is where the others look next.
    """

    def __init__(self, world: "TorchrunWorld"):
        super().__init__(world)
        self.store = world.store
        self.keys = [f"h0/{peer}" for peer in self.peers]
        self.arrived: set[int] = set()
        self.all_set = False  # every peer's keys exist (before, multi_get would block on a missing one)

    def _start(self) -> None:
        slot = self.sequence % 2
        self.keys = [f"h{slot}/{peer}" for peer in self.peers]
        self.arrived = set()
        self._store_call(self.store.set, f"h{slot}/{self.rank}", self.mine.tobytes())

    def _test(self) -> bool:
        if not self.all_set:
            if not self._store_call(self.store.check, self.keys):
                return False
            self.all_set = self.sequence >= 2  # both slots exist from the second collective on
        for peer, value in zip(self.peers, self._store_call(self.store.multi_get, self.keys)):
            header = np.frombuffer(value, np.int64)
            if header[1] == self.sequence:
                self.received[peer] = header
                self.arrived.add(peer)
        return len(self.arrived) == len(self.peers)

    def _missing(self) -> list[int]:
        return [peer for peer in self.peers if peer not in self.arrived]

    def _send_exit(self, notice: np.ndarray) -> None:
        self.store.set(f"h{int(notice[1]) % 2}/{self.rank}", notice.tobytes())

    def _store_call(self, call, *args):
        try:
            return call(*args)
        except Exception as exc:  # the server went away: the launcher (or rank 0 serving it) has ended
            self.fail(CollectiveError(
                f"rank {self.rank}: lost torchrun's store at {self.world.address} in collective #{self.sequence} "
                f"({type(exc).__name__}: {exc}): the launcher, or the rank serving the store, has ended"))


class TorchrunWorld(World):
    """The ranks of a ``torchrun`` job (or any launcher that sets the ``env://`` variables).

    Args:
        timeout: seconds to reach the store, and that ``allgather_object`` waits for the others
            (``ORT_TRAINER_COLLECTIVE_TIMEOUT``'s value).

    Raises:
        ValueError: when the ``env://`` variables are missing or malformed.
        CollectiveError: when the store at ``MASTER_ADDR:MASTER_PORT`` cannot be reached in time.
    """

    launcher = "torchrun"
    job = "torchrun job"

    def __init__(self, timeout: float):
        problem = environment_problem()
        if problem:
            raise ValueError(f"torchrun's variables: {problem}; launch with `torchrun --nproc_per_node N script.py`")
        env = os.environ
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0") or 0)
        local_size = int(env.get("LOCAL_WORLD_SIZE", "0") or 0) or size
        super().__init__(rank, size, local_rank, local_size)
        self.address = f"{env['MASTER_ADDR'].strip()}:{env['MASTER_PORT'].strip()}"
        try:
            store, _, _ = next(torch.distributed.rendezvous("env://", timeout=timedelta(seconds=timeout)))
        except Exception as exc:
            raise CollectiveError(f"rank {rank}: could not reach torchrun's store at {self.address} within "
                                  f"{timeout:g} s ({type(exc).__name__}: {exc})") from exc
        # a restarted worker group (torchrun --max-restarts) must not read the last attempt's keys
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.timeout = timeout
        self.store = torch.distributed.PrefixStore(f"ort_trainer/{attempt}/", store)
        self._last_object_key: str | None = None

    def launch_command(self, size: int) -> str:
        """``torchrun --nproc_per_node SIZE``."""
        return f"torchrun --nproc_per_node {size}"

    def _make_headers(self) -> HeaderExchange:
        return _StoreHeaders(self)

    def allgather_object(self, value: Any) -> list:
        """Every rank's ``value``, in rank order: each sets a pickle under the current collective's
        number and reads the others' (they are there or on their way: the header exchange came first).

        The previous call's key is deleted first: every rank has read it, since this collective's
        header exchange completed.
        """
        store, sequence = self.store, self.headers.sequence
        if self._last_object_key is not None:
            store.delete_key(self._last_object_key)
        self._last_object_key = f"o{sequence}/{self.rank}"
        store.set(self._last_object_key, pickle.dumps(value))
        keys = [f"o{sequence}/{r}" for r in range(self.size)]
        store.wait(keys, timedelta(seconds=self.timeout))
        return [pickle.loads(v) for v in store.multi_get(keys)]

    def make_store(self, timeout: float):
        """The launcher's store, under a prefix of its own for ``init_process_group``."""
        return torch.distributed.PrefixStore("process_group/", self.store)

    def abort(self, status: int) -> None:
        """Exit this rank now with ``status``; ``torchrun`` then ends the others."""
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(status)


__all__ = ["REQUIRED", "TorchrunWorld", "environment_problem"]
