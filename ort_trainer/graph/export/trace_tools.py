"""Two small tools the export's trace-time rewrites share: a set of tensors by identity, and classes' methods
replaced on the tracing thread for the length of one trace."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch


class TensorSet:
    """Tensors held by identity (``torch.Tensor.__eq__`` is elementwise) and weakly: a tensor freed during the trace
    leaves, and a new tensor that reuses its ``id`` is not mistaken for it."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, tensor: Any) -> None:
        """Hold ``tensor`` (anything but a tensor is ignored)."""
        if isinstance(tensor, torch.Tensor):
            self._refs[id(tensor)] = weakref.ref(tensor)

    def __contains__(self, tensor: object) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def __bool__(self) -> bool:
        return bool(self._refs)

    def any_of(self, tensors: Any) -> bool:
        """Whether one of ``tensors`` is held."""
        return bool(self._refs) and any(tensor in self for tensor in tensors)

    def clear(self) -> None:
        """Hold nothing."""
        self._refs.clear()


@contextlib.contextmanager
def methods_replaced(replacements: Mapping[type, Mapping[str, Callable[..., Any]]]) -> Iterator[None]:
    """Within, each class's named method runs its replacement on the calling thread, as
    ``replacement(original, self, *args, **kwargs)`` (``original``: the class's own function, to fall back on);
    other threads keep the original. The originals are back on leaving, however it ends."""
    thread = threading.get_ident()
    originals = {(cls, name): cls.__dict__[name] for cls, methods in replacements.items() for name in methods}

    def patched(original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def method(self, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == thread:
                return replacement(original, self, *args, **kwargs)
            return original(self, *args, **kwargs)
        return method

    try:
        for (cls, name), original in originals.items():
            setattr(cls, name, patched(original, replacements[cls][name]))
        yield
    finally:
        for (cls, name), original in originals.items():
            setattr(cls, name, original)


__all__ = ["TensorSet", "methods_replaced"]
