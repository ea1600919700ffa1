"""The legacy constructor trains exactly like the options-object API."""

import numpy as np
import torch

from models import MLP, clone, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.legacy import IODescription, ModelDescription
from ort_trainer.legacy import ORTTrainer as LegacyORTTrainer
from ort_trainer.optim import LambConfig
from ort_trainer.optim.lr_scheduler import LinearWarmupLRScheduler

CE = torch.nn.functional.cross_entropy


def _desc():
    return ModelDescription([IODescription("x", ["batch", 20], torch.float32), IODescription("label", ["batch"], torch.int64)],
                            [IODescription("loss", [], torch.float32), IODescription("logits", ["batch", 5], torch.float32)])


def test_legacy_lamb_script_trains_like_the_options_api():
    model = MLP()
    scheduler = LinearWarmupLRScheduler(total_steps=12, warmup=0.25)

    def map_optimizer_attributes(name):
        no_decay = "bias" in name
        return {"alpha": 0.9, "beta": 0.999, "lambda": 0.0 if no_decay else 0.01, "epsilon": 1e-6}

    legacy = LegacyORTTrainer(clone(model), CE, _desc(), "LambOptimizer", map_optimizer_attributes,
                              IODescription("Learning_Rate", [1], torch.float32), torch.device("cpu"),
                              gradient_accumulation_steps=2)
    modern = ORTTrainer(model, _desc(), LambConfig(lr=2e-2, lambda_coef=0.01, params=[
        {"params": ["fc1.bias", "fc2.bias"], "lambda_coef": 0.0}]), loss_fn=CE,
        options={"batch": {"gradient_accumulation_steps": 2}, "lr_scheduler": scheduler})
    gen = torch.Generator().manual_seed(0)
    for step in range(24):
        x, y = mlp_batch(gen)
        lr = 2e-2 * scheduler.get_lr_at(step // 2, 1.0)  # the learning rate the script feeds
        a = legacy.train_step(x, y, torch.tensor([lr]))[0].item()
        b = modern.train_step(x, y)[0].item()
        assert a == b
    assert legacy.global_step == modern._train_step_info.optimization_step == 12
    for name, value in modern.state_dict()["model"]["full_precision"].items():
        np.testing.assert_array_equal(legacy.state_dict()["model"]["full_precision"][name], value)


def test_legacy_rejects_an_unknown_optimizer_and_a_missing_learning_rate():
    import pytest

    with pytest.raises(ValueError, match="training_optimizer_name: expected one of"):
        LegacyORTTrainer(MLP(), CE, _desc(), "AdagradOptimizer", lambda n: {}, IODescription("lr", [1]), "cpu")
    trainer = LegacyORTTrainer(MLP(), CE, _desc(), "SGDOptimizer", lambda n: {}, IODescription("lr", [1]), "cpu")
    with pytest.raises(ValueError, match="takes the 2 model inputs and then the learning rate"):
        trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
