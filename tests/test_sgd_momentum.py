"""SGD with ``torch.optim.SGD``'s momentum, dampening, Nesterov momentum and weight decay (``SGDConfig``): the same
steps as PyTorch's, per parameter group, with each update implementation; a checkpoint resumes them exactly (the
momentum buffer is the optimizer's state ``Momentum``), and impossible settings are refused as torch refuses them.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from models import MLP_DESC, MLPWithLoss
from ort_trainer import ORTTrainer
from ort_trainer.optim import SGDConfig
from tolerances import check, relative_error, steps_bound

STEPS = 6
# Against torch.optim.SGD in float32: each gradient's sums of at most 48 terms (the batch of 16 and the 32 hidden
# units) in another order, carried into the weights once a step; the momentum buffer adds each step's difference
# into every later step at most 1 / (1 - 0.9) = 10 times: steps_bound(6, length=48, factor=10) = 1.7e-4.
# Observed: <= 2.2e-7.
BOUND = steps_bound(STEPS, length=48, factor=10)

_CASES = {
    "momentum": ({"momentum": 0.9}, {"momentum": 0.9}),
    "nesterov": ({"momentum": 0.9, "nesterov": True}, {"momentum": 0.9, "nesterov": True}),
    "dampening": ({"momentum": 0.5, "dampening": 0.3}, {"momentum": 0.5, "dampening": 0.3}),
    "weight decay": ({"weight_decay": 0.05}, {"weight_decay": 0.05}),
    "all, in groups": ({"momentum": 0.9, "weight_decay": 0.01,
                        "params": [{"params": ["mlp.fc2.weight", "mlp.fc2.bias"], "momentum": 0.0},
                                   {"params": ["mlp.fc1.bias"], "nesterov": True, "lr": 0.05}]},
                       {"momentum": 0.9, "weight_decay": 0.01}),
}


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 20, generator=generator), torch.randint(0, 5, (16,), generator=generator))
            for _ in range(STEPS)]


def _torch_groups(model, ours: dict) -> list[dict]:
    """``ours``' parameter groups as torch.optim.SGD's (the weights in no group in the first)."""
    named = dict(model.named_parameters())
    grouped = {name for group in ours.get("params", []) for name in group["params"]}
    groups = [{"params": [p for n, p in named.items() if n not in grouped]}]
    for group in ours.get("params", []):
        groups.append({"params": [named[n] for n in group["params"]],
                       **{k: v for k, v in group.items() if k != "params"}})
    return groups


@pytest.mark.parametrize("implementation", ["graph", "fused"])
@pytest.mark.parametrize("case", list(_CASES))
def test_sgd_takes_torch_optim_sgds_steps(case, implementation):
    ours, theirs = _CASES[case]
    torch.manual_seed(0)
    model = MLPWithLoss()
    reference = copy.deepcopy(model)
    options = {"graph": {"optimizer": implementation}}
    trainer = ORTTrainer(model, MLP_DESC, SGDConfig(lr=0.1, **ours), options=options)
    optimizer = torch.optim.SGD(_torch_groups(reference, ours), lr=0.1, **theirs)
    for step, (x, label) in enumerate(_batches()):
        got = float(trainer.train_step(x, label)[0])
        optimizer.zero_grad()
        expected = reference(x, label)[0]
        expected.backward()
        optimizer.step()
        check(relative_error(got, float(expected)), BOUND, f"{case}: step {step}")
    assert type(trainer._engine.update).name == implementation  # torch's _fused_sgd_ or the ONNX graph
    state = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        check(relative_error(state[name].numpy(), value.numpy()), BOUND, f"{case}: {name}")


def test_a_checkpoint_resumes_the_momentum_exactly(tmp_path):
    ours = {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}
    batches = _batches()
    torch.manual_seed(0)
    model = MLPWithLoss()
    fresh = copy.deepcopy(model)
    uninterrupted = ORTTrainer(model, MLP_DESC, SGDConfig(lr=0.1, **ours))
    losses = [float(uninterrupted.train_step(*batch)[0]) for batch in batches]

    torch.manual_seed(0)
    first = ORTTrainer(copy.deepcopy(fresh), MLP_DESC, SGDConfig(lr=0.1, **ours))
    for batch in batches[:3]:
        first.train_step(*batch)
    first.save_checkpoint(tmp_path / "sgd.ckpt")
    resumed = ORTTrainer(copy.deepcopy(fresh), MLP_DESC, SGDConfig(lr=0.1, **ours))
    resumed.load_checkpoint(tmp_path / "sgd.ckpt")
    assert "Momentum" in resumed.state_dict()["optimizer"]["mlp.fc1.weight"]
    assert [float(resumed.train_step(*batch)[0]) for batch in batches[3:]] == losses[3:]
    for name, value in uninterrupted.state_dict(pytorch_format=True).items():
        np.testing.assert_array_equal(resumed.state_dict(pytorch_format=True)[name].numpy(), value.numpy())


def test_impossible_settings_are_refused_as_torch_refuses_them():
    with pytest.raises(ValueError) as refused:
        SGDConfig(lr=0.1, nesterov=True, params=[{"params": ["w"], "momentum": 0.9, "dampening": 0.5},
                                                 {"params": ["v"], "momentum": -1.0}])
    message = str(refused.value)
    assert "SGDConfig.params[1].momentum: must be >= 0, got -1.0" in message
    assert "SGDConfig: nesterov=True needs a momentum > 0 and dampening=0" in message
    assert "SGDConfig.params[0]: nesterov=True needs a momentum > 0 and dampening=0" in message
