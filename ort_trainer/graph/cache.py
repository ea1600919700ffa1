"""The on-disk cache of training graphs.

An entry is a directory named by a key the pipeline computes from what was actually traced: a
hash of the traced program (with the weights as graph inputs, so their values never enter it)
plus the options that shape the gradient and eval graphs and the versions of the libraries that
build them, so edited model or loss code always changes the key. An entry holds the gradient
graph and, where the source builds it with the gradient graph, the eval graph (else the eval
graph gets an entry of its own when first needed).

``meta.json`` records the key and the SHA-256 of every graph file. Loading checks them, checks
that every name a graph reads is defined before it is read, and runs the caller's own
consistency checks (``onnx.checker`` cannot be used: it rejects ONNX Runtime's gradient
operators); an entry that fails any of them is
removed with a warning naming it, and the caller rebuilds and stores it again.

Entries are written to a temporary directory ``.<key[:12]>-<host>-<pid>-<random>`` and renamed
into place, so a reader never sees a half-written entry and two processes building the same job
at once both end with a valid one. A store first removes the temporaries a killed or failed
writer left behind: those whose writer process on this host is gone, and any untouched for
``STALE_AFTER_S``. ``.links/`` maps the cheaper record keys of ``op_record.py`` to the entries
they were seen with, so that a hit can skip the export. The location is ``$ORT_TRAINER_CACHE_DIR`` (default ``~/.cache/ort_trainer``);
set ``ORT_TRAINER_CACHE_DIR=off`` to disable caching.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

import onnx
import onnxruntime as ort
import torch

from .._cache_root import cache_dir
from .._logging import logger
from .._temporaries import pid_alive
from .._version import __version__
from .onnx_graph import dangling_names

# 3: the torch source drops unfetched outputs from its graphs; 4: its eval graph gets passes; 5: column_sums;
# 6: mixed-type LayerNormalization casts (a graph of format 5 with one is refused by ONNX Runtime);
# 7: operator records key grad mode, inference mode and requires_grad (links of 6 could name a stale graph)
# 8: tied_embedding_gradient (its graphs have outputs an engine of format 7 would not add up); the training
# graph's key leaves eval mode out, the eval graph's covers its own trace; 9: sparse_labels projects a bucket of
# rows (graphs of 8 are right, but grow ONNX Runtime's arena at each new labelled count), activation_recompute
# recomputes attention probabilities; 10: the torch source's accumulating graphs add into accumulator inputs
# (those of 9 return the micro-batch's gradients, which an engine of 10 would not add up); 11: input constraints
# are index rules computed from the batch (those of 10 check labels only where they reach a loss unchanged); 12:
# fused_layer_norm_gradient sums a pre-norm LayerNorm's gradient into the residual's in its kernel (graphs of 11
# compute the same, unfused); 13: fused_layer_norm writes a post-norm LayerNorm's float32 output and its half cast in
# one kernel (graphs of 12 compute it with a Cast); 14: fused_gradient_sums adds a chain of half gradients in one
# variadic AddHalf (graphs of 13: one node a term, which 14's library still runs); 15: fused_layer_norm computes the
# residual sum before a LayerNorm in its kernel (AddLayerNorm*); 16: a scatter-add's row shape a constant where static
# (graphs of 15 keep a zero table alive for a Shape); 17: torch_products widens a half weight gradient that reaches its
# Cast through two Transposes that undo each other (graphs of 16 compute it rounded to half, then widened); 18:
# integer_pads (on by default) writes an integer Pad as a Concat (graphs of 17 pad GPT-2's labels on the host); 19:
# torch_products' Gemm nodes read and write the tensors flattening Reshapes viewed (graphs of 18 keep the Reshapes);
# 20: torch_products' column sums are Gemm nodes of a row of ones (graphs of 19 reshape around a MatMul); 21: a GPU's
# graphs wait for the backward with AliasAfter nodes (device_barriers; graphs of 20 with host-read Reshapes), and a
# symbolic-shape graph's integer Pad is a Concat too; 23: small_table_gradients casts an int32 index to int64 for
# OneHot (graphs of 22 with an int32 index, Tensor.unfold's gradient, were refused by ONNX Runtime's CPU provider)
_VERSION = "30"
_LINKS = ".links"  # record key -> entry key files (a dot name: no entry, no temporary)
STALE_AFTER_S = 3600.0  # no store takes this long; a temporary this old has no live writer
_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32]
_TEMPORARY = re.compile(r"^\.[0-9a-f]{12}-(?:(?P<host>[A-Za-z0-9]*)-(?P<pid>\d+)-)?[a-z0-9_]{8}$")

Validator = Callable[[dict[str, onnx.ModelProto], dict], list[str]]


def fingerprint_graph(model: onnx.ModelProto) -> str:
    """SHA-256 of a serialized ONNX model: structure, attributes and initializer values.

    Args:
        model: the graph to fingerprint; pass it with its weights as graph inputs so that only
            their names, shapes and dtypes (not their values) enter the hash.

    Returns:
        The hex digest.
    """
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def make_key(parts: dict) -> str:
    """The cache key (hex SHA-256) of a JSON-able dict of everything that determines the graphs.

    The versions of the cache format, ort_trainer, torch, onnx and onnxruntime are added.
    """
    payload = dict(parts, _versions=[_VERSION, __version__, torch.__version__, onnx.__version__, ort.__version__])
    text = json.dumps(payload, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class GraphCache:
    """Load and store sets of named ONNX models plus JSON metadata under a key.

    Args:
        root: the cache directory (default: ``cache_dir()``; None there means caching is off).
    """

    def __init__(self, root: Path | None = None):
        self.root = root if root is not None else cache_dir()

    def load(self, key: str, validate: Validator | None = None) -> tuple[dict[str, onnx.ModelProto], dict] | None:
        """The cached models and metadata for ``key``, or None when absent or damaged.

        Args:
            key: the entry's key.
            validate: ``validate(models, meta)`` returns the problems the caller finds in an
                entry that passed the file checks (e.g. graphs that disagree with the metadata).

        Returns:
            ``(models, meta)``, or None. A damaged entry is removed, with a warning naming it and
            what is wrong, so that the caller's rebuild stores a good one in its place.
        """
        if self.root is None:
            return None
        entry = self.root / key
        if not entry.is_dir():
            return None
        try:
            models, meta, problems = self._read(entry, key)
            if not problems and validate is not None:
                problems = validate(models, meta)
        except Exception as exc:  # a damaged entry is rebuilt, never trusted
            problems = [f"{type(exc).__name__}: {exc}"]
        if not problems:
            return models, meta
        logger.warning("the graph cache entry %s is damaged (%s); rebuilding it", entry, "; ".join(problems))
        self._discard(entry, key)
        return None

    @staticmethod
    def _read(entry: Path, key: str) -> tuple[dict[str, onnx.ModelProto], dict, list[str]]:
        meta_path = entry / "meta.json"
        if not meta_path.exists():
            return {}, {}, ["it has no meta.json"]
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict) or meta.get("_key") != key or not isinstance(meta.get("_files"), dict):
            return {}, {}, ["meta.json does not describe this entry (no matching _key or _files)"]
        problems, models = [], {}
        for name in meta.get("_models", []):
            path = entry / f"{name}.onnx"
            expected = meta["_files"].get(path.name)
            if not path.exists():
                problems.append(f"{path.name} is missing")
            elif _sha256(path) != expected:
                problems.append(f"{path.name} does not match its SHA-256 in meta.json")
            else:
                models[name] = onnx.load(str(path))
                problems += [f"{path.name}: {p}" for p in dangling_names(models[name].graph)]
        return models, meta, problems

    def _discard(self, entry: Path, key: str) -> None:
        """Move a damaged entry out of the way (atomically), then delete it."""
        try:
            trash = self._temporary_path(key)
        except OSError:  # a read-only cache: the rebuild goes on without storing
            return
        try:
            os.rename(entry, trash)
        except OSError:  # another process removed or replaced it already
            pass
        shutil.rmtree(trash, ignore_errors=True)

    def _temporary_path(self, key: str) -> Path:
        # the writer's host and PID are in the name, so a later store can tell a dead writer's leftovers
        return Path(tempfile.mkdtemp(prefix=f".{key[:12]}-{_HOST}-{os.getpid()}-", dir=self.root))

    def store(self, key: str, models: dict[str, onnx.ModelProto], meta: dict) -> Path | None:
        """Write an entry atomically, after removing stale temporaries of earlier stores.

        Args:
            key: the entry's key.
            models: ``{name: model}``, written as ``<name>.onnx``.
            meta: JSON-able metadata; ``_key``, ``_models`` and ``_files`` (SHA-256 per file) are added.

        Returns:
            The entry's path, or None when caching is off or writing failed (logged; training
            goes on without the cache).
        """
        if self.root is None:
            return None
        entry = self.root / key
        tmp = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.remove_stale_temporaries()
            tmp = self._temporary_path(key)
            files = {}
            for name, model in models.items():
                path = tmp / f"{name}.onnx"
                onnx.save(model, str(path))
                files[path.name] = _sha256(path)
            (tmp / "meta.json").write_text(json.dumps(dict(meta, _key=key, _models=sorted(models), _files=files),
                                                      indent=1))
            try:
                os.rename(tmp, entry)
                tmp = None
            except OSError:  # another process stored the same entry first: keep theirs
                pass
        except (OSError, ValueError) as exc:
            logger.warning("could not write the graph cache entry %s (%s); continuing without it", entry, exc)
            return None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        return entry

    def link(self, record: str, key: str) -> None:
        """Remember that ``record`` (an ``op_record`` key) was seen with the entry ``key``.

        Written atomically (a temporary file renamed into place); a failure is logged and ignored.
        """
        if self.root is None:
            return
        links = self.root / _LINKS
        try:
            links.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{record[:12]}-", dir=links)
            with os.fdopen(fd, "w") as handle:
                handle.write(key)
            os.replace(tmp, links / record)
        except OSError as exc:
            logger.warning("could not link the graph cache entry %s (%s); continuing without it", key[:16], exc)

    def linked(self, record: str) -> str | None:
        """The entry key ``link`` stored for ``record``, or None."""
        if self.root is None:
            return None
        try:
            key = (self.root / _LINKS / record).read_text().strip()
        except OSError:
            return None
        return key if re.fullmatch(r"[0-9a-f]{64}", key) else None

    def remove_stale_temporaries(self) -> list[Path]:
        """Delete temporaries left by writers that were killed or failed; returns what was removed.

        A temporary is stale when the process that created it on this host has exited, or when
        nothing in it changed for ``STALE_AFTER_S`` (a writer on another host, a reused PID, or a
        temporary of an older version of this library, whose names carry no PID).
        """
        if self.root is None or not self.root.is_dir():
            return []
        removed = []
        for path in self.root.iterdir():
            match = _TEMPORARY.match(path.name)
            if match is None or not path.is_dir():
                continue
            try:
                dead = match["pid"] is not None and match["host"] == _HOST and not pid_alive(int(match["pid"]))
                if dead or time.time() - _last_change(path) > STALE_AFTER_S:
                    shutil.rmtree(path)
                    removed.append(path)
            except OSError:  # removed by another process meanwhile, or not ours to remove
                continue
        if removed:
            logger.info("removed %d stale graph cache temporaries from %s", len(removed), self.root)
        return removed


def _last_change(path: Path) -> float:
    """The newest modification time of a directory and the files in it."""
    return max([path.stat().st_mtime, *(child.stat().st_mtime for child in path.iterdir())])
