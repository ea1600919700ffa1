"""ort_trainer: train PyTorch models with ONNX Runtime.

The public surface (api.md section 1)::

    from ort_trainer import ORTTrainer, ORTTrainerOptions, TrainStepInfo, IODescription, ModelDescription
    from ort_trainer.optim import SGDConfig, AdamConfig, LambConfig, lr_scheduler
    from ort_trainer.amp import LossScaler, DynamicLossScaler
"""

__version__ = "0.1.0"

from . import _logging  # noqa: F401  (configures logging before ONNX Runtime is used)
from . import amp, optim
from .model_desc import IODescription, ModelDescription
from .options import ORTTrainerOptions
from .trainer import ORTTrainer, TrainStepInfo

__all__ = [
    "IODescription",
    "ModelDescription",
    "ORTTrainer",
    "ORTTrainerOptions",
    "TrainStepInfo",
    "amp",
    "optim",
    "__version__",
]
