"""Warmup learning-rate schedulers (api.md section 6).

``s`` is the optimization step, ``T`` ``total_steps`` and ``W = warmup * T``. During warmup
(``s < W``) every scheduler returns ``lr * s / max(1, W)``; after it, each class's own formula.
The trainer evaluates the scheduler at the current ``optimization_step`` before it is
incremented and feeds the value to the optimizer graph as an input, so the graph is never
rebuilt. A parameter group's own ``lr`` is scaled by ``value / base lr``.
"""

from __future__ import annotations

import math


class _LRScheduler:
    """Base class: subclasses implement ``_after_warmup(s, lr)``."""

    def __init__(self, total_steps: int, warmup: float = 0.002):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"{type(self).__name__}.total_steps: expected a positive int, got {total_steps!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup <= 1:
            raise ValueError(f"{type(self).__name__}.warmup: expected a float in [0, 1], got {warmup!r}")
        self.total_steps = total_steps
        self.warmup = float(warmup)
        self.base_lr: float | None = None
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
        """Restore a state from ``state_dict()``."""
        self._last_lr = list(state.get("last_lr", []))
        self.base_lr = state.get("base_lr")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k != "base_lr")
        return f"{type(self).__name__}({fields})"


class ConstantWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then the constant base learning rate."""

    def __init__(self, total_steps: int, warmup: float = 0.002):
        super().__init__(total_steps, warmup)

    def _after_warmup(self, step: int, lr: float) -> float:
        return lr


class CosineWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then ``lr * max(0, (1 + cos(2π · cycles · p)) / 2)``."""

    def __init__(self, total_steps: int, cycles: float = 0.5, warmup: float = 0.002):
        super().__init__(total_steps, warmup)
        if isinstance(cycles, bool) or not isinstance(cycles, (int, float)) or cycles < 0:
            raise ValueError(f"CosineWarmupLRScheduler.cycles: expected a float >= 0, got {cycles!r}")
        self.cycles = float(cycles)

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
        super().__init__(total_steps, warmup)
        for name, value in (("lr_end", lr_end), ("power", power)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"PolyWarmupLRScheduler.{name}: expected a float, got {value!r}")
        self.lr_end = float(lr_end)
        self.power = float(power)

    def _after_warmup(self, step: int, lr: float) -> float:
        if step > self.total_steps:
            return self.lr_end
        return (lr - self.lr_end) * (1.0 - self._progress(step)) ** self.power + self.lr_end
