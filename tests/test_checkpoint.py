"""Checkpoints: exact resume across processes, refusal to overwrite, corruption detection."""

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from checkpoint_crafting import edit, set_json
from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer
from state_helpers import assert_unchanged, snapshot, trained_mlp
from tolerances import FLOAT32, FLOAT64, steps_bound
from ort_trainer._temporaries import host_tag
from ort_trainer.amp import DynamicLossScaler
from ort_trainer import checkpoint
from ort_trainer.checkpoint import CheckpointError
from ort_trainer.optim import AdamConfig, SGDConfig
from ort_trainer.optim.lr_scheduler import LinearWarmupLRScheduler

CE = torch.nn.functional.cross_entropy
JOB = Path(__file__).with_name("resume_job.py")

# A resumed run against the uninterrupted one: the same graph runs the same float32 operations in
# the same order, at the same thread count, on state restored bit for bit, so the arithmetic gives
# no difference at all (observed at 1 and 2 threads: 0). The bound is a few roundings (16u = 9.5e-7,
# the 1e-6 the test was written with), under what two sum orders could reach over 12 steps
# (steps_bound(12) = 4.6e-5) and far under what a state restored wrong (a lost moment, step count,
# loss scale or dropout seed) does: a whole step's update of another size or direction.
RESUME_BOUND = 16 * FLOAT32
# The learning rate is LinearWarmupLRScheduler's float64 formula of the step count: lr · (T − s) /
# max(1, T − W) is 2 roundings (the subtractions of integers are exact) of u64 = 2^-53 on each side:
# 4 · 2^-53 = 4.4e-16 apart at most (observed: 0, the same bits).
LR_BOUND = 4 * FLOAT64


