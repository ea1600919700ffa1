"""Random numbers the forward draws in Python (``random``, NumPy's global generator), which a trace freezes.

A graph recomputes tensor operations for every batch; a Python value is traced once. A draw with
``random.random()`` or ``np.random.rand()`` in the forward (a layer dropped with probability p, a
SpecAugment mask) is computed for the traced batch and its outcome becomes a constant of the graph:
every step would drop the same layers, mask the same frames. The guard reports each call made while
the traced forward runs (Hugging Face's wav2vec2 family draws its SpecAugment masks with NumPy:
``spec_augment.py`` replaces them with torch draws while the model is exported).
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from types import FrameType
from typing import Any, Callable, Iterator

import numpy as np

# the module-level draws of Python's ``random`` and of NumPy's legacy global generator
_PYTHON = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
           "normalvariate", "betavariate", "expovariate", "triangular", "getrandbits")
_NUMPY = ("rand", "randn", "random", "random_sample", "randint", "uniform", "normal", "choice", "permutation",
          "shuffle", "binomial", "poisson", "exponential", "beta", "integers")


@contextlib.contextmanager
def reporting(report: Callable[[str], None],
              substitute: Callable[[str, FrameType], Any] = lambda name, frame: None) -> Iterator[None]:
    """Within: each call of those draws on this thread returns ``substitute("np.random.random", the caller's
    frame)`` where that is not None (a layer drop's draw, in torch: ``layer_drop.python_draw``), else calls
    ``report("np.random.random")`` (the draw's name) and draws as it would have."""
    thread, swapped = threading.get_ident(), []

    def watched(owner, prefix: str, name: str):
        original = getattr(owner, name)

        def draw(*args, **kwargs):
            if threading.get_ident() == thread:
                value = substitute(f"{prefix}.{name}", sys._getframe(1))
                if value is not None:
                    return value
                report(f"{prefix}.{name}")
            return original(*args, **kwargs)

        swapped.append((owner, name, original))
        setattr(owner, name, draw)

    for name in _PYTHON:
        if hasattr(random, name):
            watched(random, "random", name)
    for name in _NUMPY:
        if hasattr(np.random, name):
            watched(np.random, "np.random", name)
    try:
        yield
    finally:
        for owner, name, original in reversed(swapped):
            setattr(owner, name, original)


__all__ = ["reporting"]
