"""Checkpoint files: one HDF5 file per checkpoint, written atomically, verified before use.

Layout of format version 2 (every array a dataset, everything else JSON)::

    /model/full_precision/<weight>            weights and buffers
    /optimizer/<weight>/<state>               Moment_1, Moment_2, Update_Count
    /optimizer/shared_optimizer_state/Step    Lamb
    /accumulated_gradients/<weight>           only when saved inside an accumulation window
    /user_dict/value                          the user dict as UTF-8 JSON (uint8), arrays as references
    /user_dict/arrays/<i>                     the user dict's numpy arrays and scalars
    /user_dict/pickle                         pickled user dict (uint8), only when saved with allow_pickle=True
    attrs: format, version, train_step_info, trainer_options, lr_scheduler, loss_scaler (JSON)

Version 1 stored the user dict pickled in the ``user_dict`` attribute; it is read but never
unpickled unless the caller passes ``allow_pickle=True``.

The file starts with a 512-byte HDF5 user block (HDF5 ignores it) whose first 64 bytes hold the
hex SHA-256 of every byte after them. Whoever writes a file can also write its checksum, so the
checksum only detects damage; safety comes from what reading does and never does:

- it never unpickles, unless the caller opts in;
- it reads only datasets stored inside the file: external storage, virtual datasets, soft and
  external links are refused by name, before anything is read;
- every dataset must be contiguous, uncompressed, numeric and fully stored in the file, so the
  memory a load allocates is bounded by the file's size; the trainer checks each dataset's name,
  shape and dtype against its own (``CheckpointFile.arrays``) before any data is read.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from ._checkpoint_schema import _SCHEMA, _USER, _USERBLOCK, _string_attribute, _walk
from ._logging import logger
from ._interrupt import stop_if_interrupted
from ._temporaries import atomic_write
from ._user_dict import SCALAR_TAG, array_references, decode_user_dict, encode_user_dict

FORMAT = "ort_trainer.checkpoint"
VERSION = 2
_DIGEST_BYTES = 64
_JSON_ATTRS = ("train_step_info", "trainer_options", "lr_scheduler", "loss_scaler")
_ARRAY_GROUPS = ("model", "optimizer", "accumulated_gradients")
# pickle.dumps(None) under every protocol: a version-1 file holding only these has no user dict
_PICKLED_NONE = {pickle.dumps(None, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)}


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint cannot be read, is unsafe, or does not fit the trainer; nothing was changed."""


def _h5py():
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a dependency
        raise ImportError("checkpoints need h5py: pip install h5py") from exc
    return h5py


# ---- writing ------------------------------------------------------------------------------------
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


def write(path: str | os.PathLike, content: dict[str, Any], allow_pickle: bool = False) -> None:
    """Write ``content`` to a new checkpoint file at ``path``.

    Stale temporaries of interrupted saves in the same directory are removed first
    (``remove_stale_temporaries``).

    Args:
        path: the new file; never overwritten.
        content: ``model``, ``optimizer``, ``accumulated_gradients`` (nested dicts of arrays),
            ``train_step_info``, ``trainer_options``, ``lr_scheduler``, ``loss_scaler`` (JSON-able)
            and ``user_dict`` (plain data, see ``encode_user_dict``).
        allow_pickle: pickle a ``user_dict`` that is not plain data instead of refusing it.

    Raises:
        FileExistsError: ``path`` exists (it is never overwritten).
        FileNotFoundError: the directory of ``path`` does not exist.
        TypeError: ``user_dict`` is not plain data and ``allow_pickle`` is False.
    """
    h5py = _h5py()
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"save_checkpoint: {str(path)!r} already exists; choose a new path or delete it first")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"save_checkpoint: directory {str(path.parent)!r} does not exist")
    user_json, user_arrays, pickled = encode_user_dict(content.get("user_dict"), allow_pickle)
    arrays = {}
    for group in _ARRAY_GROUPS:
        if content.get(group):
            arrays.update(_flatten(content[group], f"/{group}"))
    arrays[f"/{_USER}/value"] = np.frombuffer(user_json.encode(), np.uint8)
    arrays.update({f"/{_USER}/arrays/{i}": a for i, a in enumerate(user_arrays)})
    if pickled is not None:
        arrays[f"/{_USER}/pickle"] = np.frombuffer(pickled, np.uint8)
    attrs = {key: json.dumps(content.get(key)) for key in _JSON_ATTRS}
    attrs["format"] = FORMAT
    attrs["version"] = str(VERSION)
    def write_file(temporary: str) -> None:
        with h5py.File(temporary, "w", userblock_size=_USERBLOCK) as handle:
            for name, array in arrays.items():
                stop_if_interrupted()  # Ctrl-C: stop here, and no file is written
                handle.create_dataset(name, data=array)
            for key, value in attrs.items():
                handle.attrs[key] = value
        with open(temporary, "r+b") as written:
            digest = _digest(written)
            written.seek(0)
            written.write(digest)

    try:
        atomic_write(path, write_file, replace=False, what="save_checkpoint")
    except FileExistsError:
        raise FileExistsError(f"save_checkpoint: {str(path)!r} already exists; choose a new path") from None


