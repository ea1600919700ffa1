"""state_dict layout (api.md section 2)."""

import numpy as np
import torch

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.optim import AdamConfig, LambConfig, SGDConfig

CE = torch.nn.functional.cross_entropy
WEIGHTS = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def _trained(config, steps=3):
    trainer = ORTTrainer(MLP(), MLP_DESC, config, loss_fn=CE)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        trainer.train_step(*mlp_batch(gen))
    return trainer


def test_adam_state_dict_layout():
    state = _trained(AdamConfig()).state_dict()
    assert set(state) == {"model", "optimizer", "trainer_options", "train_step_info"}
    assert set(state["model"]["full_precision"]) == WEIGHTS
    assert set(state["optimizer"]) == WEIGHTS
    for name, entry in state["optimizer"].items():
        assert set(entry) == {"Moment_1", "Moment_2", "Update_Count"}
        assert entry["Moment_1"].shape == state["model"]["full_precision"][name].shape
        assert int(entry["Update_Count"]) == 3
        assert np.abs(entry["Moment_2"]).sum() > 0
    assert state["train_step_info"] == {"step": 3, "optimization_step": 3}
    assert state["trainer_options"]["optimizer_name"] == "AdamOptimizer"


def test_lamb_has_a_shared_step_and_sgd_has_no_moments():
    lamb = _trained(LambConfig(), steps=2).state_dict()
    assert int(lamb["optimizer"]["shared_optimizer_state"]["Step"]) == 2
    sgd = _trained(SGDConfig()).state_dict()
    assert all(set(entry) == {"Update_Count"} for entry in sgd["optimizer"].values())
