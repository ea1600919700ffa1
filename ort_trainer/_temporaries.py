"""Atomic file writes, and the temporaries interrupted writes leave: named after their writer,
removed once it is gone.

Every file the trainer writes (checkpoints, ``save_as_onnx``, the CLI's metrics, plot and samples,
debug graph dumps) goes through ``atomic_write``: it is written to
``.<name>.<host>-<pid>.<random>.tmp`` next to its final path and then moved (or, where an existing
file must never be replaced, linked) into place. A crash, ``kill -9`` or the OOM killer in between
leaves the temporary behind; the next write into the same directory removes it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

import onnx

from ._interrupt import interruptible_save, stop_if_interrupted
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


# .<name>.<host>-<pid>.<random>.tmp (this version) and .<name>.<random>.tmp (earlier versions:
# checkpoints, recognised by their HDF5 signature, and save_as_onnx's .<name>.onnx.<random>.tmp)
_TEMPORARY = re.compile(r"^\..+\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)\.[a-z0-9_]{8}\.tmp$")
_LEGACY_TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
_LEGACY_ONNX_TEMPORARY = re.compile(r"^\..+\.onnx\.[a-z0-9_]{8}\.tmp$")


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
    if _LEGACY_ONNX_TEMPORARY.match(entry.name):
        return True
    try:  # a version-1 checkpoint temporary is an HDF5 file behind our 512-byte user block
        with open(entry.path, "rb") as handle:
            handle.seek(_USERBLOCK)
            return handle.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE
    except OSError:
        return False


def remove_stale_temporaries(directory: str | os.PathLike) -> list[str]:
    """Delete temporaries that interrupted writes (a crash, kill -9, the OOM killer) left in ``directory``.

    Only this library's temporary names are touched, and only when their writer is gone: the PID
    recorded in the name is dead on this host, or the file has not changed for
    ``STALE_TEMPORARY_SECONDS``. Files being written by a live process are left alone.

    Args:
        directory: the directory about to be written to.

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
        logger.info("removed %d stale temporaries (%.1f MB) left by interrupted writes in %s",
                    len(removed), freed / 1e6, directory)
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], replace: bool = True,
                 what: str = "writing", stop_before_move: bool = True) -> None:
    """Write the file ``path`` whole or not at all.

    Stale temporaries of earlier interrupted writes in the directory are removed first; then
    ``write(temporary)`` writes a temporary named after this process next to ``path``, which is
    flushed to disk and moved into place. The temporary is removed whatever happens, so a
    failed write leaves nothing behind, and never touches a file already at ``path``.

    Ctrl-C during the write is held (``_interrupt.interruptible_save``): ``write`` stops at its
    next ``stop_if_interrupted``, or the temporary is dropped before it would move into place,
    and ``KeyboardInterrupt`` reaches the caller; one arriving after the move is raised once the
    file is whole.

    Args:
        path: the final file; its directory must exist.
        write: writes the whole file to the path it is given.
        replace: True replaces a file at ``path`` atomically; False never replaces one (the file
            is linked into place, and ``FileExistsError`` is raised if one appeared meanwhile).
        what: the operation, for error messages (``"save_checkpoint"``).
        stop_before_move: Ctrl-C during ``write`` drops the temporary; False moves it into place
            anyway (``write`` put another file in place that needs this one) and raises after.

    Raises:
        FileExistsError: ``replace`` is False and ``path`` exists.
        OSError: the write failed (a full disk...): the message names ``path`` and ``what``; the
            error number is the system's.
        KeyboardInterrupt: Ctrl-C arrived during the write.
    """
    path = Path(path)
    with interruptible_save():
        remove_stale_temporaries(path.parent)
        try:
            descriptor, temporary = tempfile.mkstemp(prefix=temporary_prefix(path.name), suffix=".tmp",
                                                     dir=path.parent)
        except OSError as exc:
            raise _explained(exc, path, what) from exc
        os.close(descriptor)
        try:
            write(temporary)
            if stop_before_move:
                stop_if_interrupted()  # the last moment at which nothing is in place yet
            with open(temporary, "rb+") as written:
                os.fsync(written.fileno())
            if replace:
                os.replace(temporary, path)
            else:
                os.link(temporary, path)  # link, not rename: fails instead of replacing a file that appeared
        except FileExistsError:
            raise
        except (OSError, RuntimeError) as exc:
            explained = _explained(exc, path, what)
            if explained is exc:
                raise
            raise explained from exc
        finally:
            try:
                os.unlink(temporary)
            except FileNotFoundError:
                pass


def _explained(exc: BaseException, path: Path, what: str) -> BaseException:
    """``exc`` as an ``OSError`` of the system's error number that names the path and the operation
    (the system names the temporary, if anything; h5py raises a ``RuntimeError`` with the number in
    its message); ``exc`` itself when it says so already, or is no system error."""
    if getattr(exc, "explained", False):
        return exc  # a nested write's (save_as_onnx's data file)
    code = getattr(exc, "errno", None)
    if code is None:
        found = re.search(r"errno = (\d+)", str(exc))
        if found is None:
            return exc
        code = int(found.group(1))
    reason = os.strerror(code) if code else str(exc)
    advice = ""
    if code in (errno.ENOSPC, errno.EDQUOT):
        advice = f": the file system of {str(path.parent)!r} is full: free space there or write elsewhere"
    elif code == errno.EFBIG:
        advice = ": the file is larger than the file system or the process's file size limit allows"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        advice = f": {str(path.parent)!r} is not writable"
    message = f"{what}: could not write {str(path)!r}: {reason}{advice}; nothing was written there"
    kind = type(exc) if isinstance(exc, OSError) else OSError
    try:
        error = kind(code, message) if code else kind(message)
    except TypeError:  # an OSError subclass with a constructor of its own
        error = OSError(code, message)
    error.explained = True
    return error


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """``onnx.save`` through ``atomic_write``: a graph file is there whole, or not changed at all."""
    atomic_write(path, lambda temporary: onnx.save(model, temporary), what="saving an ONNX graph")
