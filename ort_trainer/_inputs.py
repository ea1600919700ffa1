"""A step's inputs as the arrays ONNX Runtime reads: taken without copies where they can be, checked
against the model description, and a bad batch refused whole (every problem listed) before anything
runs.

Each ``train_step`` and ``eval_step`` goes through here, so the common case is kept short: a batch
whose inputs have the dtypes and shapes of one already checked is not checked again (what is
checked here depends on those alone; the values' rules, such as label ranges, are checked every
step by ``graph/export/input_checks.py``). The Python around a run costs far more at real sizes
than in a loop of calls: after the run's matrix products the interpreter's code and data are out of
the caches. One NumPy comparison took 3-4 µs in a loop and 30-50 µs right after an ONNX Runtime run
of the compute-bound MLP of ``make bench-real`` (``docs/performance.md``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from .model_desc import ModelDescription

# shapes and dtypes remembered as checked; past this many (shapes that vary from batch to batch) the memory
# starts again
_REMEMBERED = 256


class StepInputs:
    """Turns ``train_step``/``eval_step`` arguments into feeds by input name (``feeds``).

    Args:
        desc: the model description: input names, their symbolic shapes.
    """

    def __init__(self, desc: ModelDescription):
        self.desc = desc
        self._names = tuple(desc.input_names)
        self._checked: set[tuple] = set()
        self._checked_against: Mapping | None = None  # the expected dtypes the remembered batches were checked with

    def feeds(self, args: tuple, kwargs: dict, dtypes: Mapping[str, np.dtype | None]) -> dict[str, np.ndarray]:
        """The inputs by name as C-contiguous NumPy arrays (views of CPU tensors, not copies).

        Args:
            args: inputs in ``model_desc`` order (torch tensors, NumPy arrays or array-likes).
            kwargs: the same, by name.
            dtypes: the dtype each input must have (None: any); the batches remembered as checked
                are forgotten when another mapping is given.

        Raises:
            ValueError: for missing, unknown, doubly given or misshapen inputs (all of them).
            TypeError: for a wrong dtype, or a value that is not array-like.
        """
        if dtypes is not self._checked_against:
            self._checked, self._checked_against = set(), dtypes
        if not kwargs and len(args) == len(self._names):
            feeds = {name: to_numpy(value, name) for name, value in zip(self._names, args)}
            key = tuple((array.dtype, array.shape) for array in feeds.values())
            if key in self._checked:
                return feeds
        else:
            key, feeds = None, self._named(args, kwargs)
        self._check(feeds, dtypes)
        if key is not None:
            if len(self._checked) >= _REMEMBERED:
                self._checked.clear()
            self._checked.add(key)
        return feeds

    def _named(self, args: tuple, kwargs: dict) -> dict[str, np.ndarray]:
        names = list(self._names)
        problems = []
        if len(args) > len(names):
            raise ValueError(f"got {len(args)} positional inputs but model_desc declares {len(names)}: {names}")
        given: dict[str, Any] = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                problems.append(f"input {name!r} is not in model_desc.inputs {names}")
            elif name in given:
                problems.append(f"input {name!r} was given both positionally and by name")
            else:
                given[name] = value
        missing = [n for n in names if n not in given]
        if missing:
            problems.append(f"missing input(s) {missing}; model_desc.inputs are {names}")
        if problems:
            raise ValueError("bad inputs:\n  " + "\n  ".join(problems))
        return {name: to_numpy(given[name], name) for name in names}

    def _check(self, feeds: dict[str, np.ndarray], dtypes: Mapping[str, np.dtype | None]) -> None:
        problems, symbols, type_problems = [], {}, []
        for d in self.desc.inputs:
            array = feeds[d.name]
            expected = dtypes.get(d.name)
            if expected is not None and array.dtype != expected:
                type_problems.append(f"input {d.name!r}: expected dtype {expected}, got {array.dtype}")
            if array.ndim != len(d.shape):
                problems.append(f"input {d.name!r}: expected {len(d.shape)} dimensions {list(d.shape)}, "
                                f"got shape {list(array.shape)}")
                continue
            for axis, (dim, size) in enumerate(zip(d.shape, array.shape)):
                if isinstance(dim, int) and dim != size:
                    problems.append(f"input {d.name!r}: dimension {axis} must be {dim}, got {size} "
                                    f"(shape {list(array.shape)})")
                elif isinstance(dim, str):
                    if size == 0:
                        problems.append(f"input {d.name!r}: dimension {axis} ({dim!r}) is 0, an empty batch "
                                        f"(shape {list(array.shape)}); skip empty batches")
                    seen = symbols.setdefault(dim, (size, d.name))
                    if seen[0] != size:
                        problems.append(f"input {d.name!r}: dimension {axis} ({dim!r}) is {size} but "
                                        f"{dim!r} is {seen[0]} in input {seen[1]!r}")
        if type_problems:
            raise TypeError("bad inputs:\n  " + "\n  ".join(type_problems + problems))
        if problems:
            raise ValueError("bad inputs:\n  " + "\n  ".join(problems))


def to_numpy(value: Any, name: str) -> np.ndarray:
    """``value`` as a C-contiguous NumPy array of one dimension or more: a view of a contiguous CPU
    tensor or array, else a copy.

    Raises:
        TypeError: when ``value`` is not a tensor, an array or something NumPy makes an array of.
    """
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            value = value.detach()
        if not value.is_cpu:
            value = value.cpu()
        array = value.numpy()
    elif isinstance(value, np.ndarray):
        array = value
    else:
        try:
            array = np.asarray(value)
        except Exception as exc:
            raise TypeError(f"input {name!r}: expected a torch tensor or numpy array, got {type(value).__name__}") \
                from exc
    # NumPy's ascontiguousarray also gives a 0-d value one dimension, as inputs always had
    return array if array.flags.c_contiguous and array.ndim else np.ascontiguousarray(array)


__all__ = ["StepInputs", "to_numpy"]
