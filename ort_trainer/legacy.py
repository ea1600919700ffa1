"""The pre-options constructor, for scripts written against ONNX Runtime's first ORTTrainer.

    from ort_trainer.legacy import ORTTrainer, IODescription, ModelDescription
    trainer = ORTTrainer(model, loss_fn, model_desc, "LambOptimizer", map_optimizer_attributes,
                         IODescription("Learning_Rate", [1], torch.float32), device,
                         gradient_accumulation_steps=2, world_rank=0, world_size=1)
    loss = trainer.train_step(input_ids, labels, torch.tensor([lr]))

Mapped onto the same engine as ``ort_trainer.ORTTrainer``: ``map_optimizer_attributes(name)``
gives each weight's hyper-parameters (``alpha``, ``beta``, ``lambda``, ``epsilon``), weights with
the same ones form a parameter group, and the learning rate arrives as the last input of every
``train_step`` (the tensor ``learning_rate_description`` describes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .model_desc import IODescription, ModelDescription
from .optim import AdamConfig, LambConfig, SGDConfig
from .optim.lr_scheduler import _LRScheduler
from .trainer import ORTTrainer as _Trainer

__all__ = ["IODescription", "ModelDescription", "ORTTrainer"]

_OPTIMIZERS = {"LambOptimizer": LambConfig, "AdamOptimizer": AdamConfig, "SGDOptimizer": SGDConfig}
# legacy attribute name -> config hyper-parameter
_ATTRIBUTES = {"alpha": "alpha", "beta": "beta", "lambda": "lambda_coef", "epsilon": "epsilon",
               "ratio_min": "ratio_min", "ratio_max": "ratio_max", "do_bias_correction": "do_bias_correction",
               "weight_decay_mode": "weight_decay_mode"}


class _FedLearningRate(_LRScheduler):
    """A 'scheduler' whose value is the learning rate fed to the current ``train_step``."""

    def __init__(self):
        super().__init__(total_steps=1, warmup=0.0)
        self.value = 0.0

    def get_lr_at(self, step: int, lr: float) -> float:
        """The learning rate fed to the current step, whatever the step."""
        return self.value


class ORTTrainer:
    """The legacy constructor (ONNX Runtime 1.x ``ORTTrainer``), on ort_trainer's engine.

    Args:
        model: the torch module.
        loss_fn: ``loss_fn(prediction, label)`` or None when the model returns its loss.
        model_desc: a ``ModelDescription`` (the learning rate is not part of it).
        training_optimizer_name: ``"LambOptimizer"``, ``"AdamOptimizer"`` or ``"SGDOptimizer"``.
        map_optimizer_attributes: ``weight name -> {"alpha", "beta", "lambda", "epsilon", ...}``.
        learning_rate_description: ``IODescription`` of the learning-rate input (shape ``[1]``).
        device: ``torch.device`` or string (``"cpu"``).
        gradient_accumulation_steps, world_rank, world_size, allreduce_post_accumulation,
        use_mixed_precision, loss_scaler, enable_grad_norm_clip, frozen_weights,
        deepspeed_zero_stage, _opset_version, _extra_postprocess: as the matching
        ``ORTTrainerOptions`` keys.
        get_lr_this_step: optional ``step -> lr``; then ``train_step`` takes no learning-rate input.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Callable | None,
        model_desc: ModelDescription,
        training_optimizer_name: str,
        map_optimizer_attributes: Callable[[str], dict],
        learning_rate_description: IODescription,
        device: Any,
        gradient_accumulation_steps: int = 1,
        world_rank: int = 0,
        world_size: int = 1,
        use_mixed_precision: bool = False,
        allreduce_post_accumulation: bool = False,
        global_step: int = 0,
        get_lr_this_step: Callable[[int], float] | None = None,
        loss_scaler: Any = None,
        deepspeed_zero_stage: int = 0,
        enable_grad_norm_clip: bool = True,
        frozen_weights: list[str] | None = None,
        _opset_version: int = 17,
        _extra_postprocess: Callable | None = None,
        _use_deterministic_compute: bool = False,
    ):
        if training_optimizer_name not in _OPTIMIZERS:
            raise ValueError(f"training_optimizer_name: expected one of {sorted(_OPTIMIZERS)}, "
                             f"got {training_optimizer_name!r}")
        if not isinstance(learning_rate_description, IODescription):
            raise TypeError("learning_rate_description: expected an IODescription (e.g. "
                            "IODescription('Learning_Rate', [1], torch.float32))")
        config_cls = _OPTIMIZERS[training_optimizer_name]
        groups: dict[tuple, list[str]] = {}
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for name in names:
            attributes = dict(map_optimizer_attributes(name) or {})
            unknown = set(attributes) - set(_ATTRIBUTES)
            if unknown:
                raise ValueError(f"map_optimizer_attributes({name!r}): unknown attributes {sorted(unknown)}")
            allowed = {_ATTRIBUTES[k]: v for k, v in attributes.items() if _ATTRIBUTES[k] in config_cls._HYPER}
            groups.setdefault(tuple(sorted(allowed.items())), []).append(name)
        params = [{"params": weights, **dict(key)} for key, weights in groups.items()]
        optim_config = config_cls(params=params, lr=1.0)  # the fed learning rate replaces it each step
        self._fed_lr = _FedLearningRate()
        self._get_lr_this_step = get_lr_this_step
        self.learning_rate_description = learning_rate_description
        device_id = str(device.type if isinstance(device, torch.device) else device)
        options = {
            "device": {"id": "cpu" if device_id.startswith("cpu") else device_id},
            "batch": {"gradient_accumulation_steps": gradient_accumulation_steps},
            "distributed": {"world_rank": world_rank, "world_size": world_size,
                            "allreduce_post_accumulation": allreduce_post_accumulation,
                            "deepspeed_zero_optimization": {"stage": deepspeed_zero_stage}},
            "lr_scheduler": self._fed_lr,
            "mixed_precision": {"enabled": use_mixed_precision, "loss_scaler": loss_scaler},
            "utils": {"grad_norm_clip": enable_grad_norm_clip, "frozen_weights": list(frozen_weights or [])},
            "debug": {"deterministic_compute": _use_deterministic_compute},
            "_internal_use": {"onnx_opset_version": _opset_version, "extra_postprocess": _extra_postprocess},
        }
        self._trainer = _Trainer(model, model_desc, optim_config, loss_fn=loss_fn, options=options)
        self._trainer._train_step_info.optimization_step = global_step
        self.model_desc = self._trainer.model_desc

    @property
    def global_step(self) -> int:
        """Optimizer updates applied so far."""
        return self._trainer._train_step_info.optimization_step

    def train_step(self, *inputs: Any):
        """One training step; the last input is the learning rate (unless ``get_lr_this_step``)."""
        if self._get_lr_this_step is not None:
            lr = self._get_lr_this_step(self.global_step)
        else:
            if len(inputs) != len(self.model_desc.inputs) + 1:
                raise ValueError(f"train_step takes the {len(self.model_desc.inputs)} model inputs and then the "
                                 f"learning rate ({self.learning_rate_description.name}); got {len(inputs)} values")
            *inputs, lr = inputs
            lr = float(torch.as_tensor(lr).reshape(-1)[0])
        self._fed_lr.value = lr
        return self._trainer.train_step(*inputs)

    def eval_step(self, *inputs: Any):
        """Forward only; a trailing learning-rate input is accepted and ignored."""
        if len(inputs) == len(self.model_desc.inputs) + 1:
            inputs = inputs[:-1]
        return self._trainer.eval_step(*inputs)

    def save_as_onnx(self, path: str) -> None:
        """Write the inference model (see ``ort_trainer.ORTTrainer.save_as_onnx``)."""
        self._trainer.save_as_onnx(path)

    def state_dict(self, pytorch_format: bool = False) -> dict:
        """The state (see ``ort_trainer.ORTTrainer.state_dict``)."""
        return self._trainer.state_dict(pytorch_format)

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Restore a state (see ``ort_trainer.ORTTrainer.load_state_dict``)."""
        return self._trainer.load_state_dict(state_dict, strict)
