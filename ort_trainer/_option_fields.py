"""What an option of ``ORTTrainerOptions`` is (``_Field``: its types, default, documentation and check), the checks
that several take, and the types' tuples: shared by ``options.py`` and ``_graph_options.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class _Field:
    types: tuple
    default: Any
    doc: str
    check: Callable[[Any], str | None] | None = None  # returns a problem or None


def _at_least(low: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be >= {low}, got {v}"


def _one_of(*allowed: Any) -> Callable[[Any], str | None]:
    return lambda v: None if v in allowed else f"must be one of {list(allowed)}, got {v!r}"


def _in_range(low: int, high: int) -> Callable[[Any], str | None]:
    return lambda v: None if low <= v <= high else f"must be between {low} and {high}, got {v}"


_ANY = (object,)
_BOOL = (bool,)
_INT = (int,)
_STR = (str,)