# ---- reading ------------------------------------------------------------------------------------
class StoredArray:
    """A dataset of a verified checkpoint: its name, shape and dtype, with the data not yet read.

    Attributes:
        name: the dataset's path in the file (``/model/full_precision/fc1.weight``).
        shape: its shape.
        dtype: its numpy dtype.
    """

    __slots__ = ("_file", "name", "shape", "dtype", "_offset")

    def __init__(self, file: "CheckpointFile", name: str, shape: tuple[int, ...], dtype: np.dtype, offset: int | None):
        self._file, self.name, self.shape, self.dtype, self._offset = file, name, shape, dtype, offset

    def read(self) -> np.ndarray:
        """The data, as a new native-byte-order array (its bytes were checked to lie inside the file).

        Raises:
            CheckpointError: the file is shorter than when it was opened.
        """
        data = np.empty(self.shape, self.dtype)
        self._read_elements(0, data)
        return data.astype(self.dtype.newbyteorder("="), copy=False)

    def read_into(self, out: np.ndarray, start: int = 0, stop: int | None = None) -> None:
        """Write the flat elements ``[start, stop)`` into ``out`` (writable, C-contiguous, that many
        elements), straight from the file when ``out`` has this array's dtype: no copy of it in
        memory (a 656 M-weight model's largest array is 257 MB). Another dtype reads, then converts.

        Raises:
            ValueError: ``out`` is not writable and contiguous, or its size is not ``stop - start``.
            CheckpointError: the file is shorter than when it was opened.
        """
        size = int(np.prod(self.shape))
        stop = size if stop is None else stop
        if not (0 <= start <= stop <= size):
            raise ValueError(f"read_into: [{start}, {stop}) is not inside {self.name}'s {size} elements")
        if out.size != stop - start or not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError(f"read_into: {self.name}[{start}:{stop}] needs a writable contiguous array of "
                             f"{stop - start} elements, not {out.shape} ({out.flags.c_contiguous=})")
        if out.dtype != self.dtype or not self.dtype.isnative:
            out.reshape(-1)[...] = self.read().reshape(-1)[start:stop]
            return
        self._read_elements(start, out)

    def _read_elements(self, start: int, out: np.ndarray) -> None:
        """The stored bytes from flat element ``start`` on into ``out`` (contiguous, of the stored dtype).

        Raises:
            CheckpointError: the file is shorter than when it was opened.
        """
        if out.size:
            handle = self._file._handle
            handle.seek(self._offset + start * self.dtype.itemsize)
            if handle.readinto(memoryview(out.reshape(-1)).cast("B")) != out.nbytes:
                raise CheckpointError(f"load_checkpoint: {str(self._file.path)!r} was truncated while it was read")

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """``np.asarray(stored)`` reads it: whoever needs the values reads them one array at a time."""
        data = self.read()
        return data if dtype is None else data.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"StoredArray({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


