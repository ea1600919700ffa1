"""Optimizer configurations and learning-rate schedulers."""

from . import lr_scheduler
from .config import AdamConfig, DecayMode, LambConfig, SGDConfig

__all__ = ["AdamConfig", "DecayMode", "LambConfig", "SGDConfig", "lr_scheduler"]
