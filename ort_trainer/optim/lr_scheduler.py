"""Warmup learning-rate schedulers (api.md section 6).

``s`` is the optimization step, ``T`` ``total_steps`` and ``W = warmup * T``. During warmup
(``s < W``) every scheduler returns ``lr * s / max(1, W)``; after it, each class's own formula.
The trainer evaluates the scheduler at the current ``optimization_step`` before it is
incremented and feeds the value to the optimizer graph as an input, so the graph is never
rebuilt. A parameter group's own ``lr`` is scaled by ``value / base lr``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import numpy as np


def _number_problem(where: str, value: Any, expected: str, low: float | None = None, high: float = math.inf,
                    integer: bool = False) -> list[str]:
    """``[problem]`` when ``value`` is not a finite number (an int when ``integer``) in [low, high]."""
    types = (int,) if integer else (int, float)
    ok = (not isinstance(value, bool) and isinstance(value, types) and math.isfinite(value)
          and (low is None or low <= value <= high))
    return [] if ok else [f"{where}: expected {expected}, got {value!r}"]


class _LRScheduler:
    """Base class: subclasses implement ``_after_warmup(s, lr)``."""

    def __init__(self, total_steps: int, warmup: float = 0.002, **more: tuple):
        name = type(self).__name__
        problems = _number_problem(f"{name}.total_steps", total_steps, "a positive int", 1, integer=True)
        problems += _number_problem(f"{name}.warmup", warmup, "a float in [0, 1]", 0, 1)
        for key, (value, low) in more.items():
            expected = "a finite float" if low is None else f"a float >= {low}"
            problems += _number_problem(f"{name}.{key}", value, expected, low)
        if problems:
            raise ValueError(f"invalid {name}:\n  " + "\n  ".join(problems))
        self.total_steps = total_steps
        """``T``: the optimization steps the schedule spans."""
        self.warmup = float(warmup)
        """The warmup's share of ``total_steps``: ``W = warmup * T``."""
        for key, (value, _) in more.items():
            setattr(self, key, float(value))
        self.base_lr: float | None = None
        """The base learning rate of the last step (None before the first)."""
        self._last_lr: list[float] = []

    @property
    def _warmup_steps(self) -> float:
        return self.warmup * self.total_steps

    def get_lr_at(self, step: int, lr: float) -> float:
        """The learning rate at optimization step ``step`` for base learning rate ``lr``."""
        warmup_steps = self._warmup_steps
        if step < warmup_steps:
            return lr * step / max(1.0, warmup_steps)
        return self._after_warmup(step, lr)

    def _progress(self, step: int) -> float:
        warmup_steps = self._warmup_steps
        return (step - warmup_steps) / max(1.0, self.total_steps - warmup_steps)

    def _after_warmup(self, step: int, lr: float) -> float:
        raise NotImplementedError

    def _step(self, optimization_step: int, base_lr: float) -> float:
        """Called by the trainer once per ``train_step``; returns the learning rate to use."""
        self.base_lr = base_lr
        value = self.get_lr_at(optimization_step, base_lr)
        self._last_lr = [value]
        return value

    def get_last_lr(self) -> list[float]:
        """``[value]``: the learning rate of the last step (empty before the first)."""
        return list(self._last_lr)

    def state_dict(self) -> dict:
        """The scheduler's state (for checkpoints)."""
        return {"last_lr": list(self._last_lr), "base_lr": self.base_lr}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state from ``state_dict()``.

        Raises:
            ValueError: when ``state`` is not such a state (nothing is changed then).
        """
        problems = _state_problems(type(self).__name__, state)
        if problems:
            raise ValueError(f"{type(self).__name__}.load_state_dict: not a scheduler state:\n  "
                             + "\n  ".join(problems))
        self._last_lr = [float(v) for v in state.get("last_lr", [])]
        base = state.get("base_lr")
        self.base_lr = None if base is None else float(base)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k != "base_lr")
        return f"{type(self).__name__}({fields})"


def _state_problems(name: str, state: Any) -> list[str]:
    """Every way ``state`` differs from what ``_LRScheduler.state_dict()`` returns."""
    if not isinstance(state, Mapping):
        return [f"expected a dict with 'last_lr' and 'base_lr', got {type(state).__name__}"]
    problems = [f"{key!r}: unknown key; expected 'last_lr' and 'base_lr'" for key in state
                if key not in ("last_lr", "base_lr")]
    last = state.get("last_lr", [])
    if not isinstance(last, (list, tuple, np.ndarray)) or np.ndim(last) != 1 or any(
            isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) for v in last):
        problems.append(f"'last_lr': expected a list of finite numbers, got {last!r}")
    base = state.get("base_lr")
    if base is not None and (isinstance(base, bool) or not isinstance(base, numbers.Real) or not math.isfinite(base)):
        problems.append(f"'base_lr': expected a finite number or None, got {base!r}")
    return problems


class ConstantWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then the constant base learning rate."""

    def __init__(self, total_steps: int, warmup: float = 0.002):
        super().__init__(total_steps, warmup)

    def _after_warmup(self, step: int, lr: float) -> float:
        return lr


class CosineWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then ``lr * max(0, (1 + cos(2π · cycles · p)) / 2)``."""

    def __init__(self, total_steps: int, cycles: float = 0.5, warmup: float = 0.002):
        super().__init__(total_steps, warmup, cycles=(cycles, 0))

    def _after_warmup(self, step: int, lr: float) -> float:
        return lr * max(0.0, 0.5 * (1.0 + math.cos(2.0 * math.pi * self.cycles * self._progress(step))))


class LinearWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then linear decay to 0 at ``total_steps``."""

    def __init__(self, total_steps: int, warmup: float = 0.002):
        super().__init__(total_steps, warmup)

    def _after_warmup(self, step: int, lr: float) -> float:
        return lr * max(0.0, (self.total_steps - step) / max(1.0, self.total_steps - self._warmup_steps))


class PolyWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then polynomial decay from ``lr`` to ``lr_end``."""

    def __init__(self, total_steps: int, lr_end: float = 1e-7, power: float = 1.0, warmup: float = 0.002):
        super().__init__(total_steps, warmup, lr_end=(lr_end, 0), power=(power, None))

    def _after_warmup(self, step: int, lr: float) -> float:
        if step > self.total_steps:
            return self.lr_end
        return (lr - self.lr_end) * (1.0 - self._progress(step)) ** self.power + self.lr_end
