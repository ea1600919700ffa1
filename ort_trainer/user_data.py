"""The command line's data: the bundled corpus or the user's text files as token ids, and the user's
labelled examples (JSONL or CSV) as padded token ids and class labels.

``data: {name: text, files: GLOB}`` reads every file ``GLOB`` matches (``~`` expanded, ``**`` recursive),
in name order, each as UTF-8 (undecodable bytes replaced), and tokenizes it with the job's tokenizer
(the model's own for ``model.type=hf``, bytes otherwise), a file at a time under a progress bar. The ids
are cached beside the data (``.ort_trainer_tokens/`` in the files' common folder), named by a hash of the
tokenizer, ``data.max_bytes`` and every file's path, size and modification time: a later run with the same
files and tokenizer reads the ids instead of tokenizing again; a changed, added or removed file makes a
new entry. A folder that cannot be written is read without a cache (logged at DEBUG).

``data: {name: jsonl | csv, path: FILE, text: FIELD, label: FIELD}`` reads one example per JSON line (blank
lines skipped) or CSV row (with a header). Each text is tokenized, truncated to ``model.block_size`` tokens
(the count of truncated examples is logged) and padded; each label is a class number below the model's
``num_labels``, or a name in its ``label2id``. A missing file, no examples, a missing field and a bad label
are errors that name the lines, before any training.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
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
        logger.warning("data.files=%r: %d of %d files are empty and add no text (%s)", pattern, len(empty),
                       len(files), _listed(empty, 3))
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
    return cached(files, [tokenizer_id, data_cfg["max_bytes"]],
                  lambda: {"ids": _tokenize(files, encode, data_cfg["max_bytes"])})["ids"]


def cached(files: list[Path], parts: list, compute: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``compute()``'s arrays, from the cache beside ``files`` when an earlier run stored them for the same
    ``parts`` (what else decides them: the tokenizer, the lengths) and the same files (path, size, mtime)."""
    stamp = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(repr([parts, stamp]).encode()).hexdigest()[:32]
    folder = Path(os.path.commonpath([str(f.resolve().parent) for f in files])) / CACHE_FOLDER
    path = folder / f"tokens-{key}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as stored:
                arrays = {name: stored[name] for name in stored.files}
            logger.info("data: the tokenized data from the cache %s", path)
            return arrays
        except (OSError, ValueError) as exc:
            logger.warning("the token cache %s cannot be read (%s); tokenizing again", path, exc)
    arrays = compute()
    try:
        folder.mkdir(exist_ok=True)
        atomic_write(path, lambda temporary: _save(temporary, arrays), what="writing the token cache")
    except OSError as exc:
        logger.debug("no token cache beside the data (%s)", exc)
    return arrays


def _save(path: str, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as out:  # a file object: np.savez would add ".npz" to the temporary's name
        np.savez(out, **arrays)


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


def labelled_examples(data_cfg: dict) -> tuple[list[str], list, list[int]]:
    """``(texts, labels, line numbers)`` of a JSONL or CSV file (``data.path``, fields ``data.text`` and
    ``data.label``).

    Raises:
        ValueError: the file is missing or holds no example, a line is not a JSON object, or examples lack
            a field or have a text that is not a string (the first lines of each kind named).
    """
    path, text_key, label_key = Path(data_cfg["path"]).expanduser(), data_cfg["text"], data_cfg["label"]
    if not path.is_file():
        raise ValueError(f"data.path={str(path)!r} is not a file: give the {data_cfg['name'].upper()} file of your "
                         "examples")
    rows: list[tuple[int, object]] = []
    with open(path, encoding="utf-8", errors="replace", newline="") as source:
        if data_cfg["name"] == "csv":
            rows = list(enumerate(csv.DictReader(source), 2))  # line 1 is the header
        else:
            for number, line in enumerate(source, 1):
                if line.strip():
                    try:
                        rows.append((number, json.loads(line)))
                    except ValueError:
                        rows.append((number, None))
    if not rows:
        raise ValueError(f"data.path={str(path)!r} holds no examples")
    problems = {"is not a JSON object": [], f"has no field {text_key!r} (data.text)": [],
                f"has no field {label_key!r} (data.label)": [], f"has a {text_key!r} that is not text": []}
    kinds = list(problems)
    texts, labels, lines = [], [], []
    for number, row in rows:
        if not isinstance(row, dict):
            problems[kinds[0]].append(number)
        elif text_key not in row or row[text_key] is None:
            problems[kinds[1]].append(number)
        elif label_key not in row or row[label_key] in (None, ""):
            problems[kinds[2]].append(number)
        elif not isinstance(row[text_key], str):
            problems[kinds[3]].append(number)
        else:
            texts.append(row[text_key])
            labels.append(row[label_key])
            lines.append(number)
    found = [f"{len(numbers)} line(s) {kind} (line {_listed(numbers)})"
             for kind, numbers in problems.items() if numbers]
    if found:
        raise ValueError(f"data.path={str(path)!r}: " + "; ".join(found))
    return texts, labels, lines


def class_numbers(labels: list, lines: list[int], num_labels: int, label2id: dict) -> np.ndarray:
    """Each label as a class number: an int (or a string of one) below ``num_labels``, or a name in
    ``label2id``.

    Raises:
        ValueError: naming the bad labels and their lines, and what the model takes.
    """
    numbers, bad = [], []
    for label, line in zip(labels, lines):
        value = label2id.get(label) if isinstance(label, str) and label in label2id else label
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_labels:
            bad.append(f"{label!r} (line {line})")
        else:
            numbers.append(value)
    if bad:
        names = f" or one of {sorted(label2id)}" if label2id else ""
        raise ValueError(f"{len(bad)} label(s) the model cannot take: {_listed(bad)}; it has {num_labels} classes: "
                         f"use 0..{num_labels - 1}{names}")
    return np.asarray(numbers, dtype=np.int64)


def encoded_examples(texts: list[str], tokenizer, length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, attention mask)``, each ``[examples, length]``: every text truncated to ``length`` tokens (how
    many were is logged) and padded with the tokenizer's pad token."""
    from tqdm import tqdm

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = np.full((len(texts), length), pad, dtype=np.int64)
    mask = np.zeros((len(texts), length), dtype=np.int64)
    truncated = 0
    for row, text in enumerate(tqdm(texts, desc="tokenizing", unit="example", disable=None)):
        tokens = tokenizer(text, verbose=False)["input_ids"]
        truncated += len(tokens) > length
        tokens = tokens[:length]
        ids[row, :len(tokens)] = tokens
        mask[row, :len(tokens)] = 1
    if truncated:
        logger.info("%d of %d examples are longer than model.block_size=%d tokens and were truncated", truncated,
                    len(texts), length)
    return ids, mask


def _listed(items: list, most: int = 5) -> str:
    """The first ``most`` of ``items``, comma-separated, with ``...`` for the rest."""
    return ", ".join(map(str, items[:most])) + (", ..." if len(items) > most else "")


__all__ = ["CACHE_FOLDER", "cached", "class_numbers", "corpus_ids", "encoded_examples", "labelled_examples",
           "matching_files"]
