"""Where ort_trainer keeps what it builds across processes: ``$ORT_TRAINER_CACHE_DIR`` (default
``~/.cache/ort_trainer``; ``off``, ``0``, ``none`` or ``false`` turns caching off). The graph cache
(``graph/cache.py``) and the kernel library (``kernels/``) live under it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path | None:
    """The cache root, or None when caching is off."""
    value = os.environ.get("ORT_TRAINER_CACHE_DIR", "")
    if value.lower() in ("off", "0", "none", "false"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "ort_trainer"