def _job(tmp_path, name, *args):
    out = tmp_path / f"{name}.npz"
    result = subprocess.run([sys.executable, str(JOB), "--out", str(out), *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    with np.load(out) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("optimizer, accumulation, first, dropout", [
    ("adam", 1, 6, 0.0), ("lamb", 1, 6, 0.0), ("adam", 2, 6, 0.0),
    ("adam", 2, 5, 0.0),  # 5: saved inside an accumulation window
    ("adam", 1, 6, 0.1),  # the resumed process seeds torch differently: the dropout seed is restored
], ids=["adam", "lamb", "adam-accumulation", "adam-mid-window", "adam-dropout"])
def test_resume_in_a_new_process_equals_never_stopping(tmp_path, optimizer, accumulation, first, dropout):
    total = 12
    common = ["--optimizer", optimizer, "--accumulation", str(accumulation), "--dropout", str(dropout)]
    whole = _job(tmp_path, "whole", "--steps", str(total), *common)
    ckpt = tmp_path / "ckpt.h5"
    head = _job(tmp_path, "head", "--steps", str(first), "--save", str(ckpt), *common)
    tail = _job(tmp_path, "tail", "--steps", str(total - first), "--load", str(ckpt), *common)
    np.testing.assert_allclose(head["losses"], whole["losses"][:first], rtol=RESUME_BOUND)
    np.testing.assert_allclose(tail["losses"], whole["losses"][first:], rtol=RESUME_BOUND)
    assert tail["scale"] == whole["scale"] and tail["lr"] == pytest.approx(whole["lr"], rel=LR_BOUND, abs=0)
    for key in whole:
        if key.startswith(("w/", "m/")):  # atol: first moments that are 0 (or nearly) on both sides
            np.testing.assert_allclose(tail[key], whole[key], rtol=RESUME_BOUND, atol=1e-9, err_msg=key)








SAVED_SEED = 2024


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "good.h5"
    trainer = trained_mlp(5)
    trainer._seed = SAVED_SEED
    trainer.save_checkpoint(path, user_dict={"epoch": 2})
    return path


def test_save_refuses_to_overwrite_and_leaves_the_file_alone(tmp_path, saved):
    original = saved.read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        trained_mlp(1).save_checkpoint(saved)
    assert saved.read_bytes() == original
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trained_mlp(1).save_checkpoint(tmp_path / "missing" / "x.h5")
    assert [p.name for p in tmp_path.iterdir()] == ["good.h5"]  # no temporary files left behind


def test_truncated_checkpoint_is_a_clear_error_and_changes_nothing(tmp_path, saved):
    broken = tmp_path / "truncated.h5"
    broken.write_bytes(saved.read_bytes()[:-1])
    trainer = trained_mlp(2)
    before = snapshot(trainer)
    with pytest.raises(CheckpointError, match="truncated or corrupted|is corrupted"):
        trainer.load_checkpoint(broken)
    assert_unchanged(trainer, before)


def _flip(source: Path, target: Path, offset: int) -> None:
    data = bytearray(source.read_bytes())
    data[offset] ^= 0xFF
    target.write_bytes(bytes(data))


def test_flipped_byte_is_detected(tmp_path, saved):
    with h5py.File(saved, "r") as handle:
        offset = handle["model/full_precision/fc1.weight"].id.get_offset() + 17
    trainer = trained_mlp(2)
    before = snapshot(trainer)
    for position, name in ((offset, "data.h5"), (200, "metadata.h5")):
        broken = tmp_path / name
        _flip(saved, broken, position)
        with pytest.raises(CheckpointError, match="corrupted"):
            trainer.load_checkpoint(broken)
        assert_unchanged(trainer, before)


def test_checkpoint_from_another_model_is_rejected_by_name(saved):
    trainer = trained_mlp(1, model=MLP(hidden=16))
    before = snapshot(trainer)
    with pytest.raises(ValueError) as info:
        trainer.load_checkpoint(saved)
    assert "weight 'fc1.weight': shape [32, 20] in the state, [16, 20] in the model" in str(info.value)
    assert_unchanged(trainer, before)
    sgd = trained_mlp(1, config=SGDConfig())
    with pytest.raises(CheckpointError, match="optimizer state is for AdamOptimizer, this trainer uses SGDOptimizer"):
        sgd.load_checkpoint(saved)


def test_load_restores_everything_and_returns_the_user_dict(saved):
    source = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    assert source._engine is None
    user = source.load_checkpoint(saved)  # builds the graph from the recorded input dtypes
    assert user == {"epoch": 2}
    state = source.state_dict()
    assert state["train_step_info"] == {"step": 5, "optimization_step": 5, "seed": SAVED_SEED}
    assert int(state["optimizer"]["fc1.weight"]["Update_Count"]) == 5
    with h5py.File(saved, "r") as handle:
        np.testing.assert_array_equal(state["optimizer"]["fc2.bias"]["Moment_2"],
                                      handle["optimizer/fc2.bias/Moment_2"][()])


def test_stored_arrays_read_into_a_buffer_slice_by_slice(tmp_path, saved):
    handle = checkpoint.open_checkpoint(saved)
    stored = handle.arrays["model"]["full_precision"]["fc1.weight"]
    expected = stored.read().ravel()
    out = np.full(expected.size, np.nan, np.float32)
    for start in range(0, expected.size, 100):  # an odd slicing: offsets inside the dataset
        stop = min(start + 100, expected.size)
        stored.read_into(out[start:stop], start, stop)
    np.testing.assert_array_equal(out, expected)
    wide = np.empty(expected.size, np.float64)  # another dtype: read, then converted exactly
    stored.read_into(wide)
    np.testing.assert_array_equal(wide, expected.astype(np.float64))
    with pytest.raises(ValueError, match=r"needs a writable contiguous array of 10 elements"):
        stored.read_into(out[:20], 0, 10)
    with pytest.raises(ValueError, match=r"needs a writable contiguous array"):
        stored.read_into(out[:20:2], 0, 10)
    with pytest.raises(ValueError, match=r"is not inside"):
        stored.read_into(out[:10], expected.size - 5, expected.size + 5)


def test_load_reads_weights_and_moments_straight_into_the_trainers_buffers(tmp_path, saved, monkeypatch):
    """No read copy of any weight or moment (a 656 M-weight model's largest is 257 MB): each is read
    from the file into the engine's own buffer; a float64 moment is converted on the way."""
    wide = edit(saved, tmp_path / "wide.h5", lambda h: h.__setitem__(
        "optimizer/fc1.weight/Moment_2", h.pop("optimizer/fc1.weight/Moment_2")[()].astype(np.float64) * (1 + 2**-30)))
    reads = []
    original = checkpoint.StoredArray.read
    monkeypatch.setattr(checkpoint.StoredArray, "read", lambda self: reads.append(self.name) or original(self))
    for path in (saved, wide):
        reads.clear()
        trainer = trained_mlp(2)
        trainer.load_checkpoint(path)
        copied = [name for name in reads if name.startswith(("/model/", "/optimizer/")) and "Update_Count" not in name]
        assert copied == ([] if path == saved else ["/optimizer/fc1.weight/Moment_2"])
        state = trainer.state_dict()
        with h5py.File(path, "r") as handle:
            for name, value in state["model"]["full_precision"].items():
                np.testing.assert_array_equal(value, handle[f"model/full_precision/{name}"][()], err_msg=name)
            for name, entry in state["optimizer"].items():
                for key, value in entry.items():
                    np.testing.assert_array_equal(value, handle[f"optimizer/{name}/{key}"][()].astype(value.dtype),
                                                  err_msg=f"{name}/{key}")


def test_checkpoint_without_optimizer_state_keeps_the_current_one(tmp_path):
    path = tmp_path / "weights_only.h5"
    trained_mlp(2).save_checkpoint(path, include_optimizer_states=False)
    trainer = trained_mlp(4)
    moments = trainer.state_dict()["optimizer"]["fc1.weight"]["Moment_1"].copy()
    trainer.load_checkpoint(path)
    np.testing.assert_array_equal(trainer.state_dict()["optimizer"]["fc1.weight"]["Moment_1"], moments)


def test_load_state_dict_strict_names_missing_and_unexpected_keys():
    trainer = trained_mlp(1)
    before = snapshot(trainer)
    state = trainer.state_dict()
    del state["model"]["full_precision"]["fc2.bias"]
    state["model"]["full_precision"]["fc3.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError) as info:
        trainer.load_state_dict(state)
    assert "missing weight 'fc2.bias'" in str(info.value)
    assert "unexpected weight 'fc3.weight'" in str(info.value)
    assert_unchanged(trainer, before)
    del state["model"]["full_precision"]["fc3.weight"]
    trainer.load_state_dict(state, strict=False)  # missing is fine when not strict


def test_pytorch_format_round_trip_leaves_the_optimizer_alone():
    source = trained_mlp(3)
    target = trained_mlp(6)
    moments = target.state_dict()["optimizer"]["fc1.weight"]["Moment_1"].copy()
    target.load_state_dict(source.state_dict(pytorch_format=True))
    for key, value in source.state_dict(pytorch_format=True).items():
        torch.testing.assert_close(target.state_dict(pytorch_format=True)[key], value, rtol=0, atol=0)
    np.testing.assert_array_equal(target.state_dict()["optimizer"]["fc1.weight"]["Moment_1"], moments)
    with pytest.raises(ValueError, match="unexpected weight 'fc9.weight'"):
        target.load_state_dict({**source.state_dict(pytorch_format=True), "fc9.weight": torch.zeros(1)})


def test_a_checkpoint_loads_into_a_fresh_torch_module(tmp_path):
    path = tmp_path / "trained.h5"
    trained = trained_mlp(10)
    trained.save_checkpoint(path)
    fresh = MLP()  # other random weights
    reader = ORTTrainer(fresh, MLP_DESC, AdamConfig(), loss_fn=CE)
    reader.load_checkpoint(path)
    reader.update_torch_model()
    x, y = mlp_batch(torch.Generator().manual_seed(99), batch=16)
    expected = trained.eval_step(x, y)[1]
    # eager PyTorch against ONNX Runtime on the same weights: one forward of the MLP, whose dot
    # products (≤ 32 terms, fc2) each side may add in another order: 32u relative (Higham's bound,
    # steps_bound(1, length=32) = 1.9e-6), of the logits' magnitude where they cancel (observed at
    # 1 and 2 threads: ≤ 0.043 of the bound, 23x under)
    bound = steps_bound(1, length=32)
    atol = bound * float(expected.abs().max())
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), expected, rtol=bound, atol=atol)
    other = MLP()
    other.load_state_dict(trained.state_dict(pytorch_format=True))
    with torch.no_grad():
        torch.testing.assert_close(other(x), expected, rtol=bound, atol=atol)


def test_load_state_dict_before_the_first_step():
    source = trained_mlp(4)
    model = MLP()
    target = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    target.load_state_dict(source.state_dict())  # graph not built yet: weights go into the module
    assert target._engine is None
    # a copy into the module: no arithmetic, the same bits
    torch.testing.assert_close(model.fc1.weight, torch.from_numpy(source.state_dict()["model"]["full_precision"]["fc1.weight"]),
                               rtol=0, atol=0)
    batch = mlp_batch(torch.Generator().manual_seed(3))
    # the same graph on the same weights and batch: the same operations (see RESUME_BOUND)
    assert target.train_step(*batch)[0].item() == pytest.approx(source.train_step(*batch)[0].item(), rel=RESUME_BOUND)
    assert target.state_dict()["train_step_info"]["optimization_step"] == 5


def test_a_tied_models_state_loads_before_the_first_step():
    """GPT-2's head shares the embedding's weight: the graph, and so a nested state taken after a step, name it once
    (``transformer.wte.weight``), and a fresh trainer takes that state before its first step (the alias is optional
    there, its tensor the same), strict, and trains on as the trainer the state came from (RESUME_BOUND); a state that
    lacks a weight still names it."""
    from models import tiny_gpt2

    model, desc = tiny_gpt2(dropout=0.0)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    source = ORTTrainer(copy.deepcopy(model), desc, AdamConfig(lr=1e-3))
    source.train_step(ids, torch.ones_like(ids), ids)
    state = source.state_dict()
    assert "lm_head.weight" not in state["model"]["full_precision"]
    target = ORTTrainer(copy.deepcopy(model), desc, AdamConfig(lr=1e-3))
    target.load_state_dict(state)
    assert target._engine is None
    resumed = float(target.train_step(ids, torch.ones_like(ids), ids)[0])
    assert resumed == pytest.approx(float(source.train_step(ids, torch.ones_like(ids), ids)[0]), rel=RESUME_BOUND)
    del state["model"]["full_precision"]["transformer.wte.weight"]
    with pytest.raises(ValueError, match="missing weight 'transformer.wte.weight'"):
        ORTTrainer(copy.deepcopy(model), desc, AdamConfig(lr=1e-3)).load_state_dict(state)


# ---- all or nothing: a file with a valid checksum whose state is malformed changes nothing ----------
def _full_job(steps, data_seed):
    """Adam with a scheduler, a loss scaler and accumulation over 2, stopped after ``steps`` calls."""
    scheduler = LinearWarmupLRScheduler(total_steps=20, warmup=0.2)
    scaler = DynamicLossScaler(loss_scale=2.0 ** 8, up_scale_window=2)
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE, options={
        "lr_scheduler": scheduler, "mixed_precision": {"loss_scaler": scaler},
        "batch": {"gradient_accumulation_steps": 2}})
    gen = torch.Generator().manual_seed(data_seed)
    for _ in range(steps):
        trainer.train_step(*mlp_batch(gen))
    return trainer


