"""Random numbers the forward draws in Python (``random``, NumPy's global generator), which a trace freezes.

A graph recomputes tensor operations for every batch; a Python value is traced once. A draw with
``random.random()`` or ``np.random.rand()`` in the forward (a layer dropped with probability p, a
SpecAugment mask) is computed for the traced batch and its outcome becomes a constant of the graph:
every step would drop the same layers, mask the same frames. The guard reports each call made while
the traced forward runs (Hugging Face's wav2vec2 family draws its SpecAugment masks with NumPy:
``spec_augment.py`` replaces them with torch draws while the model is exported), except the draws that follow a
seed of that generator with a number in the same forward: their outcome is the same at every step, in PyTorch too
while the seed stays the same (Hugging Face's BigBird seeds NumPy with each layer's index before drawing its
random attention blocks), so the trace keeps it, with a warning that a changing seed would not be followed.
"""

from __future__ import annotations

import contextlib
import numbers
import random
import sys
import threading
from types import FrameType
from typing import Any, Callable, Iterator

import numpy as np

from ..._logging import warn_once
from .validations import source_line

# the module-level draws of Python's ``random`` and of NumPy's legacy global generator
_PYTHON = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
           "normalvariate", "betavariate", "expovariate", "triangular", "getrandbits")
_NUMPY = ("rand", "randn", "random", "random_sample", "randint", "uniform", "normal", "choice", "permutation",
          "shuffle", "binomial", "poisson", "exponential", "beta", "integers")


def _warn_seeded(where: str) -> None:
    warn_once(("seeded draw", where), "%s: the forward seeds a Python random generator with a number, then draws "
              "from it: those draws are traced at their outcome, the same at every step, as PyTorch's are while the "
              "seed stays the same (Hugging Face's BigBird seeds each layer's random attention blocks so). A seed that "
              "changes from step to step would not be followed: draw with torch instead", where)


@contextlib.contextmanager
def reporting(report: Callable[[str], None],
              substitute: Callable[[str, FrameType], Any] = lambda name, frame: None) -> Iterator[None]:
    """Within: each call of those draws on this thread returns ``substitute("np.random.random", the caller's
    frame)`` where that is not None (a layer drop's draw, in torch: ``layer_drop.python_draw``); else it draws as
    it would have, after logging once (where the forward seeded that generator with a number before) or calling
    ``report("np.random.random")`` (the draw's name)."""
    thread, swapped, seeded = threading.get_ident(), [], {}  # generator -> where the forward seeded it

    def watched(owner, prefix: str, name: str):
        original = getattr(owner, name)

        def draw(*args, **kwargs):
            if threading.get_ident() == thread:
                value = substitute(f"{prefix}.{name}", sys._getframe(1))
                if value is not None:
                    return value
                if prefix in seeded:
                    _warn_seeded(seeded[prefix])
                else:
                    report(f"{prefix}.{name}")
            return original(*args, **kwargs)

        def seed(*args, **kwargs):
            if threading.get_ident() == thread:
                value = args[0] if args else next(iter(kwargs.values()), None)
                if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                    seeded[prefix] = source_line(sys._getframe(1).f_code.co_filename, sys._getframe(1).f_lineno)
                else:  # seeded from the system's entropy, or with a value the trace would freeze
                    seeded.pop(prefix, None)
            return original(*args, **kwargs)

        swapped.append((owner, name, original))
        setattr(owner, name, seed if name == "seed" else draw)

    for name in (*_PYTHON, "seed"):
        if hasattr(random, name):
            watched(random, "random", name)
    for name in (*_NUMPY, "seed"):
        if hasattr(np.random, name):
            watched(np.random, "np.random", name)
    try:
        yield
    finally:
        for owner, name, original in reversed(swapped):
            setattr(owner, name, original)


__all__ = ["reporting"]
