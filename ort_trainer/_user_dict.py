"""A checkpoint's user dict as plain data: JSON text plus numpy arrays, never code.

Arrays are replaced in the JSON by ``{"__ndarray__": i}`` (``{"__numpy_scalar__": i}`` for numpy
scalars), ``i`` indexing the arrays stored next to it; those two keys are reserved.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np

ARRAY_TAG = "__ndarray__"
SCALAR_TAG = "__numpy_scalar__"
NUMERIC_KINDS = "biufc"


def encode_user_dict(value: Any, allow_pickle: bool = False) -> tuple[str, list[np.ndarray], bytes | None]:
    """Encode a user dict as plain data: JSON text plus numpy arrays (and a pickle when opted in).

    Plain data is dict (str keys), list, tuple, str, int, float, bool, None, numpy arrays and
    numpy scalars of numeric or bool dtype. Tuples come back as lists, dict/int/float/str
    subclasses as the base type (as JSON gives them); numpy values come back as numpy values.

    Args:
        value: the user dict (any plain data, or anything picklable with ``allow_pickle``).
        allow_pickle: pickle ``value`` when it is not plain data, instead of refusing it.

    Returns:
        ``(json_text, arrays, pickled)``: ``pickled`` is None unless ``value`` had to be pickled
        (then ``json_text`` is ``"null"`` and ``arrays`` is empty).

    Raises:
        TypeError: ``value`` is not plain data and ``allow_pickle`` is False; names every offending path.
    """
    arrays: list[np.ndarray] = []
    problems: list[str] = []
    active: set[int] = set()

    def encode(item: Any, where: str) -> Any:
        if item is None or isinstance(item, bool):
            return item
        if isinstance(item, np.generic) or isinstance(item, np.ndarray):
            array = np.asarray(item)
            if array.dtype.kind not in NUMERIC_KINDS:
                problems.append(f"{where}: numpy dtype {array.dtype} (only numeric and bool arrays are plain data)")
                return None
            arrays.append(array if array.flags.c_contiguous else np.ascontiguousarray(array))
            return {(SCALAR_TAG if isinstance(item, np.generic) else ARRAY_TAG): len(arrays) - 1}
        if isinstance(item, int):
            return int(item)
        if isinstance(item, float):
            return float(item)
        if isinstance(item, str):
            return str(item)
        if isinstance(item, (list, tuple, dict)):
            if id(item) in active:
                problems.append(f"{where}: contains itself")
                return None
            active.add(id(item))
            try:
                if isinstance(item, dict):
                    out = {}
                    for key, child in item.items():
                        if not isinstance(key, str):
                            problems.append(f"{where}: key {key!r} is a {type(key).__name__}, not a str")
                        elif key in (ARRAY_TAG, SCALAR_TAG):
                            problems.append(f"{where}: key {key!r} is reserved by the checkpoint format")
                        else:
                            out[str(key)] = encode(child, f"{where}[{key!r}]")
                    return out
                return [encode(child, f"{where}[{i}]") for i, child in enumerate(item)]
            finally:
                active.discard(id(item))
        problems.append(f"{where}: a {type(item).__module__}.{type(item).__qualname__} is not plain data")
        return None

    encoded = encode(value, "user_dict")
    if problems:
        if allow_pickle:
            return "null", [], pickle.dumps(value)
        raise TypeError(
            "save_checkpoint: user_dict must be plain data (dict with str keys, list, str, int, float, bool, "
            "None, numpy arrays) so that loading it never runs code; these values are not:\n  "
            + "\n  ".join(problems)
            + "\nConvert them (e.g. tensor.numpy(), dict(...)), or pass allow_pickle=True to save_checkpoint to "
            "pickle the user dict (loading it then needs load_checkpoint(..., allow_pickle=True), which runs "
            "code from the file: only for files you trust)"
        )
    return json.dumps(encoded), arrays, None


def decode_user_dict(value: Any, arrays: dict[int, np.ndarray]) -> Any:
    """The user dict from its decoded JSON, with each array reference replaced by ``arrays[i]``."""
    if isinstance(value, list):
        return [decode_user_dict(v, arrays) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and (ARRAY_TAG in value or SCALAR_TAG in value):
            (tag, index), = value.items()
            return arrays[index][()] if tag == SCALAR_TAG else arrays[index]
        return {k: decode_user_dict(v, arrays) for k, v in value.items()}
    return value


def array_references(value: Any, out: list) -> list:
    """Every ``(tag, index)`` array reference in a decoded JSON user dict."""
    if isinstance(value, list):
        for item in value:
            array_references(item, out)
    elif isinstance(value, dict):
        if len(value) == 1 and (ARRAY_TAG in value or SCALAR_TAG in value):
            out.append(next(iter(value.items())))
        else:
            for item in value.values():
                array_references(item, out)
    return out
