"""Logging set-up: quiet by default, ONNX Runtime's own chatter silenced unless asked for.

The level of the ``ort_trainer`` logger comes from the ``ORT_TRAINER_LOG_LEVEL`` environment
variable (``DEBUG``, ``INFO``, ``WARNING`` ...; default ``WARNING``). ONNX Runtime's native
logger follows it: its INFO lines only appear when ``ORT_TRAINER_LOG_LEVEL=DEBUG``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Hashable

import onnxruntime as ort  # first imported by _runtime, which keeps the root logger clean

LOGGER_NAME = "ort_trainer"
logger = logging.getLogger(LOGGER_NAME)

# ONNX Runtime severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.

_LOGGED: set = set()  # the keys ``warn_once`` has logged in this process


def warn_once(key: Hashable, message: str, *args: Any) -> None:
    """Log ``message % args`` as a warning the first time this process meets ``key`` (what a model does, named by
    its kind and source line: said once, not at every export of it)."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.warning(message, *args)


def _configure_from_env() -> None:
    level_name = os.environ.get("ORT_TRAINER_LOG_LEVEL", "").strip().upper()
    if level_name:
        level = logging.getLevelName(level_name)
        if not isinstance(level, int):
            raise ValueError(
                f"ORT_TRAINER_LOG_LEVEL={level_name!r} is not a logging level; "
                "use DEBUG, INFO, WARNING, ERROR or CRITICAL"
            )
        logger.setLevel(level)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
            logger.addHandler(handler)
            logger.propagate = False
    ort.set_default_logger_severity(ort_severity())


def ort_severity() -> int:
    """Return the ONNX Runtime log severity matching the ``ort_trainer`` logger's level: its INFO
    lines (and warnings) at DEBUG, its errors at INFO, else only fatal ones. An error of a run reaches
    the caller as an exception that says more (``_run_errors.StepError``), so ONNX Runtime's own
    line for it stays off stderr unless logging asks for it."""
    level = logger.getEffectiveLevel()
    return 1 if level <= logging.DEBUG else 3 if level <= logging.INFO else 4


_configure_from_env()
