"""Checkpoints: exact resume across processes, refusal to overwrite, corruption detection."""

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.checkpoint import CheckpointError
from ort_trainer.optim import AdamConfig, SGDConfig

CE = torch.nn.functional.cross_entropy
JOB = Path(__file__).with_name("resume_job.py")


def _job(tmp_path, name, *args):
    out = tmp_path / f"{name}.npz"
    result = subprocess.run([sys.executable, str(JOB), "--out", str(out), *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    with np.load(out) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("optimizer, accumulation, first", [
    ("adam", 1, 6), ("lamb", 1, 6), ("adam", 2, 6), ("adam", 2, 5),  # 5: saved inside an accumulation window
], ids=["adam", "lamb", "adam-accumulation", "adam-mid-window"])
def test_resume_in_a_new_process_equals_never_stopping(tmp_path, optimizer, accumulation, first):
    total = 12
    common = ["--optimizer", optimizer, "--accumulation", str(accumulation)]
    whole = _job(tmp_path, "whole", "--steps", str(total), *common)
    ckpt = tmp_path / "ckpt.h5"
    head = _job(tmp_path, "head", "--steps", str(first), "--save", str(ckpt), *common)
    tail = _job(tmp_path, "tail", "--steps", str(total - first), "--load", str(ckpt), *common)
    np.testing.assert_allclose(head["losses"], whole["losses"][:first], rtol=1e-6)
    np.testing.assert_allclose(tail["losses"], whole["losses"][first:], rtol=1e-6)
    assert tail["scale"] == whole["scale"] and tail["lr"] == pytest.approx(whole["lr"], rel=1e-12)
    for key in whole:
        if key.startswith(("w/", "m/")):
            np.testing.assert_allclose(tail[key], whole[key], rtol=1e-6, atol=1e-9, err_msg=key)


def _trained(steps=3, model=None, config=None):
    trainer = ORTTrainer(model or MLP(), MLP_DESC, config or AdamConfig(lr=1e-2), loss_fn=CE)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        trainer.train_step(*mlp_batch(gen))
    return trainer


def _snapshot(trainer):
    state = trainer.state_dict()
    flat = {f"w/{k}": v.copy() for k, v in state["model"]["full_precision"].items()}
    flat.update({f"o/{k}/{s}": np.array(v) for k, e in state["optimizer"].items() for s, v in e.items()})
    flat["steps"] = np.array([state["train_step_info"]["step"], state["train_step_info"]["optimization_step"]])
    return flat


def _assert_unchanged(trainer, before):
    after = _snapshot(trainer)
    assert after.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "good.h5"
    _trained(5).save_checkpoint(path, user_dict={"epoch": 2})
    return path


def test_save_refuses_to_overwrite_and_leaves_the_file_alone(tmp_path, saved):
    original = saved.read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        _trained(1).save_checkpoint(saved)
    assert saved.read_bytes() == original
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _trained(1).save_checkpoint(tmp_path / "missing" / "x.h5")
    assert [p.name for p in tmp_path.iterdir()] == ["good.h5"]  # no temporary files left behind


def test_truncated_checkpoint_is_a_clear_error_and_changes_nothing(tmp_path, saved):
    broken = tmp_path / "truncated.h5"
    broken.write_bytes(saved.read_bytes()[:-1])
    trainer = _trained(2)
    before = _snapshot(trainer)
    with pytest.raises(CheckpointError, match="truncated or corrupted|is corrupted"):
        trainer.load_checkpoint(broken)
    _assert_unchanged(trainer, before)


def _flip(source: Path, target: Path, offset: int) -> None:
    data = bytearray(source.read_bytes())
    data[offset] ^= 0xFF
    target.write_bytes(bytes(data))


def test_flipped_byte_is_detected(tmp_path, saved):
    with h5py.File(saved, "r") as handle:
        offset = handle["model/full_precision/fc1.weight"].id.get_offset() + 17
    trainer = _trained(2)
    before = _snapshot(trainer)
    for position, name in ((offset, "data.h5"), (200, "metadata.h5")):
        broken = tmp_path / name
        _flip(saved, broken, position)
        with pytest.raises(CheckpointError, match="corrupted"):
            trainer.load_checkpoint(broken)
        _assert_unchanged(trainer, before)


def test_checkpoint_from_another_model_is_rejected_by_name(saved):
    trainer = _trained(1, model=MLP(hidden=16))
    before = _snapshot(trainer)
    with pytest.raises(ValueError) as info:
        trainer.load_checkpoint(saved)
    assert "weight 'fc1.weight': shape [32, 20] in the state, [16, 20] in the model" in str(info.value)
    _assert_unchanged(trainer, before)
    sgd = _trained(1, config=SGDConfig())
    with pytest.raises(CheckpointError, match="optimizer state is for AdamOptimizer, this trainer uses SGDOptimizer"):
        sgd.load_checkpoint(saved)


def test_load_restores_everything_and_returns_the_user_dict(saved):
    source = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    assert source._engine is None
    user = source.load_checkpoint(saved)  # builds the graph from the recorded input dtypes
    assert user == {"epoch": 2}
    state = source.state_dict()
    assert state["train_step_info"] == {"step": 5, "optimization_step": 5}
    assert int(state["optimizer"]["fc1.weight"]["Update_Count"]) == 5
    with h5py.File(saved, "r") as handle:
        np.testing.assert_array_equal(state["optimizer"]["fc2.bias"]["Moment_2"],
                                      handle["optimizer/fc2.bias/Moment_2"][()])


def test_checkpoint_without_optimizer_state_keeps_the_current_one(tmp_path):
    path = tmp_path / "weights_only.h5"
    _trained(2).save_checkpoint(path, include_optimizer_states=False)
    trainer = _trained(4)
    moments = trainer.state_dict()["optimizer"]["fc1.weight"]["Moment_1"].copy()
    trainer.load_checkpoint(path)
    np.testing.assert_array_equal(trainer.state_dict()["optimizer"]["fc1.weight"]["Moment_1"], moments)


def test_load_state_dict_strict_names_missing_and_unexpected_keys():
    trainer = _trained(1)
    before = _snapshot(trainer)
    state = trainer.state_dict()
    del state["model"]["full_precision"]["fc2.bias"]
    state["model"]["full_precision"]["fc3.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError) as info:
        trainer.load_state_dict(state)
    assert "missing weight 'fc2.bias'" in str(info.value)
    assert "unexpected weight 'fc3.weight'" in str(info.value)
    _assert_unchanged(trainer, before)
    del state["model"]["full_precision"]["fc3.weight"]
    trainer.load_state_dict(state, strict=False)  # missing is fine when not strict


def test_pytorch_format_round_trip_leaves_the_optimizer_alone():
    source = _trained(3)
    target = _trained(6)
    moments = target.state_dict()["optimizer"]["fc1.weight"]["Moment_1"].copy()
    target.load_state_dict(source.state_dict(pytorch_format=True))
    for key, value in source.state_dict(pytorch_format=True).items():
        torch.testing.assert_close(target.state_dict(pytorch_format=True)[key], value, rtol=0, atol=0)
    np.testing.assert_array_equal(target.state_dict()["optimizer"]["fc1.weight"]["Moment_1"], moments)
    with pytest.raises(ValueError, match="unexpected weight 'fc9.weight'"):
        target.load_state_dict({**source.state_dict(pytorch_format=True), "fc9.weight": torch.zeros(1)})


def test_a_checkpoint_loads_into_a_fresh_torch_module(tmp_path):
    path = tmp_path / "trained.h5"
    trained = _trained(10)
    trained.save_checkpoint(path)
    fresh = MLP()  # other random weights
    reader = ORTTrainer(fresh, MLP_DESC, AdamConfig(), loss_fn=CE)
    reader.load_checkpoint(path)
    reader.update_torch_model()
    x, y = mlp_batch(torch.Generator().manual_seed(99), batch=16)
    expected = trained.eval_step(x, y)[1]
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), expected, rtol=1e-5, atol=1e-6)
    other = MLP()
    other.load_state_dict(trained.state_dict(pytorch_format=True))
    with torch.no_grad():
        torch.testing.assert_close(other(x), expected, rtol=1e-5, atol=1e-6)


def test_load_state_dict_before_the_first_step():
    source = _trained(4)
    model = MLP()
    target = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    target.load_state_dict(source.state_dict())  # graph not built yet: weights go into the module
    assert target._engine is None
    torch.testing.assert_close(model.fc1.weight, torch.from_numpy(source.state_dict()["model"]["full_precision"]["fc1.weight"]))
    batch = mlp_batch(torch.Generator().manual_seed(3))
    assert target.train_step(*batch)[0].item() == pytest.approx(source.train_step(*batch)[0].item(), rel=1e-6)
    assert target.state_dict()["train_step_info"]["optimization_step"] == 5
