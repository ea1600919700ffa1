"""Hold Ctrl-C while a step changes state, so a step is applied whole or not at all."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

from ._logging import logger


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Run the block with SIGINT held; raise ``KeyboardInterrupt`` after it if one arrived.

    A ``KeyboardInterrupt`` raised between two state changes of a step (the weights swapped but
    the step counter not yet advanced, a micro-batch's gradient added but not counted) would
    leave the trainer inconsistent. ONNX Runtime does not react to signals inside a run anyway,
    so holding the signal until the step ends costs at most the rest of one step.

    Only the main thread receives signals, and a handler the application installed itself is
    left alone: in both cases the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received: list[int] = []

    def hold(signum, frame):
        if not received:
            logger.warning("interrupt received: finishing the current step first")
        received.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


__all__ = ["deferred_interrupt"]
