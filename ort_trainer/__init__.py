"""ort_trainer: train PyTorch models with ONNX Runtime.

The public surface (api.md section 1):

    from ort_trainer import ORTTrainer, ORTTrainerOptions, TrainStepInfo, IODescription, ModelDescription
    from ort_trainer import StepError  # an ONNX Runtime error inside a step, in the user's terms
    from ort_trainer.optim import SGDConfig, AdamConfig, LambConfig, lr_scheduler
    from ort_trainer.amp import LossScaler, DynamicLossScaler

``ort_trainer.__version__`` is the package's version.
"""

from ._version import __version__

from . import _runtime

# First, before anything imports onnxruntime: none, two, or a damaged one is an ImportError
# that says what to install or uninstall.
_runtime.check_runtime()

from . import _logging  # noqa: E402, F401  (configures logging before ONNX Runtime is used)
from . import amp, optim  # noqa: E402
from .model_desc import IODescription, ModelDescription  # noqa: E402
from .options import ORTTrainerOptions  # noqa: E402
from ._run_errors import StepError  # noqa: E402
from .trainer import ORTTrainer, TrainStepInfo  # noqa: E402

__all__ = [
    "IODescription",
    "ModelDescription",
    "ORTTrainer",
    "ORTTrainerOptions",
    "StepError",
    "TrainStepInfo",
    "amp",
    "optim",
    "__version__",
]
