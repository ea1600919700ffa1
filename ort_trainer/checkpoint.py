"""Checkpoint files: one HDF5 file per checkpoint, written atomically, verified on load.

Layout (every array a dataset, everything else JSON in attributes)::

    /model/full_precision/<weight>            weights and buffers
    /optimizer/<weight>/<state>               Moment_1, Moment_2, Update_Count
    /optimizer/shared_optimizer_state/Step    Lamb
    /accumulated_gradients/<weight>           only when saved inside an accumulation window
    attrs: format, version, train_step_info, trainer_options, lr_scheduler, loss_scaler,
           user_dict (pickled, hex)

The file starts with a 512-byte HDF5 user block (HDF5 ignores it) whose first 64 bytes hold the
hex SHA-256 of every byte after them. ``read`` checks it before parsing, so a flipped byte
anywhere in the file, or a truncated file, raises ``CheckpointError`` before anything is returned.

The user dict is stored with ``pickle`` (like ``torch.save``): load checkpoints you trust only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "ort_trainer.checkpoint"
VERSION = 1
_USERBLOCK = 512
_DIGEST_BYTES = 64
_JSON_ATTRS = ("train_step_info", "trainer_options", "lr_scheduler", "loss_scaler")
_ARRAY_GROUPS = ("model", "optimizer", "accumulated_gradients")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit the trainer; nothing was changed."""


def _h5py():
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a dependency
        raise ImportError("checkpoints need h5py: pip install h5py") from exc
    return h5py


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        if "/" in key:
            raise ValueError(f"checkpoint key {key!r} contains '/'")
        path = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, path))
        else:
            out[path] = np.asarray(value)
    return out


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.strip("/").split("/")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def write(path: str | os.PathLike, content: dict[str, Any]) -> None:
    """Write ``content`` to a new checkpoint file at ``path``.

    ``content`` keys: ``model``, ``optimizer``, ``accumulated_gradients`` (nested dicts of arrays),
    ``train_step_info``, ``trainer_options``, ``lr_scheduler``, ``loss_scaler`` (JSON-able) and
    ``user_dict`` (any picklable object).

    Raises:
        FileExistsError: ``path`` exists (it is never overwritten).
        FileNotFoundError: the directory of ``path`` does not exist.
    """
    h5py = _h5py()
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"save_checkpoint: {str(path)!r} already exists; choose a new path or delete it first")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"save_checkpoint: directory {str(path.parent)!r} does not exist")
    arrays = {}
    for group in _ARRAY_GROUPS:
        if content.get(group):
            arrays.update(_flatten(content[group], f"/{group}"))
    attrs = {key: json.dumps(content.get(key)) for key in _JSON_ATTRS}
    attrs["user_dict"] = pickle.dumps(content.get("user_dict")).hex()
    attrs["format"] = FORMAT
    attrs["version"] = str(VERSION)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with h5py.File(tmp, "w", userblock_size=_USERBLOCK) as handle:
            for name, array in arrays.items():
                handle.create_dataset(name, data=array)
            for key, value in attrs.items():
                handle.attrs[key] = value
        with open(tmp, "r+b") as written:
            digest = hashlib.sha256(written.read()[_DIGEST_BYTES:]).hexdigest().encode()
            written.seek(0)
            written.write(digest)
            written.flush()
            os.fsync(written.fileno())
        # link (not rename): fails instead of replacing a file that appeared meanwhile
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"save_checkpoint: {str(path)!r} already exists; choose a new path") from None
    finally:
        os.unlink(tmp)


def read(path: str | os.PathLike) -> dict[str, Any]:
    """Read and verify a checkpoint written by ``write``; returns the same ``content`` dict.

    Raises:
        CheckpointError: missing, truncated, corrupted (checksum mismatch) or not a checkpoint.
    """
    h5py = _h5py()
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"load_checkpoint: {str(path)!r} does not exist")
    raw = path.read_bytes()
    if len(raw) <= _USERBLOCK or raw[:_DIGEST_BYTES] != hashlib.sha256(raw[_DIGEST_BYTES:]).hexdigest().encode():
        raise CheckpointError(
            f"load_checkpoint: {str(path)!r} is corrupted or truncated: its checksum does not match its "
            "contents (or it is not an ort_trainer checkpoint)"
        )
    try:
        with h5py.File(io.BytesIO(raw), "r") as handle:
            attrs = {key: str(value) for key, value in handle.attrs.items()}
            arrays: dict[str, np.ndarray] = {}

            def visit(name, item):
                if isinstance(item, h5py.Dataset):
                    arrays["/" + name] = item[()]

            handle.visititems(visit)
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"load_checkpoint: {str(path)!r} is not a readable checkpoint (truncated or corrupted?): {exc}"
        ) from exc
    if attrs.get("format") != FORMAT:
        raise CheckpointError(f"load_checkpoint: {str(path)!r} is not an ort_trainer checkpoint")
    if int(attrs["version"]) > VERSION:
        raise CheckpointError(f"load_checkpoint: {str(path)!r} has format version {attrs['version']}, "
                              f"newer than this ort_trainer reads ({VERSION}); upgrade ort_trainer")
    tree = _unflatten(arrays)
    content: dict[str, Any] = {group: tree.get(group, {}) for group in _ARRAY_GROUPS}
    for key in _JSON_ATTRS:
        content[key] = json.loads(attrs[key])
    content["user_dict"] = pickle.loads(bytes.fromhex(attrs["user_dict"]))
    return content
