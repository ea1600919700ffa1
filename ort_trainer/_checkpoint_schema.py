"""What a checkpoint file may hold (``_SCHEMA``), and the checks every dataset and attribute gets
before anything is read from it (``checkpoint.open_checkpoint``): a file that is not one ort_trainer
wrote is refused with every problem named, never parsed further."""

from __future__ import annotations

import math

import numpy as np

from ._user_dict import NUMERIC_KINDS


_USERBLOCK = 512

_USER = "user_dict"

_ANY = object()


def _check_dataset(h5py, dataset, name: str, raw_size: int) -> tuple[str | None, tuple | None]:
    """``(problem, (shape, dtype, offset))``: whether a dataset is plain numeric data inside the file."""
    h5d = h5py.h5d
    plist = dataset.id.get_create_plist()
    layout = plist.get_layout()
    if layout == getattr(h5d, "VIRTUAL", -1):
        return f"dataset {name!r} is a virtual dataset (it maps data from other files)", None
    if plist.get_external_count() > 0:
        target = plist.get_external(0)[0]
        return f"dataset {name!r} keeps its data in the external file {target.decode(errors='replace')!r}", None
    if layout != h5d.CONTIGUOUS or plist.get_nfilters() > 0:
        kind = {h5d.CHUNKED: "chunked or compressed", h5d.COMPACT: "compact"}.get(layout, "non-contiguous")
        return f"dataset {name!r} uses {kind} storage, which ort_trainer never writes", None
    shape, dtype = dataset.shape, dataset.dtype
    if shape is None:
        return f"dataset {name!r} has no dataspace", None
    if dtype.kind not in NUMERIC_KINDS or dtype.fields is not None:
        return f"dataset {name!r} has dtype {dtype}, not a numeric array", None
    try:
        standard = dataset.id.get_type() == h5py.h5t.py_create(dtype)
    except Exception:
        standard = False
    if not standard:
        return f"dataset {name!r} has a non-standard HDF5 type for {dtype}", None
    nbytes = math.prod(shape) * dtype.itemsize
    stored = dataset.id.get_storage_size()
    if stored != nbytes:
        return (f"dataset {name!r} declares shape {list(shape)} of {dtype} ({nbytes} bytes) but stores "
                f"{stored} bytes in the file"), None
    offset = dataset.id.get_offset() if nbytes else None
    if nbytes and (offset is None or offset < _USERBLOCK or offset + nbytes > raw_size):
        return f"dataset {name!r}: its data lies outside the file", None
    return None, (tuple(int(d) for d in shape), np.dtype(dtype), offset)


def _walk(h5py, group, schema: dict, prefix: str, raw_size: int, found: dict, problems: list[str]) -> None:
    """Collect the datasets of ``group`` that ``schema`` allows, refusing links and unknown objects.

    ``schema`` maps a name (or ``_ANY``) to a sub-schema (a group) or to None (a dataset).
    """
    for name in group:
        path = f"{prefix}/{name}"
        link = group.get(name, getlink=True)
        if isinstance(link, h5py.SoftLink):
            problems.append(f"{path!r} is a soft link to {link.path!r}; a checkpoint holds only its own datasets")
            continue
        if isinstance(link, h5py.ExternalLink):
            problems.append(f"{path!r} is an external link to {link.filename!r}:{link.path!r}; a checkpoint holds "
                            "only its own datasets")
            continue
        if not isinstance(link, h5py.HardLink):
            problems.append(f"{path!r} is a {type(link).__name__}, not an object stored in the file")
            continue
        if name in schema:
            spec = schema[name]
        elif _ANY in schema:
            spec = schema[_ANY]
        else:
            problems.append(f"unexpected object {path!r}")
            continue
        item = group[name]
        if spec is None:
            if not isinstance(item, h5py.Dataset):
                problems.append(f"{path!r} should be a dataset, found a {type(item).__name__}")
                continue
            problem, info = _check_dataset(h5py, item, path, raw_size)
            if problem:
                problems.append(problem)
            else:
                found[path] = info
        elif not isinstance(item, h5py.Group):
            problems.append(f"{path!r} should be a group, found a {type(item).__name__}")
        else:
            _walk(h5py, item, spec, path, raw_size, found, problems)


_SCHEMA = {
    "model": {"full_precision": {_ANY: None}},
    "optimizer": {_ANY: {_ANY: None}},
    "accumulated_gradients": {_ANY: None},
    _USER: {"value": None, "pickle": None, "arrays": {_ANY: None}},
}


def _string_attribute(h5py, handle, key: str) -> tuple[str | None, str | None]:
    """``(value, problem)`` of a root attribute that must be one string (checked before it is read)."""
    attr = h5py.h5a.open(handle.id, key.encode())
    if attr.get_space().get_simple_extent_type() != h5py.h5s.SCALAR or attr.get_type().get_class() != h5py.h5t.STRING:
        return None, f"attribute {key!r} is not a string"
    value = handle.attrs[key]
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="strict")
    return str(value), None


__all__ = []
