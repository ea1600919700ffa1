"""state_dict layout (api.md section 2); load_state_dict names every problem and is all-or-nothing."""

import io

import numpy as np
import onnx
import pytest
import torch

from models import MLP_DESC, MLPWithLoss, mlp_batch
from ort_trainer import ORTTrainer
from state_helpers import assert_unchanged, snapshot, trained_mlp
from ort_trainer.optim import AdamConfig, LambConfig, SGDConfig

CE = torch.nn.functional.cross_entropy
WEIGHTS = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}




def test_adam_state_dict_layout():
    trainer = trained_mlp(config=AdamConfig())
    state = trainer.state_dict()
    assert set(state) == {"model", "optimizer", "trainer_options", "train_step_info"}
    assert set(state["model"]["full_precision"]) == WEIGHTS
    assert set(state["optimizer"]) == WEIGHTS
    for name, entry in state["optimizer"].items():
        assert set(entry) == {"Moment_1", "Moment_2", "Update_Count"}
        assert entry["Moment_1"].shape == state["model"]["full_precision"][name].shape
        assert int(entry["Update_Count"]) == 3
        assert np.abs(entry["Moment_2"]).sum() > 0
    assert state["train_step_info"] == {"step": 3, "optimization_step": 3, "seed": trainer._seed}
    assert state["trainer_options"]["optimizer_name"] == "AdamOptimizer"


def test_lamb_has_a_shared_step_and_sgd_has_no_moments():
    lamb = trained_mlp(config=LambConfig(), steps=2).state_dict()
    assert int(lamb["optimizer"]["shared_optimizer_state"]["Step"]) == 2
    sgd = trained_mlp(config=SGDConfig()).state_dict()
    assert all(set(entry) == {"Update_Count"} for entry in sgd["optimizer"].values())






@pytest.mark.parametrize("built", [False, True], ids=["before-the-first-step", "after"])
def test_strict_loading_names_every_missing_and_unexpected_key_in_both_formats(built):
    trainer = trained_mlp(config=AdamConfig(), steps=2 if built else 0)
    before = snapshot(trainer)
    nested = trainer.state_dict()
    weights = nested["model"]["full_precision"]
    del weights["fc1.bias"], weights["fc2.weight"]
    weights["fc3.weight"], weights["head.bias"] = np.zeros(3, np.float32), np.zeros(2, np.float32)
    flat = trainer.state_dict(pytorch_format=True)
    del flat["fc1.bias"], flat["fc2.weight"]
    flat["fc3.weight"], flat["head.bias"] = torch.zeros(3), torch.zeros(2)
    for state in (nested, flat):
        with pytest.raises(ValueError) as info:
            trainer.load_state_dict(state)
        for expected in ("missing weight 'fc1.bias'", "missing weight 'fc2.weight'",
                         "unexpected weight 'fc3.weight'", "unexpected weight 'head.bias'"):
            assert expected in str(info.value)
        assert_unchanged(trainer, before)


@pytest.mark.parametrize("built", [False, True], ids=["before-the-first-step", "after"])
def test_a_value_that_cannot_be_loaded_changes_nothing(built):
    trainer = trained_mlp(config=AdamConfig(), steps=2 if built else 0)
    before = snapshot(trainer)
    flat = {k: torch.full_like(v, 7.0) for k, v in trainer.state_dict(pytorch_format=True).items()}
    flat["fc2.bias"] = np.array(["not a number"] * 5)  # the last key: the others would load first
    with pytest.raises(ValueError, match="weight 'fc2.bias': dtype <U12 in the state, a float dtype in the model"):
        trainer.load_state_dict(flat)
    assert_unchanged(trainer, before)
    nested = trainer.state_dict()
    nested["model"]["full_precision"] = {k: v + 1 for k, v in nested["model"]["full_precision"].items()}
    nested["train_step_info"] = {"step": 9}  # no optimization_step
    nested["extra"] = {}
    with pytest.raises(ValueError) as info:
        trainer.load_state_dict(nested)
    assert "has 'step' but not the other of 'step' and 'optimization_step'" in str(info.value)
    assert "unexpected key 'extra'" in str(info.value)
    assert_unchanged(trainer, before)


class BatchNormNet(torch.nn.Module):
    """An MLP with BatchNorm (a step counter) and a layer the forward pass never uses."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 5)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def test_a_state_taken_before_the_first_step_loads_after_it():
    model = BatchNormNet()
    model.bn.num_batches_tracked.fill_(10)
    state = ORTTrainer(model, MLP_DESC, SGDConfig(), loss_fn=CE).state_dict()  # counters, unused layers
    assert "bn.num_batches_tracked" in state["model"]["full_precision"]
    target = ORTTrainer(BatchNormNet(), MLP_DESC, SGDConfig(), loss_fn=CE)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        target.train_step(*mlp_batch(gen))
    target.load_state_dict(state)
    loaded = target.state_dict(pytorch_format=True)
    assert target._train_step_info.step == 0
    for key, value in state["model"]["full_precision"].items():
        np.testing.assert_array_equal(loaded[key].numpy(), value, err_msg=key)
    assert int(loaded["bn.num_batches_tracked"]) == 10
    target.train_step(*mlp_batch(gen))
    assert int(target.state_dict(pytorch_format=True)["bn.num_batches_tracked"]) == 11


def _onnx_model():
    buffer = io.BytesIO()
    torch.onnx.export(
        MLPWithLoss(), (torch.randn(3, 20), torch.randint(0, 5, (3,))), buffer, dynamo=False,
        training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, opset_version=17,
        input_names=["x", "label"], output_names=["loss", "logits"],
        dynamic_axes={"x": {0: "batch"}, "label": {0: "batch"}, "logits": {0: "batch"}})
    return onnx.load_from_string(buffer.getvalue())


def test_an_onnx_model_loads_states_before_and_after_the_first_step(tmp_path):
    model = _onnx_model()
    source = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        source.train_step(*mlp_batch(gen))
    fresh = ORTTrainer(_onnx_model(), MLP_DESC, AdamConfig(lr=1e-2))  # other initial weights
    fresh.load_state_dict(source.state_dict(pytorch_format=True))     # before its first step
    for name, value in source.state_dict()["model"]["full_precision"].items():
        np.testing.assert_array_equal(fresh.state_dict()["model"]["full_precision"][name], value)
    path = tmp_path / "onnx.h5"
    source.save_checkpoint(path)
    built = ORTTrainer(_onnx_model(), MLP_DESC, AdamConfig(lr=1e-2))
    built.train_step(*mlp_batch(gen))
    built.load_checkpoint(path)
    batch = mlp_batch(gen)
    assert built.train_step(*batch)[0].item() == source.train_step(*batch)[0].item()
    broken = source.state_dict()
    weights = broken["model"]["full_precision"]
    weights.pop(sorted(weights)[0])
    weights["nope"] = np.zeros(1, np.float32)
    with pytest.raises(ValueError) as info:
        built.load_state_dict(broken)
    assert f"missing weight {sorted(source.state_dict()['model']['full_precision'])[0]!r}" in str(info.value)
    assert "unexpected weight 'nope'" in str(info.value)
