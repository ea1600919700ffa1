"""Crafting checkpoint files the way an attacker or a damaged disk would: edit, then re-sign.

The checksum of a checkpoint only detects damage (whoever writes a file writes its checksum), so
these helpers re-sign every edited file: the loader's other defences are what is tested.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import h5py

DIGEST_BYTES = 64


def resign(path: Path) -> None:
    """Write a valid SHA-256 header for the file as it is now."""
    data = bytearray(path.read_bytes())
    data[:DIGEST_BYTES] = hashlib.sha256(bytes(data[DIGEST_BYTES:])).hexdigest().encode()
    path.write_bytes(bytes(data))


def edit(source: Path, target: Path, change: Callable[[h5py.File], None]) -> Path:
    """Copy ``source`` to ``target``, apply ``change`` to it through h5py, and re-sign it."""
    target.write_bytes(source.read_bytes())
    with h5py.File(target, "r+") as handle:
        change(handle)
    resign(target)
    return target


def set_json(handle: h5py.File, key: str, update: Callable[[object], object]) -> None:
    """Replace the JSON attribute ``key`` by ``update(its value)``."""
    handle.attrs[key] = json.dumps(update(json.loads(handle.attrs[key])))