def _everything(trainer):
    """Weights, moments, counters, accumulated gradients, scheduler, scaler, seed and all_finite."""
    flat = snapshot(trainer)
    flat.update({f"a/{k}": v for k, v in trainer._engine.accumulated_values().items()})
    flat["scheduler"] = np.array(repr(trainer.options.lr_scheduler.state_dict()))
    flat["scaler"] = np.array(repr(trainer.options.mixed_precision.loss_scaler.state_dict()))
    flat["seed"] = np.array(trainer._seed)
    flat["all_finite"] = np.array(trainer._train_step_info.all_finite)
    return flat


def _info(**changes):
    def change(handle):
        set_json(handle, "train_step_info", lambda info: {k: v for k, v in {**info, **changes}.items() if v != "DROP"})
    return change


def _replace(name, value):
    def change(handle):
        del handle[name]
        handle[name] = value
    return change


MALFORMED = {
    "step-not-an-int": (_info(step="7"), ["train_step_info.step: expected a non-negative int, got '7'"]),
    "step-negative": (_info(step=-1), ["train_step_info.step: expected a non-negative int, got -1"]),
    "optimization-step-missing": (_info(optimization_step="DROP"), ["has 'step' but not the other"]),
    "seed-not-an-int": (_info(seed=1.5), ["train_step_info.seed: expected an int"]),
    "accumulated-gradient-shape": (_replace("accumulated_gradients/fc1.weight", np.zeros((3, 3), np.float32)),
                                   ["accumulated gradient 'fc1.weight': shape [3, 3] in the state, [32, 20]"]),
    "scheduler-state-type": (lambda h: set_json(h, "lr_scheduler", lambda s: "oops"),
                             ["lr_scheduler: expected a dict, got str"]),
    "scheduler-state-field": (lambda h: set_json(h, "lr_scheduler", lambda s: {**s, "last_lr": "abc"}),
                              ["lr_scheduler.last_lr: expected a list of finite numbers"]),
    "scaler-state-type": (lambda h: set_json(h, "loss_scaler", lambda s: {**s, "loss_scale": "big"}),
                          ["loss_scaler.loss_scale: expected a positive finite number, got 'big'"]),
    "update-count-negative": (_replace("optimizer/fc2.bias/Update_Count", np.array(-3)),
                              ["optimizer state fc2.bias.Update_Count: expected a non-negative count, got -3"]),
    "update-count-float": (_replace("optimizer/fc2.bias/Update_Count", np.array(1.5)),
                           ["optimizer state fc2.bias.Update_Count: dtype float64 in the state, an int dtype"]),
    "input-dtype": (lambda h: set_json(h, "trainer_options",
                                       lambda o: {**o, "input_dtypes": {**o["input_dtypes"], "x": "V100000000"}}),
                    ["trainer_options.input_dtypes['x']: expected a numeric dtype name, got 'V100000000'"]),
}


