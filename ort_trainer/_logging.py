"""Logging set-up: quiet by default, ONNX Runtime's own chatter silenced unless asked for.

The level of the ``ort_trainer`` logger comes from the ``ORT_TRAINER_LOG_LEVEL`` environment
variable (``DEBUG``, ``INFO``, ``WARNING`` ...; default ``WARNING``). ONNX Runtime's native
logger follows it: its INFO lines only appear when ``ORT_TRAINER_LOG_LEVEL=DEBUG``.
"""

from __future__ import annotations

import logging
import os
import sys

_root_handlers = list(logging.getLogger().handlers)
_ort_imported = "onnxruntime" in sys.modules
import onnxruntime as ort  # noqa: E402

if not _ort_imported:
    # Importing the training build calls logging.basicConfig() as a side effect (its
    # tools/logger.py); take that root handler back off so the application's logging is its own.
    for _handler in logging.getLogger().handlers[:]:
        if _handler not in _root_handlers:
            logging.getLogger().removeHandler(_handler)

LOGGER_NAME = "ort_trainer"
logger = logging.getLogger(LOGGER_NAME)

# ONNX Runtime severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.
_ORT_SEVERITY = {logging.DEBUG: 1, logging.INFO: 3, logging.WARNING: 3, logging.ERROR: 3, logging.CRITICAL: 4}


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
    """Return the ONNX Runtime log severity matching the ``ort_trainer`` logger's level."""
    level = logger.getEffectiveLevel()
    return 1 if level <= logging.DEBUG else 3


_configure_from_env()
