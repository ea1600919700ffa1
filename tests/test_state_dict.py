"""state_dict layout (api.md section 2); load_state_dict names every problem and is all-or-nothing."""

import io

import numpy as np
import onnx
import pytest
import torch

from models import MLP, MLP_DESC, MLPWithLoss, clone, mlp_batch
from ort_trainer import ORTTrainer
from state_helpers import assert_unchanged, snapshot, trained_mlp
from ort_trainer.optim import AdamConfig, LambConfig, SGDConfig
from tolerances import steps_bound

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


# ---- strict=False follows torch.nn.Module.load_state_dict ----------------------------------------------
def _edited(state, drop, extra):
    state = dict(state)
    for key in drop:
        del state[key]
    state.update(extra)
    return state


@pytest.mark.parametrize("built", [False, True], ids=["before-the-first-step", "after"])
def test_not_strict_loads_what_fits_and_returns_the_keys_as_torch_does(built):
    """Flat format: the same missing and unexpected keys as torch's ``Module.load_state_dict``, the
    missing weights keep their values, the unexpected ones are ignored, the rest is loaded."""
    trainer = trained_mlp(config=AdamConfig(), steps=2 if built else 0)
    kept = {k: v.clone() for k, v in trainer.state_dict(pytorch_format=True).items()}
    source = {k: v + 1.0 for k, v in kept.items()}
    state = _edited(source, drop=["fc1.bias", "fc2.weight"], extra={"fc3.weight": torch.zeros(3), "head.bias": torch.zeros(2)})

    module = MLP()
    expected = module.load_state_dict(state, strict=False)
    result = trainer.load_state_dict(state, strict=False)
    assert sorted(result.missing_keys) == sorted(expected.missing_keys) == ["fc1.bias", "fc2.weight"]
    assert sorted(result.unexpected_keys) == sorted(expected.unexpected_keys) == ["fc3.weight", "head.bias"]
    got = trainer.state_dict(pytorch_format=True)
    for key in ("fc1.weight", "fc2.bias"):
        torch.testing.assert_close(got[key], source[key], rtol=0, atol=0)  # loaded
    for key in ("fc1.bias", "fc2.weight"):
        torch.testing.assert_close(got[key], kept[key], rtol=0, atol=0)  # missing: kept
    assert trainer.load_state_dict(trainer.state_dict(pytorch_format=True)) == ([], [])  # strict: nothing left out


def test_not_strict_in_the_nested_format_names_weights_and_optimizer_states():
    trainer = trained_mlp(config=AdamConfig(), steps=2)
    before = trainer.state_dict()
    state = trainer.state_dict()
    state["model"]["full_precision"] = {k: v + 1.0 for k, v in state["model"]["full_precision"].items()}
    del state["model"]["full_precision"]["fc2.bias"], state["optimizer"]["fc1.weight"]
    state["model"]["full_precision"]["fc3.weight"] = np.zeros(3, np.float32)
    state["optimizer"]["fc3.weight"] = {"Moment_1": np.zeros(3, np.float32), "Moment_2": np.zeros(3, np.float32)}
    state["extra"] = {}
    with pytest.raises(ValueError) as info:  # strict: every one of them is an error
        trainer.load_state_dict(state)
    for expected in ("missing weight 'fc2.bias'", "unexpected weight 'fc3.weight'", "unexpected key 'extra'",
                     "missing optimizer state for 'fc1.weight'", "optimizer state for 'fc3.weight', which is not"):
        assert expected in str(info.value)
    result = trainer.load_state_dict(state, strict=False)
    assert sorted(result.missing_keys) == ["fc2.bias", "optimizer.fc1.weight"]
    assert sorted(result.unexpected_keys) == ["extra", "fc3.weight", "optimizer.fc3.weight"]
    after = trainer.state_dict()
    weights = after["model"]["full_precision"]
    np.testing.assert_array_equal(weights["fc1.weight"], before["model"]["full_precision"]["fc1.weight"] + 1.0)
    np.testing.assert_array_equal(weights["fc2.bias"], before["model"]["full_precision"]["fc2.bias"])
    np.testing.assert_array_equal(after["optimizer"]["fc1.weight"]["Moment_1"],
                                  before["optimizer"]["fc1.weight"]["Moment_1"])