class CheckpointFile:
    """A checkpoint whose checksum, structure and metadata were verified; array data not read yet.

    Attributes:
        path: the file.
        version: its format version.
        arrays: ``{"model": {...}, "optimizer": {...}, "accumulated_gradients": {...}}`` with
            ``StoredArray`` leaves: check their names, shapes and dtypes, then ``read`` them.
        metadata: the JSON entries ``train_step_info``, ``trainer_options``, ``lr_scheduler``,
            ``loss_scaler`` (parsed, not yet validated: the trainer validates them).
    """

    def __init__(self, path: Path, handle: io.BufferedReader, version: int):
        self.path = path
        self._handle = handle  # the file verified, open: arrays are read from it one at a time
        self.version = version
        self.arrays: dict[str, dict] = {group: {} for group in _ARRAY_GROUPS}
        self.metadata: dict[str, Any] = {}
        self._user_json: Any = None
        self._user_arrays: dict[int, StoredArray] = {}
        self._user_pickle: bytes | None = None

    def user_dict(self, allow_pickle: bool = False) -> Any:
        """The user dict (reads its arrays).

        A pickled user dict is unpickled only with ``allow_pickle=True``; otherwise a warning says
        so and None is returned (the rest of the checkpoint is unaffected).

        Args:
            allow_pickle: unpickle a pickled user dict. Unpickling runs code chosen by whoever wrote
                the file: only for files you trust.

        Raises:
            CheckpointError: unpickling failed.
        """
        if self._user_pickle is not None:
            if self._user_pickle in _PICKLED_NONE:
                return None
            if not allow_pickle:
                logger.warning(
                    "load_checkpoint: %r stores its user_dict pickled (%s); it was NOT unpickled, since unpickling "
                    "runs code from the file, and None is returned in its place. The weights and training state "
                    "were loaded. If you trust the file, load it again with load_checkpoint(..., allow_pickle=True)",
                    str(self.path), "format version 1" if self.version == 1 else "saved with allow_pickle=True")
                return None
            try:
                return pickle.loads(self._user_pickle)
            except Exception as exc:
                raise CheckpointError(f"load_checkpoint: {str(self.path)!r}: the pickled user_dict cannot be "
                                      f"unpickled: {type(exc).__name__}: {exc}") from exc
        arrays = {i: a.read() for i, a in self._user_arrays.items()}
        try:
            return decode_user_dict(self._user_json, arrays)
        except RecursionError:
            raise CheckpointError(f"load_checkpoint: {str(self.path)!r}: the user_dict is nested too deeply") from None


def _digest(handle: io.BufferedIOBase) -> bytes:
    """The hex SHA-256 of a file's bytes after the digest's own place, read in 16 MB chunks: a
    656 M-weight model's checkpoint (7.9 GB) is never held whole."""
    digest = hashlib.sha256()
    handle.seek(_DIGEST_BYTES)
    for chunk in iter(lambda: handle.read(1 << 24), b""):
        digest.update(chunk)
    return digest.hexdigest().encode()


def open_checkpoint(path: str | os.PathLike) -> CheckpointFile:
    """Verify a checkpoint and list its contents without reading any array data.

    Checks the checksum, the format and version, and that every object is where the format puts
    it: plain numeric datasets stored contiguously inside the file (no external storage, virtual
    datasets, links or compression), whose data together fit in the file.

    Args:
        path: the checkpoint file.

    Returns:
        A ``CheckpointFile``: check ``arrays`` against what you expect, then ``StoredArray.read``.

    Raises:
        CheckpointError: missing, truncated, corrupted, not a checkpoint, from a newer version, or
            holding anything the format does not allow (every such object named).
    """
    h5py = _h5py()
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"load_checkpoint: {str(path)!r} is a directory; give the checkpoint file in it")
    if not path.is_file():
        raise CheckpointError(f"load_checkpoint: {str(path)!r} does not exist")
    file = open(path, "rb")  # kept open by the CheckpointFile: its arrays are read from it
    try:
        return _verified(path, file, h5py)
    except BaseException:
        file.close()
        raise


def _verified(path: Path, file: io.BufferedReader, h5py) -> CheckpointFile:
    """``open_checkpoint`` of the open ``file``."""
    size = os.fstat(file.fileno()).st_size
    if size <= _USERBLOCK or file.read(_DIGEST_BYTES) != _digest(file):
        raise CheckpointError(
            f"load_checkpoint: {str(path)!r} is corrupted or truncated: its checksum does not match its "
            "contents (or it is not an ort_trainer checkpoint)"
        )
    problems: list[str] = []
    found: dict[str, tuple] = {}
    attrs: dict[str, str] = {}
    try:
        with h5py.File(file, "r") as handle:
            for key in handle.attrs:
                if key not in (*_JSON_ATTRS, "format", "version", _USER):
                    problems.append(f"unexpected attribute {key!r}")
                    continue
                value, problem = _string_attribute(h5py, handle, key)
                if problem:
                    problems.append(problem)
                else:
                    attrs[key] = value
            if attrs.get("format") != FORMAT:
                raise CheckpointError(f"load_checkpoint: {str(path)!r} is not an ort_trainer checkpoint")
            _walk(h5py, handle, _SCHEMA, "", size, found, problems)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"load_checkpoint: {str(path)!r} is not a readable checkpoint (truncated or corrupted?): {exc}"
        ) from exc
    try:
        version = int(attrs.get("version", ""))
    except ValueError:
        raise CheckpointError(f"load_checkpoint: {str(path)!r} has no valid format version") from None
    if version > VERSION or version < 1:
        raise CheckpointError(f"load_checkpoint: {str(path)!r} has format version {version}; this ort_trainer "
                              f"reads versions 1 to {VERSION}" + ("; upgrade ort_trainer" if version > VERSION else ""))
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in found.values())
    if total > size:
        problems.append(f"its datasets declare {total} bytes of data, more than the file's {size} bytes")
    result = CheckpointFile(path, file, version)
    for key in _JSON_ATTRS:
        if key not in attrs:
            problems.append(f"attribute {key!r} is missing")
            continue
        try:
            result.metadata[key] = json.loads(attrs[key])
        except (ValueError, RecursionError) as exc:
            problems.append(f"attribute {key!r} is not valid JSON: {exc}")
    stored = {name: StoredArray(result, name, *info) for name, info in found.items()}
    _read_user_dict(result, stored, attrs, problems)
    for name, array in stored.items():
        group, *rest = name.strip("/").split("/")
        if group in _ARRAY_GROUPS:
            node = result.arrays[group]
            for part in rest[:-1]:
                node = node.setdefault(part, {})
            node[rest[-1]] = array
    if problems:
        raise CheckpointError(f"load_checkpoint: {str(path)!r} is not a valid ort_trainer checkpoint; nothing was "
                              "loaded:\n  " + "\n  ".join(problems))
    return result


