"""The command line's text: the bundled corpus, or the user's files, as token ids.

``data: {name: text, files: GLOB}`` reads every file ``GLOB`` matches (``~`` expanded, ``**`` recursive),
in name order, each as UTF-8 (undecodable bytes replaced), and tokenizes it with the job's tokenizer
(the model's own for ``model.type=hf``, bytes otherwise), a file at a time under a progress bar. The ids
are cached beside the data (``.ort_trainer_tokens/`` in the files' common folder), named by a hash of the
tokenizer, ``data.max_bytes`` and every file's path, size and modification time: a later run with the same
files and tokenizer reads the ids instead of tokenizing again; a changed, added or removed file makes a
new entry. A folder that cannot be written is read without a cache (logged at DEBUG).
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path
from typing import Callable

import numpy as np

from ._logging import logger
from ._temporaries import atomic_write
from .text import stdlib_corpus

CACHE_FOLDER = ".ort_trainer_tokens"


def matching_files(pattern: str) -> list[Path]:
    """The files ``pattern`` matches, in name order.

    Raises:
        ValueError: when it matches no file, or only empty ones.
    """
    files = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())
    if not files:
        raise ValueError(f"data.files={pattern!r} matches no file: give a glob of your text files, e.g. "
                         "data.files='corpus/**/*.txt'")
    empty = [f for f in files if f.stat().st_size == 0]
    if len(empty) == len(files):
        raise ValueError(f"data.files={pattern!r}: all {len(files)} matching file(s) are empty")
    if empty:
        logger.warning("data.files=%r: %d of %d files are empty and add no text (%s%s)", pattern, len(empty),
                       len(files), ", ".join(str(f) for f in empty[:3]), ", ..." if len(empty) > 3 else "")
    return [f for f in files if f not in empty]


def corpus_ids(data_cfg: dict, encode: Callable[[str], list[int]], tokenizer_id: str) -> np.ndarray:
    """The data set's text as int64 token ids.

    Args:
        data_cfg: the config's ``data`` section (``name`` ``stdlib`` or ``text``; ``files``; ``max_bytes``:
            at most this many bytes of text are read).
        encode: text -> token ids.
        tokenizer_id: names the tokenizer in the cache key (its class, name or path, and vocabulary size).
    """
    if data_cfg["name"] == "stdlib":
        return np.asarray(encode(stdlib_corpus(data_cfg["max_bytes"])), dtype=np.int64)
    files = matching_files(data_cfg["files"])
    stamp = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(repr([tokenizer_id, data_cfg["max_bytes"], stamp]).encode()).hexdigest()[:32]
    folder = Path(os.path.commonpath([str(f.resolve().parent) for f in files])) / CACHE_FOLDER
    cached = folder / f"tokens-{key}.npy"
    if cached.is_file():
        try:
            ids = np.load(cached, allow_pickle=False)
            logger.info("data.files: %d tokens from the cache %s", len(ids), cached)
            return ids
        except (OSError, ValueError) as exc:
            logger.warning("the token cache %s cannot be read (%s); tokenizing again", cached, exc)
    ids = _tokenize(files, encode, data_cfg["max_bytes"])
    try:
        folder.mkdir(exist_ok=True)
        atomic_write(cached, lambda temporary: _save(temporary, ids), what="writing the token cache")
    except OSError as exc:
        logger.debug("no token cache beside the data (%s)", exc)
    return ids


def _save(path: str, ids: np.ndarray) -> None:
    with open(path, "wb") as out:  # a file object: np.save would add ".npy" to the temporary's name
        np.save(out, ids, allow_pickle=False)


def _tokenize(files: list[Path], encode: Callable[[str], list[int]], max_bytes: int) -> np.ndarray:
    """Token ids of the files' text (at most ``max_bytes`` bytes of it), a file at a time."""
    from tqdm import tqdm

    parts, read = [], 0
    for path in tqdm(files, desc="tokenizing", unit="file", disable=None):
        text = path.read_bytes()[:max(0, max_bytes - read)].decode("utf-8", errors="replace")
        read += len(text.encode("utf-8"))
        parts.append(np.asarray(encode(text + "\n"), dtype=np.int64))
        if read >= max_bytes:
            logger.info("data.files: stopped after %d of %d files (data.max_bytes=%d)", len(parts), len(files),
                        max_bytes)
            break
    return np.concatenate(parts)


__all__ = ["CACHE_FOLDER", "corpus_ids", "matching_files"]
