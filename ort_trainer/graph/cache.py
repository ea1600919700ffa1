"""The on-disk cache of training graphs.

An entry is a directory named by the SHA-256 of everything that determines the graphs: the
model's structure (module classes and their source, ``repr``, simple attributes, parameter and
buffer names/shapes/dtypes — not their values, which are graph inputs), the loss function, the
model description and input dtypes, the options that shape the graph, the optimizer config, the
shape signature, and the versions of ort_trainer, torch, onnx and onnxruntime.

Entries are written to a temporary directory and renamed into place, so a reader never sees a
half-written entry and two processes building the same job at once both end with a valid one.
The location is ``$ORT_TRAINER_CACHE_DIR`` (default ``~/.cache/ort_trainer``); set
``ORT_TRAINER_CACHE_DIR=off`` to disable caching.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import onnx
import onnxruntime as ort
import torch

from .._logging import logger

_VERSION = "1"


def cache_dir() -> Path | None:
    """The cache root, or None when caching is off."""
    value = os.environ.get("ORT_TRAINER_CACHE_DIR", "")
    if value.lower() in ("off", "0", "none", "false"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "ort_trainer"


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        code = getattr(obj, "__code__", None)
        if code is not None:
            return repr((code.co_code, code.co_consts, code.co_names))
        return getattr(obj, "__qualname__", type(obj).__qualname__)


_SIMPLE = (bool, int, float, str, type(None))


def _simple_attributes(module: Any) -> dict:
    out = {}
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or key == "training":
            continue
        if isinstance(value, _SIMPLE):
            out[key] = value
        elif isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value):
            out[key] = list(value)
    return out


def fingerprint_callable(fn: Callable | None) -> Any:
    """A JSON-able fingerprint of a function or module (its code, not its identity)."""
    if fn is None:
        return None
    if isinstance(fn, torch.nn.Module):
        return fingerprint_module(fn)
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    closure = getattr(fn, "__closure__", None) or ()
    cells = []
    for cell in closure:
        try:
            cells.append(repr(cell.cell_contents) if isinstance(cell.cell_contents, _SIMPLE) else type(cell.cell_contents).__qualname__)
        except ValueError:
            cells.append("<empty>")
    return [getattr(target, "__qualname__", repr(target)), _source(target), cells,
            _simple_attributes(fn) if not inspect.isfunction(fn) and hasattr(fn, "__dict__") else {}]


def fingerprint_module(model: torch.nn.Module) -> Any:
    """A JSON-able fingerprint of a module's structure (not its weight values)."""
    classes = sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}")
    return {
        "repr": repr(model),
        "classes": [[f"{c.__module__}.{c.__qualname__}", hashlib.sha256(_source(c).encode()).hexdigest()] for c in classes],
        "attributes": {name: _simple_attributes(m) for name, m in model.named_modules()},
        "tensors": [
            [name, list(t.shape), str(t.dtype), bool(getattr(t, "requires_grad", False))]
            for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
            if t is not None
        ],
    }


def fingerprint_onnx(model: onnx.ModelProto) -> str:
    """SHA-256 of a serialized ONNX model."""
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def make_key(parts: dict) -> str:
    """The cache key (hex SHA-256) of a JSON-able dict of everything that determines the graphs."""
    from .. import __version__

    payload = dict(parts, _versions=[_VERSION, __version__, torch.__version__, onnx.__version__, ort.__version__])
    text = json.dumps(payload, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


class GraphCache:
    """Load and store sets of named ONNX models plus JSON metadata under a key."""

    def __init__(self, root: Path | None = None):
        self.root = root if root is not None else cache_dir()

    def load(self, key: str) -> tuple[dict[str, onnx.ModelProto], dict] | None:
        """The cached models and metadata for ``key``, or None when absent (or unreadable)."""
        if self.root is None:
            return None
        entry = self.root / key
        meta_path = entry / "meta.json"
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            models = {name: onnx.load(str(entry / f"{name}.onnx")) for name in meta["_models"]}
        except Exception as exc:  # a damaged entry is rebuilt, never trusted
            logger.warning("ignoring unreadable graph cache entry %s (%s)", entry, exc)
            return None
        return models, meta

    def store(self, key: str, models: dict[str, onnx.ModelProto], meta: dict) -> Path | None:
        """Write an entry atomically; returns its path (None when caching is off or it failed)."""
        if self.root is None:
            return None
        entry = self.root / key
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=self.root))
            for name, model in models.items():
                onnx.save(model, str(tmp / f"{name}.onnx"))
            (tmp / "meta.json").write_text(json.dumps(dict(meta, _models=sorted(models)), indent=1))
            try:
                os.rename(tmp, entry)
            except OSError:  # another process stored the same entry first: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:
            logger.warning("could not write the graph cache entry %s (%s); continuing without it", entry, exc)
            return None
        return entry