def _read_user_dict(result: CheckpointFile, stored: dict[str, StoredArray], attrs: dict[str, str],
                    problems: list[str]) -> None:
    """Parse the user dict's JSON and pickle (both small: their bytes are in the file) and match its arrays."""
    prefix = f"/{_USER}/"
    user = {name[len(prefix):]: array for name, array in stored.items() if name.startswith(prefix)}
    if result.version == 1:
        if user:
            problems.append(f"a version-1 checkpoint has no {prefix!r} group, but this one holds {sorted(user)}")
        if _USER not in attrs:
            problems.append(f"attribute {_USER!r} is missing")
            return
        try:
            result._user_pickle = bytes.fromhex(attrs[_USER])
        except ValueError:
            problems.append(f"attribute {_USER!r} is not hex-encoded")
        return
    if _USER in attrs:
        problems.append(f"unexpected attribute {_USER!r} (format version {result.version} stores it under {prefix})")
    value = user.pop("value", None)
    if value is None or value.dtype != np.uint8 or len(value.shape) != 1:
        problems.append(f"dataset '{prefix}value' (the user dict as UTF-8 JSON, uint8) is missing or malformed")
        return
    try:
        result._user_json = json.loads(value.read().tobytes().decode("utf-8"))
        references = array_references(result._user_json, [])
    except (ValueError, RecursionError) as exc:
        problems.append(f"dataset '{prefix}value' is not valid UTF-8 JSON: {exc}")
        return
    pickled = user.pop("pickle", None)
    if pickled is not None:
        if pickled.dtype != np.uint8 or len(pickled.shape) != 1:
            problems.append(f"dataset '{prefix}pickle' must be 1-D uint8")
        else:
            result._user_pickle = pickled.read().tobytes()
    arrays = {name[len("arrays/"):]: array for name, array in user.items()}
    referenced = set()
    for tag, index in references:
        array = arrays.get(str(index)) if isinstance(index, int) and not isinstance(index, bool) else None
        referenced.add(str(index))
        if array is None:
            problems.append(f"the user dict refers to array {index!r}, which '{prefix}arrays' does not hold")
        elif tag == SCALAR_TAG and array.shape != ():
            problems.append(f"dataset '{prefix}arrays/{index}' holds a numpy scalar but has shape {list(array.shape)}")
        else:
            result._user_arrays[index] = array
    unused = sorted(set(arrays) - referenced)
    if unused:
        problems.append(f"unexpected datasets {[prefix + 'arrays/' + n for n in unused]} (not referenced by the user dict)")


def read(path: str | os.PathLike, allow_pickle: bool = False) -> dict[str, Any]:
    """Read and verify a whole checkpoint; returns the ``content`` dict ``write`` was given.

    Every array is read (bounded by the file's size); use ``open_checkpoint`` to check names and
    shapes against a trainer first.

    Args:
        path: the checkpoint file.
        allow_pickle: unpickle a pickled user dict (runs code from the file: only for files you
            trust); without it a pickled user dict comes back as None, with a warning.

    Raises:
        CheckpointError: see ``open_checkpoint``.
    """
    file = open_checkpoint(path)
    content: dict[str, Any] = {group: _read_tree(tree) for group, tree in file.arrays.items()}
    content.update(file.metadata)
    content["user_dict"] = file.user_dict(allow_pickle)
    return content


def _read_tree(tree: dict) -> dict:
    return {k: _read_tree(v) if isinstance(v, dict) else v.read() for k, v in tree.items()}

