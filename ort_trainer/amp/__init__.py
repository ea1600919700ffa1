"""Mixed precision: loss scalers."""

from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
