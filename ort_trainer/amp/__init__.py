"""Mixed precision: loss scalers, and the error for a half-precision kernel ONNX Runtime lacks."""

from .kernels import MissingKernelError
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "LossScaler", "MissingKernelError"]
