"""A checkpoint never runs code, never reads other files, and never makes the loader allocate more
than the file holds; the user dict is plain data unless the caller opts in to pickle."""

import json
import logging
import math
import pickle
import time
import tracemalloc
from fractions import Fraction

import h5py
import numpy as np
import pytest
import torch

from checkpoint_crafting import edit, set_json
from models import MLP, MLP_DESC
from ort_trainer import ORTTrainer, checkpoint
from ort_trainer.checkpoint import CheckpointError
from ort_trainer.optim import AdamConfig
from state_helpers import assert_unchanged, snapshot, trained_mlp

CE = torch.nn.functional.cross_entropy
BIAS = "model/full_precision/fc1.bias"  # 32 float32





@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "good.h5"
    trained_mlp(4).save_checkpoint(path, user_dict={"epoch": 2})
    return path


class _Touch:
    """Unpickling this creates ``path``: stands for any code a crafted pickle can run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _as_version_1(handle, user_pickle: bytes):
    """Turn a checkpoint into the version-1 layout: the user dict pickled, hex, in an attribute."""
    if "user_dict" in handle:
        del handle["user_dict"]
    handle.attrs["version"] = "1"
    handle.attrs["user_dict"] = user_pickle.hex()
    set_json(handle, "train_step_info", lambda info: {k: v for k, v in info.items() if k != "seed"})


# ---- item 8: no code runs -------------------------------------------------------------------------
def test_a_crafted_pickle_in_an_old_checkpoint_never_runs(tmp_path, saved, caplog):
    marker = tmp_path / "pwned"
    crafted = edit(saved, tmp_path / "v1.h5", lambda h: _as_version_1(h, pickle.dumps({"epoch": _Touch(marker)})))
    reference = snapshot(_loaded(saved))
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    with caplog.at_level(logging.WARNING, logger="ort_trainer"):
        user = trainer.load_checkpoint(crafted)
    assert not marker.exists()
    assert user is None
    assert "NOT unpickled" in caplog.text and "allow_pickle=True" in caplog.text and "format version 1" in caplog.text
    assert_unchanged(trainer, reference)  # the weights and state of the old file are loaded all the same
    assert checkpoint.read(crafted)["user_dict"] is None  # what `ort-trainer export` reads
    assert not marker.exists()
    # the pickle is a real one: opting in runs it
    ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE).load_checkpoint(crafted, allow_pickle=True)
    assert marker.exists()


def _loaded(path, **kwargs):
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    trainer.load_checkpoint(path, **kwargs)
    return trainer


def test_an_old_checkpoint_without_a_user_dict_loads_quietly(tmp_path, saved, caplog):
    old = edit(saved, tmp_path / "v1.h5", lambda h: _as_version_1(h, pickle.dumps(None)))
    with caplog.at_level(logging.WARNING, logger="ort_trainer"):
        trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
        assert trainer.load_checkpoint(old) is None
    assert caplog.text == ""
    assert_unchanged(trainer, snapshot(_loaded(saved)))


def test_user_dict_is_stored_as_plain_data_and_round_trips(tmp_path):
    user = {"epoch": 3, "loss": 0.25, "name": "run-ü", "done": False, "none": None, "nan": math.nan,
            "history": [1.5, 2, "x", [True]], "shape": (2, 3),
            "table": np.arange(12, dtype=np.int16).reshape(3, 4), "best": np.float32(0.125),
            "nested": {"mask": np.array([True, False]), "empty": np.zeros((0, 2))}}
    path = tmp_path / "user.h5"
    trained_mlp(1).save_checkpoint(path, user_dict=user)
    with h5py.File(path, "r") as handle:
        assert "pickle" not in handle["user_dict"] and "user_dict" not in handle.attrs
        stored = sorted(handle["user_dict/arrays"])
        assert len(stored) == 4
        np.testing.assert_array_equal(handle["user_dict/arrays/0"][()], user["table"])
    back = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE).load_checkpoint(path)
    assert math.isnan(back.pop("nan")) and math.isnan(user.pop("nan"))
    np.testing.assert_array_equal(back.pop("table"), user.pop("table"))
    assert type(back["best"]) is np.float32 and back.pop("best") == user.pop("best")
    nested, expected = back.pop("nested"), user.pop("nested")
    np.testing.assert_array_equal(nested["mask"], expected["mask"])
    assert nested["empty"].shape == (0, 2) and nested["empty"].dtype == np.float64
    assert back == {**user, "shape": [2, 3]}  # a tuple comes back as a list, as in JSON


def test_a_user_dict_that_is_not_plain_data_is_refused_by_path(tmp_path):
    path = tmp_path / "refused.h5"
    bad = {"model": {"w": torch.zeros(2)}, 3: "int key", "fn": len, "ok": [1, {"when": Fraction(1, 3)}]}
    with pytest.raises(TypeError) as info:
        trained_mlp(1).save_checkpoint(path, user_dict=bad)
    message = str(info.value)
    for expected in ("user_dict['model']['w']: a torch.Tensor", "key 3 is a int", "user_dict['fn']",
                     "user_dict['ok'][1]['when']: a fractions.Fraction", "allow_pickle=True"):
        assert expected in message
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_pickling_the_user_dict_needs_an_opt_in_on_save_and_on_load(tmp_path, caplog):
    path = tmp_path / "pickled.h5"
    user = {"ratio": Fraction(1, 3), "weights": torch.ones(2)}
    trainer = trained_mlp(2)
    trainer.save_checkpoint(path, user_dict=user, allow_pickle=True)
    with caplog.at_level(logging.WARNING, logger="ort_trainer"):
        assert trainer.load_checkpoint(path) is None  # not unpickled
    assert "allow_pickle=True" in caplog.text
    back = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE).load_checkpoint(path, allow_pickle=True)
    assert back["ratio"] == Fraction(1, 3) and torch.equal(back["weights"], torch.ones(2))
    plain = tmp_path / "plain.h5"  # plain data is never pickled, even when pickling is allowed
    trainer.save_checkpoint(plain, user_dict={"epoch": 1}, allow_pickle=True)
    with h5py.File(plain, "r") as handle:
        assert "pickle" not in handle["user_dict"]


# ---- item 9: nothing outside the file is read -----------------------------------------------------
SECRET = np.full(32, 1234.5, np.float32)


def _external_storage(handle, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET.tobytes())
    del handle[BIAS]
    handle.create_dataset(BIAS, shape=(32,), dtype=np.float32, external=[(str(secret), 0, SECRET.nbytes)])


def _other_file(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as handle:
        handle["data"] = SECRET
    return other


def _virtual(handle, tmp_path):
    other = _other_file(tmp_path)
    layout = h5py.VirtualLayout(shape=(32,), dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(other), "data", shape=(32,))
    del handle[BIAS]
    handle.create_virtual_dataset(BIAS, layout, fillvalue=0)


def _external_link(handle, tmp_path):
    other = _other_file(tmp_path)
    del handle[BIAS]
    handle[BIAS] = h5py.ExternalLink(str(other), "/data")


def _soft_link(handle, tmp_path):
    del handle[BIAS]
    handle[BIAS] = h5py.SoftLink("/optimizer/fc1.bias/Moment_1")


@pytest.mark.parametrize("craft, expected", [
    (_external_storage, "keeps its data in the external file"),
    (_virtual, "is a virtual dataset"),
    (_external_link, "is an external link to"),
    (_soft_link, "is a soft link to '/optimizer/fc1.bias/Moment_1'"),
], ids=["external-storage", "virtual-dataset", "external-link", "soft-link"])
def test_data_outside_the_file_is_refused_by_name(tmp_path, saved, craft, expected):
    crafted = edit(saved, tmp_path / "crafted.h5", lambda h: craft(h, tmp_path))
    trainer = trained_mlp(2)
    before = snapshot(trainer)
    with pytest.raises(CheckpointError) as info:
        trainer.load_checkpoint(crafted)
    assert f"'/{BIAS}'" in str(info.value) and expected in str(info.value)
    assert_unchanged(trainer, before)
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.read(crafted)
    assert not any(np.any(v == 1234.5) for v in snapshot(trainer).values())


# ---- item 10: bounded allocation, names and shapes checked before any data is read -----------------
def _huge_compressed(handle):
    del handle["model/full_precision/fc1.weight"]
    handle.create_dataset("model/full_precision/fc1.weight", shape=(1024, 1024, 1024), dtype=np.float32,
                          chunks=(1, 64, 1024), compression="gzip", fillvalue=1.0)
    handle["model/full_precision/fc1.weight"][0, :64] = 1.0  # one compressed chunk


def _huge_unstored(handle):
    handle.create_dataset("model/full_precision/extra", shape=(1024, 1024, 1024), dtype=np.float32)


@pytest.mark.parametrize("craft, expected", [
    (_huge_compressed, "dataset '/model/full_precision/fc1.weight' uses chunked or compressed storage"),
    (_huge_unstored, "dataset '/model/full_precision/extra' declares shape [1024, 1024, 1024] of float32 "
                     "(4294967296 bytes) but stores 0 bytes"),
], ids=["compressed-1024^3", "unstored-1024^3"])
def test_a_small_file_cannot_make_the_loader_allocate_gigabytes(tmp_path, saved, craft, expected):
    crafted = edit(saved, tmp_path / "bomb.h5", craft)
    assert crafted.stat().st_size < 200_000
    trainer = trained_mlp(1)
    before = snapshot(trainer)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(CheckpointError) as info:
            trainer.load_checkpoint(crafted)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert expected in str(info.value)
    assert peak < 20 * 2 ** 20, f"peak {peak / 2**20:.0f} MiB"
    assert time.perf_counter() - started < 5
    assert_unchanged(trainer, before)


def test_names_shapes_and_dtypes_are_checked_before_any_data_is_read(tmp_path, saved, monkeypatch):
    def change(handle):
        handle["model/full_precision/evil"] = np.zeros(4, np.float32)
        del handle["optimizer/fc2.bias/Moment_1"]
        handle["optimizer/fc2.bias/Moment_1"] = np.zeros(5, np.float64)
        del handle["optimizer/fc2.bias/Moment_2"]
        handle["optimizer/fc2.bias/Moment_2"] = np.zeros(5, np.int32)
        handle["unexpected_group/x"] = np.zeros(1)

    crafted = edit(saved, tmp_path / "odd.h5", change)
    with pytest.raises(CheckpointError, match="unexpected object '/unexpected_group'"):
        checkpoint.open_checkpoint(crafted)
    crafted = edit(saved, tmp_path / "odd2.h5", lambda h: (change(h), h.__delitem__("unexpected_group")))
    reads = []
    original = checkpoint.StoredArray.read
    monkeypatch.setattr(checkpoint.StoredArray, "read", lambda self: reads.append(self.name) or original(self))
    trainer = trained_mlp(1)
    before = snapshot(trainer)
    with pytest.raises(CheckpointError) as info:
        trainer.load_checkpoint(crafted)
    message = str(info.value)
    assert "unexpected weight 'evil'" in message
    assert "optimizer state fc2.bias.Moment_2: dtype int32 in the state, a float dtype in the model" in message
    assert [r for r in reads if not r.startswith("/user_dict/")] == []  # no weight or state was read
    assert_unchanged(trainer, before)


def test_a_user_dict_array_cannot_claim_more_than_the_file_holds(tmp_path, saved):
    def change(handle):
        del handle["user_dict/value"]
        handle["user_dict/value"] = np.frombuffer(json.dumps({"big": {"__ndarray__": 0}}).encode(), np.uint8)
        handle.create_dataset("user_dict/arrays/0", shape=(2 ** 20, 2 ** 12), dtype=np.float64)

    crafted = edit(saved, tmp_path / "user_bomb.h5", change)
    with pytest.raises(CheckpointError, match=r"'/user_dict/arrays/0' declares shape \[1048576, 4096\]"):
        trained_mlp(1).load_checkpoint(crafted)