@pytest.mark.parametrize("strict", [True, False])
def test_a_shape_mismatch_is_an_error_even_when_not_strict_as_in_torch(strict):
    trainer = trained_mlp(config=AdamConfig(), steps=1)
    before = snapshot(trainer)
    state = _edited(trainer.state_dict(pytorch_format=True), drop=[], extra={"fc1.bias": torch.zeros(7)})
    with pytest.raises(RuntimeError, match="size mismatch for fc1.bias"):
        MLP().load_state_dict(state, strict=strict)
    with pytest.raises(ValueError, match=r"weight 'fc1.bias': shape \[7\] in the state, \[32\] in the model"):
        trainer.load_state_dict(state, strict=strict)
    assert_unchanged(trainer, before)


# ---- a state taken inside a gradient-accumulation window resumes the window ------------------------------
def _accumulating(model):
    return ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE,
                      options={"batch": {"gradient_accumulation_steps": 2}})


def test_a_state_dict_inside_an_accumulation_window_resumes_exactly():
    """Issue 23: state_dict after micro-step 3 of windows of 2, loaded into a fresh trainer, then 3
    more micro-steps: bitwise the uninterrupted run (the same float32 operations in the same order),
    and both equal eager PyTorch summing the two micro-batches' gradients before each step."""
    torch.manual_seed(0)
    model = MLP()
    batches = [mlp_batch(torch.Generator().manual_seed(i)) for i in range(6)]
    whole = _accumulating(clone(model))
    whole_losses = [float(whole.train_step(x, y)[0]) for x, y in batches]
    first = _accumulating(clone(model))
    losses = [float(first.train_step(x, y)[0]) for x, y in batches[:3]]
    state = first.state_dict()
    assert set(state["accumulated_gradients"]) == WEIGHTS
    resumed = _accumulating(clone(model))
    resumed.load_state_dict(state)  # builds the graph: the window's gradients go to its buffers
    assert resumed._train_step_info.step == 3
    losses += [float(resumed.train_step(x, y)[0]) for x, y in batches[3:]]
    assert losses == whole_losses
    for name, value in whole.state_dict()["model"]["full_precision"].items():
        np.testing.assert_array_equal(resumed.state_dict()["model"]["full_precision"][name], value, err_msg=name)

    reference = clone(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    eager = []
    for i, (x, y) in enumerate(batches):
        loss = CE(reference(x), y)
        (loss / 2).backward()  # averaged over the window of 2
        eager.append(loss.item())
        if i % 2 == 1:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    # 3 AdamW updates of the 20-32-5 MLP in float32, each on the sum of two micro-batches' gradients:
    # each side may add a dot product (≤ 32 terms, fc2) in another order, 32u of its magnitude per
    # update (Higham's bound; the micro-batch sum adds one rounding, the halving none), carried
    # through the weights once per update: steps_bound(3, length=32) = 5.7e-6. The gradient norms
    # (0.72 to 0.85) stay under the clip threshold 1: clipping multiplies by exactly 1 on both sides.
    # Weights near 0 carry the error of their tensor's largest entry. Observed at 1 and 2 threads:
    # losses 0 (the same bits), weights ≤ 0.0082 of the bound, 120x under.
    bound = steps_bound(3, length=32)
    np.testing.assert_allclose(losses, eager, rtol=bound)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(resumed.state_dict(pytorch_format=True)[name], value, rtol=bound,
                                   atol=bound * float(value.abs().max()), err_msg=name)


def test_a_state_at_a_window_boundary_has_no_accumulated_gradients():
    trainer = _accumulating(MLP())
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        trainer.train_step(*mlp_batch(gen))
    assert "accumulated_gradients" not in trainer.state_dict()


def test_a_window_state_needs_the_same_window():
    first = _accumulating(MLP())
    first.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    other = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    with pytest.raises(ValueError, match="inside an accumulation window of 2 steps; this trainer accumulates "
                                         "over 1: use batch.gradient_accumulation_steps=2"):
        other.load_state_dict(first.state_dict())
