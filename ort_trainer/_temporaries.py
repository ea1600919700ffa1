"""Temporaries of interrupted checkpoint saves: named after their writer, removed once it is gone.

A checkpoint is written to ``.<name>.<host>-<pid>.<random>.tmp`` next to its final path and then
linked into place; a crash or ``kill -9`` in between leaves the temporary behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
import time

from ._logging import logger

# A temporary older than this is stale whatever wrote it (a live writer keeps touching its file).
STALE_TEMPORARY_SECONDS = 3600.0
_USERBLOCK = 512
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def host_tag() -> str:
    """A short tag of this machine's name: a temporary's PID is only checked on its own host."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temporary_prefix(name: str) -> str:
    """The prefix of this process's temporary for the file ``name`` (``tempfile`` adds ``<random>.tmp``)."""
    return f".{name}.{host_tag()}-{os.getpid()}."


# .<name>.<host>-<pid>.<random>.tmp (this version) and .<name>.<random>.tmp (version 1)
_TEMPORARY = re.compile(r"^\..+\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)\.[a-z0-9_]{8}\.tmp$")
_LEGACY_TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID runs on this host (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _is_stale(entry: os.DirEntry, now: float, host: str) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    old = now - info.st_mtime > STALE_TEMPORARY_SECONDS
    match = _TEMPORARY.match(entry.name)
    if match:
        return old or (match["host"] == host and not pid_alive(int(match["pid"])))
    if not (old and _LEGACY_TEMPORARY.match(entry.name)):
        return False
    try:  # a version-1 checkpoint temporary is an HDF5 file behind our 512-byte user block
        with open(entry.path, "rb") as handle:
            handle.seek(_USERBLOCK)
            return handle.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE
    except OSError:
        return False


def remove_stale_temporaries(directory: str | os.PathLike) -> list[str]:
    """Delete checkpoint temporaries that interrupted saves (a crash, kill -9) left in ``directory``.

    Only this library's temporary names are touched, and only when their writer is gone: the PID
    recorded in the name is dead on this host, or the file has not changed for
    ``STALE_TEMPORARY_SECONDS``. Files being written by a live process are left alone.

    Args:
        directory: the checkpoint directory.

    Returns:
        The paths removed.
    """
    removed, freed = [], 0
    now, host = time.time(), host_tag()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.endswith(".tmp") or not _is_stale(entry, now, host):
            continue
        try:
            size = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
        except OSError:
            continue  # another process removed it first, or it is not ours to remove
        removed.append(entry.path)
        freed += size
    if removed:
        logger.info("removed %d stale checkpoint temporaries (%.1f MB) left by interrupted saves in %s",
                    len(removed), freed / 1e6, directory)
    return removed
