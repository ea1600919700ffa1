"""Loss scalers for mixed-precision training (api.md section 7)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping


def _positive_problem(where: str, value: Any, integer: bool = False) -> list[str]:
    """``[problem]`` when ``value`` is not a finite positive number (an int when ``integer``)."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value <= 0:
        return [f"{where}: expected a positive {'int' if integer else 'number'}, got {value!r}"]
    return []


class LossScaler:
    """Base class of loss scalers: holds ``loss_scale`` and updates it after each optimizer step.

    Args:
        loss_scale: the initial scale.

    Raises:
        ValueError: when ``loss_scale`` is not a finite positive number.
    """

    def __init__(self, loss_scale: float):
        problems = _positive_problem(f"{type(self).__name__}.loss_scale", loss_scale)
        if problems:
            raise ValueError(problems[0])
        self._initial_loss_scale = float(loss_scale)
        self.loss_scale = float(loss_scale)

    def reset(self) -> None:
        """Restore the initial scale."""
        self.loss_scale = self._initial_loss_scale

    def update(self, train_step_info) -> float:
        """Update the scale from the step's ``TrainStepInfo`` and return the new scale."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The scaler's state (for checkpoints)."""
        return {"loss_scale": self.loss_scale}

    def _state_problems(self, state: Any) -> list[str]:
        """Every way ``state`` differs from what ``state_dict()`` returns."""
        if not isinstance(state, Mapping):
            return [f"expected a dict like {self.state_dict()}, got {type(state).__name__}"]
        problems = [f"{key!r}: unknown key; expected {sorted(self.state_dict())}" for key in state
                    if key not in self.state_dict()]
        if "loss_scale" not in state:
            problems.append("'loss_scale': missing")
        else:
            problems += _positive_problem("'loss_scale'", state["loss_scale"])
        return problems

    def load_state_dict(self, state: dict) -> None:
        """Restore a state from ``state_dict()``.

        Raises:
            ValueError: when ``state`` is not such a state (nothing is changed then).
        """
        problems = self._state_problems(state)
        if problems:
            raise ValueError(f"{type(self).__name__}.load_state_dict: not a loss-scaler state:\n  "
                             + "\n  ".join(problems))
        self._apply_state(state)

    def _apply_state(self, state: Mapping) -> None:
        self.loss_scale = float(state["loss_scale"])


class DynamicLossScaler(LossScaler):
    """Doubles the scale after ``up_scale_window`` finite steps, halves it on a non-finite one.

    Args:
        automatic_update: update the scale after each step (False: keep it fixed).
        loss_scale: initial scale.
        up_scale_window: consecutive finite steps before doubling.
        min_loss_scale: floor of the scale.
        max_loss_scale: cap of the scale.

    Raises:
        ValueError: listing every argument that is out of range.
    """

    def __init__(
        self,
        automatic_update: bool = True,
        loss_scale: float = float(1 << 16),
        up_scale_window: int = 2000,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = float(1 << 24),
    ):
        name = type(self).__name__
        problems = _positive_problem(f"{name}.loss_scale", loss_scale)
        problems += _positive_problem(f"{name}.up_scale_window", up_scale_window, integer=True)
        problems += _positive_problem(f"{name}.min_loss_scale", min_loss_scale)
        problems += _positive_problem(f"{name}.max_loss_scale", max_loss_scale)
        if not isinstance(automatic_update, bool):
            problems.append(f"{name}.automatic_update: expected a bool, got {automatic_update!r}")
        if not problems and not min_loss_scale <= max_loss_scale:
            problems.append(f"{name}: need min_loss_scale <= max_loss_scale, got {min_loss_scale}, {max_loss_scale}")
        if problems:
            raise ValueError(f"invalid {name}:\n  " + "\n  ".join(problems))
        super().__init__(loss_scale)
        self.automatic_update = automatic_update
        self.up_scale_window = int(up_scale_window)
        self.min_loss_scale = float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        self._stable_steps = 0

    def reset(self) -> None:
        """Restore the initial scale and the finite-step counter."""
        super().reset()
        self._stable_steps = 0

    def state_dict(self) -> dict:
        """The scale and the count of finite steps since the last change."""
        return {"loss_scale": self.loss_scale, "stable_steps": self._stable_steps}

    def _state_problems(self, state: Any) -> list[str]:
        problems = super()._state_problems(state)
        if isinstance(state, Mapping) and "stable_steps" in state:
            value = state["stable_steps"]
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                problems.append(f"'stable_steps': expected an int >= 0, got {value!r}")
        return problems

    def _apply_state(self, state: Mapping) -> None:
        super()._apply_state(state)
        self._stable_steps = int(state.get("stable_steps", 0))

    def update(self, train_step_info) -> float:
        """Apply one step's outcome (``train_step_info.all_finite``); return the new scale."""
        if not self.automatic_update:
            return self.loss_scale
        if train_step_info.all_finite:
            self._stable_steps += 1
            if self._stable_steps == self.up_scale_window:
                self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2.0)
                self._stable_steps = 0
        else:
            self.loss_scale = max(self.min_loss_scale, self.loss_scale / 2.0)
            self._stable_steps = 0
        return self.loss_scale
