"""Ctrl-C (SIGINT) held where it would do harm: inside a step, and inside a save.

A step is applied whole or not at all, so an interrupt waits for the step's end. A save stops at
its next safe point (between two arrays it writes) and leaves no file, or, arriving after the
last one, is raised once the file is whole. Either way the caller gets ``KeyboardInterrupt``:
Python's own handler would raise it wherever the main thread happens to be, and when that is a
cleanup callback of a library (h5py closes its objects from weakref callbacks while a checkpoint
is written), Python prints "Exception ignored in" and drops it, so a training loop carried on
after the user pressed Ctrl-C.

Only the main thread receives signals, and a handler the application installed itself is left
alone: in both cases a block runs as it is.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

from ._logging import logger

_held: list[list[int]] = []  # the signals each hold active now has received, the innermost last


@contextlib.contextmanager
def _holding(notice: str) -> Iterator[None]:
    """Run the block with SIGINT recorded instead of raised (``_held``); log ``notice`` on the first."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield  # another thread, the application's own handler, or a hold of ours around this one
        return
    received: list[int] = []

    def hold(signum, frame):
        if not received:
            logger.warning(notice)
        received.append(signum)

    signal.signal(signal.SIGINT, hold)
    _held.append(received)
    try:
        yield
    finally:
        _held.remove(received)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Run the block with SIGINT held; raise ``KeyboardInterrupt`` after it if one arrived.

    A ``KeyboardInterrupt`` raised between two state changes of a step (the weights swapped but
    the step counter not yet advanced, a micro-batch's gradient added but not counted) would
    leave the trainer inconsistent. ONNX Runtime does not react to signals inside a run anyway,
    so holding the signal until the step ends costs at most the rest of one step.
    """
    with _holding("interrupt received: finishing the current step first"):
        yield


@contextlib.contextmanager
def interruptible_save() -> Iterator[None]:
    """Run a save with SIGINT held: the save stops at its next ``stop_if_interrupted`` (and the
    caller removes what it had written), or ``KeyboardInterrupt`` is raised after the block."""
    with _holding("interrupt received: stopping the save"):
        yield


def stop_if_interrupted() -> None:
    """At a safe point of a save: raise ``KeyboardInterrupt`` if Ctrl-C arrived during it.

    Raises:
        KeyboardInterrupt: SIGINT arrived since the enclosing hold began.
    """
    if any(_held):
        raise KeyboardInterrupt


__all__ = ["deferred_interrupt", "interruptible_save", "stop_if_interrupted"]