# problems in the names, shapes, dtypes and JSON are all reported at once (counts are checked after)
TOGETHER = ["step-not-an-int", "seed-not-an-int", "accumulated-gradient-shape", "scheduler-state-field",
            "scaler-state-type", "update-count-float", "input-dtype"]


@pytest.mark.parametrize("case", list(MALFORMED) + ["all-at-once"])
def test_a_malformed_state_with_a_valid_checksum_changes_nothing(tmp_path, case):
    saved = tmp_path / "mid_window.h5"
    _full_job(5, data_seed=1).save_checkpoint(saved)  # inside an accumulation window: has accumulated gradients
    cases = [MALFORMED[c] for c in (TOGETHER if case == "all-at-once" else [case])]
    crafted = edit(saved, tmp_path / "crafted.h5", lambda h: [change(h) for change, _ in cases])
    trainer = _full_job(3, data_seed=2)
    trainer._seed = 77
    before = _everything(trainer)
    with pytest.raises(CheckpointError) as info:
        trainer.load_checkpoint(crafted)
    for _, messages in cases:
        for message in messages:
            assert message in str(info.value)
    after = _everything(trainer)
    assert after.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_the_dropout_seed_round_trips_through_checkpoints_and_state_dicts(tmp_path):
    source = trained_mlp(2)
    source._seed = 987654321
    path = tmp_path / "seed.h5"
    source.save_checkpoint(path)
    target = trained_mlp(1)
    target._seed = 5
    target.load_checkpoint(path)
    assert target._seed == 987654321
    state = source.state_dict()
    assert state["train_step_info"]["seed"] == 987654321
    other = trained_mlp(1)
    other.load_state_dict(state)
    assert other._seed == 987654321
    without = edit(path, tmp_path / "no_seed.h5", _info(seed="DROP"))
    other._seed = 11
    other.load_checkpoint(without)  # a checkpoint without a seed leaves it as it is
    assert other._seed == 11


