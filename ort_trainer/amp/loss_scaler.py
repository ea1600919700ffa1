"""Loss scalers for mixed-precision training (api.md section 7)."""

from __future__ import annotations


class LossScaler:
    """Base class of loss scalers: holds ``loss_scale`` and updates it after each optimizer step.

    Args:
        loss_scale: the initial scale.
    """

    def __init__(self, loss_scale: float):
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or loss_scale <= 0:
            raise ValueError(f"{type(self).__name__}.loss_scale: expected a positive number, got {loss_scale!r}")
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

    def load_state_dict(self, state: dict) -> None:
        """Restore a state from ``state_dict()``."""
        self.loss_scale = float(state["loss_scale"])


class DynamicLossScaler(LossScaler):
    """Doubles the scale after ``up_scale_window`` finite steps, halves it on a non-finite one.

    Args:
        automatic_update: update the scale after each step (False: keep it fixed).
        loss_scale: initial scale.
        up_scale_window: consecutive finite steps before doubling.
        min_loss_scale: floor of the scale.
        max_loss_scale: cap of the scale.
    """

    def __init__(
        self,
        automatic_update: bool = True,
        loss_scale: float = float(1 << 16),
        up_scale_window: int = 2000,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = float(1 << 24),
    ):
        super().__init__(loss_scale)
        if isinstance(up_scale_window, bool) or not isinstance(up_scale_window, int) or up_scale_window < 1:
            raise ValueError(f"DynamicLossScaler.up_scale_window: expected a positive int, got {up_scale_window!r}")
        if not 0 < min_loss_scale <= max_loss_scale:
            raise ValueError(
                f"DynamicLossScaler: need 0 < min_loss_scale <= max_loss_scale, got {min_loss_scale}, {max_loss_scale}"
            )
        self.automatic_update = bool(automatic_update)
        self.up_scale_window = up_scale_window
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

    def load_state_dict(self, state: dict) -> None:
        """Restore a state from ``state_dict()``."""
        super().load_state_dict(state)
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
