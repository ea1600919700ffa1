"""Helpers shared by the state tests: a trained MLP trainer and bitwise snapshots of its whole state."""

import numpy as np
import torch

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.optim import AdamConfig


def trained_mlp(steps: int = 3, model=None, config=None) -> ORTTrainer:
    """An ORTTrainer over ``model`` (default: a fresh MLP) after ``steps`` steps on fixed batches."""
    trainer = ORTTrainer(model or MLP(), MLP_DESC, config or AdamConfig(lr=1e-2),
                         loss_fn=torch.nn.functional.cross_entropy)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        trainer.train_step(*mlp_batch(gen))
    return trainer


def snapshot(trainer: ORTTrainer) -> dict[str, np.ndarray]:
    """Copies of everything a load may change: weights and buffers (both formats), moments, counters, seed."""
    flat = {f"t/{k}": v.numpy().copy() for k, v in trainer.state_dict(pytorch_format=True).items()}
    state = trainer.state_dict()
    flat.update({f"w/{k}": v.copy() for k, v in state["model"]["full_precision"].items()})
    flat.update({f"o/{k}/{s}": np.array(v) for k, e in state["optimizer"].items() for s, v in e.items()})
    flat["info"] = np.array([state["train_step_info"].get(k, -1) for k in ("step", "optimization_step", "seed")])
    return flat


def assert_unchanged(trainer: ORTTrainer, before: dict[str, np.ndarray]) -> None:
    """Assert the trainer's state is bitwise what ``snapshot`` recorded."""
    after = snapshot(trainer)
    assert after.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