# ---- temporaries of interrupted saves are cleaned up by the next save ------------------------------
_BLOCKED_WRITER = """
import sys, time
import numpy as np
from ort_trainer import checkpoint

def blocked(source, target):  # the file is complete but not linked into place yet: a kill lands here
    print("linking", flush=True)
    time.sleep(120)

checkpoint.os.link = blocked
checkpoint.write(sys.argv[1], {"model": {"full_precision": {"w": np.ones((512, 1024), np.float32)}}})
"""


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_kill_9_during_a_save_leaves_a_temporary_that_the_next_save_removes(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", _BLOCKED_WRITER, str(tmp_path / "killed.h5")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "linking"
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    left = [p for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].name.startswith(".killed.h5.") and left[0].name.endswith(".tmp")
    assert left[0].stat().st_size > 2 * 2 ** 20
    trained_mlp(1).save_checkpoint(tmp_path / "next.h5")
    assert [p.name for p in tmp_path.iterdir()] == ["next.h5"]


def test_only_stale_temporaries_of_this_library_are_removed(tmp_path):
    host, dead, old = host_tag(), _dead_pid(), time.time() - 2 * 3600
    hdf5_like = b"\0" * 512 + b"\x89HDF\r\n\x1a\n" + b"\0" * 64
    files = {  # name: (content, made two hours ago, expected to be removed)
        f".a.h5.{host}-{os.getpid()}.abcdefgh.tmp": (b"x", False, False),       # its writer is alive
        f".a.h5.{host}-{dead}.abcdefg1.tmp": (b"x", False, True),              # its writer is dead
        f".a.h5.{'0' * 8 if host != '0' * 8 else '1' * 8}-{dead}.abcdefg2.tmp": (b"x", False, False),  # another host
        f".a.h5.{'0' * 8 if host != '0' * 8 else '1' * 8}-{dead}.abcdefg3.tmp": (b"x", True, True),    # ... stale
        ".b.h5.abcdefgh.tmp": (hdf5_like, True, True),                            # a version-1 temporary
        ".c.h5.abcdefgh.tmp": (hdf5_like, False, False),                          # ... still recent
        ".model.onnx.abcdefgh.tmp": (b"onnx", True, True),                         # an earlier save_as_onnx's
        ".model.onnx.abcdefg4.tmp": (b"onnx", False, False),                       # ... still recent
        "notes.tmp": (b"mine", True, False),
    }
    for name, (content, stale, _) in files.items():
        (tmp_path / name).write_bytes(content)
        if stale:
            os.utime(tmp_path / name, (old, old))
    trained_mlp(1).save_checkpoint(tmp_path / "new.h5")
    remaining = {p.name for p in tmp_path.iterdir()}
    assert remaining == {"new.h5"} | {name for name, (_, _, removed) in files.items() if not removed}
