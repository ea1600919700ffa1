"""``metrics.jsonl``: the command line's training log, one JSON object per line.

A run that is killed while writing can leave a torn last line. Readers skip any line that is
not a JSON object (with a warning), and ``MetricsLog.resume`` cuts the log back to the
checkpoint a resumed run starts from, torn tail included, so the log stays one object per line.
Each record is appended with a single ``write`` on an ``O_APPEND`` descriptor, so a crash leaves
either the whole line or none of it (short of a full disk).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ._logging import logger
from ._temporaries import atomic_write


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics log, skipping (with a warning) lines that are not JSON objects.

    Args:
        path: the ``metrics.jsonl`` file; a missing file has no records.

    Returns:
        The records in file order.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_bytes().decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            logger.warning("%s line %d is not a JSON object (a run killed while writing it?); skipped: %.80r",
                           path, number, line)
            continue
        records.append(record)
    return records


class MetricsLog:
    """Appends records to ``metrics.jsonl``.

    Args:
        path: the log file; its directory must exist.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def start(self) -> None:
        """Begin a fresh log: an earlier run's records are removed."""
        self.path.unlink(missing_ok=True)

    def resume(self, step: int) -> None:
        """Keep the records up to ``step`` (the checkpoint the run resumes from) and drop the rest.

        Records after the checkpoint, and a torn or otherwise unreadable line, would otherwise
        sit between the records of the resumed run; they are logged again as the run repeats
        those steps.
        """
        if not self.path.exists():
            return
        kept = [r for r in read_metrics(self.path) if not isinstance(r.get("step"), int) or r["step"] <= step]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        if text.encode() == self.path.read_bytes():
            return
        atomic_write(self.path, lambda temporary: Path(temporary).write_text(text), what="writing the metrics log")

    def append(self, record: dict[str, Any]) -> None:
        """Add one record as one line, written whole."""
        data = (json.dumps(record) + "\n").encode()
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(descriptor, data)
            while written < len(data):  # only on a nearly full disk: finish the line
                written += os.write(descriptor, data[written:])
        finally:
            os.close(descriptor)
