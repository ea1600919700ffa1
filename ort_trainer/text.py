"""A text corpus that ships with every Python, and a byte-level tokenizer for it.

``stdlib_corpus()`` concatenates the source of the top-level modules of the running
interpreter's standard library (``sysconfig.get_paths()["stdlib"]``, e.g. ``abc.py``,
``argparse.py``, ...), sorted by file name: real text, no download, the same on every machine
with the same Python version. ``ByteTokenizer`` maps UTF-8 bytes to ids 0-255, so any text
round-trips and the vocabulary is fixed.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary of 256)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids (invalid UTF-8 sequences become U+FFFD)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def stdlib_corpus(max_bytes: int = 2_000_000) -> str:
    """Up to ``max_bytes`` of Python standard-library source, whole files in name order.

    Raises:
        FileNotFoundError: when the interpreter has no standard-library sources on disk.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no standard-library sources under {root}")
    parts, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(f"# file: {path.name}\n{text}\n")
        total += len(parts[-1])
        if total >= max_bytes:
            break
    return "".join(parts)[:max_bytes]


def token_splits(max_bytes: int = 2_000_000, validation_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """The corpus as int64 byte ids, split into training and validation parts (the last files)."""
    ids = np.frombuffer(stdlib_corpus(max_bytes).encode("utf-8"), dtype=np.uint8).astype(np.int64)
    cut = int(len(ids) * (1.0 - validation_fraction))
    return ids[:cut], ids[cut:]
