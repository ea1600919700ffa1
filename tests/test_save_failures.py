"""Saves under Ctrl-C and full disks, and loads of the wrong thing (``_interrupt.py``,
``_temporaries.atomic_write``, ``checkpoint.py``, ``_state_checks.problems_report``).

Ctrl-C during a save always reaches the caller as ``KeyboardInterrupt``: during the save, with no
file written, or at its end, with the file whole. A failed write names the path and the
operation; a directory given to ``load_checkpoint`` is said to be one; a checkpoint of another
model is reported with a summary first.
"""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer, _onnx_files
from ort_trainer.checkpoint import CheckpointError
from ort_trainer.optim import AdamConfig

ROOT = Path(__file__).resolve().parents[1]


def _trained(model=None):
    trainer = ORTTrainer(model or MLP(), MLP_DESC, AdamConfig(lr=1e-3), loss_fn=F.cross_entropy)
    trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
    return trainer


def _interrupt_on_call(monkeypatch, owner, name, call):
    """Send SIGINT to this process when ``owner.name`` is called for the ``call``-th time."""
    original, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


def _leftovers(directory):
    return sorted(p.name for p in Path(directory).iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("call", [1, 5, 14])  # the first dataset, one in the middle, one of the last
def test_ctrl_c_while_a_checkpoint_is_written_stops_it_and_writes_nothing(call, tmp_path, monkeypatch,
                                                                          python_sigint_handler):
    trainer = _trained()
    _interrupt_on_call(monkeypatch, h5py.Group, "create_dataset", call)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert not (tmp_path / "run.ckpt").exists() and _leftovers(tmp_path) == []
    monkeypatch.undo()
    trainer.save_checkpoint(tmp_path / "run.ckpt")  # and the next save works
    assert _trained().load_checkpoint(tmp_path / "run.ckpt") is None


def test_ctrl_c_after_the_last_array_is_raised_once_the_checkpoint_is_whole(tmp_path, monkeypatch,
                                                                            python_sigint_handler):
    trainer = _trained()
    _interrupt_on_call(monkeypatch, os, "fsync", 1)  # after every array is written
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(tmp_path / "run.ckpt")
    monkeypatch.undo()
    restored = _trained()
    restored.load_checkpoint(tmp_path / "run.ckpt")  # whole: verified by its checksum
    weights = trainer.state_dict()["model"]["full_precision"]
    assert all(np.array_equal(v, restored.state_dict()["model"]["full_precision"][k]) for k, v in weights.items())


def test_ctrl_c_at_any_moment_of_a_real_save_always_reaches_the_caller(tmp_path, capfd, python_sigint_handler):
    """The signal from another thread at moments spread over a save of ~100 MB (h5py's cleanup
    callbacks, where Python drops a KeyboardInterrupt, run all along it)."""
    wide = torch.nn.Sequential(torch.nn.Linear(20, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 5))
    trainer = _trained(wide)  # 8.5 M weights: 100 MB with Adam's two moments
    started = time.perf_counter()
    trainer.save_checkpoint(tmp_path / "timing.ckpt")
    duration = time.perf_counter() - started
    outcomes = []
    for attempt in range(8):
        path = tmp_path / f"run{attempt}.ckpt"
        timer = threading.Timer(duration * attempt / 7, os.kill, (os.getpid(), signal.SIGINT))
        raised_in_save = False
        try:
            timer.start()
            try:
                trainer.save_checkpoint(path)
            except KeyboardInterrupt:
                raised_in_save = True
            if not raised_in_save:
                time.sleep(duration + 2)  # the signal came after the save: it lands here, or was lost
                pytest.fail(f"the interrupt of attempt {attempt} was lost")
        except KeyboardInterrupt:
            pass
        finally:
            timer.join()
        outcomes.append((raised_in_save, path.exists()))
        if path.exists():  # a file written is whole
            _trained(torch.nn.Sequential(torch.nn.Linear(20, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048),
                                         torch.nn.ReLU(), torch.nn.Linear(2048, 5))).load_checkpoint(path)
        assert _leftovers(tmp_path) == []
    assert "Exception ignored" not in capfd.readouterr().err
    assert any(raised for raised, _ in outcomes), outcomes  # most signals landed inside a save


@pytest.mark.parametrize("external_data", [False, True])
def test_ctrl_c_while_save_as_onnx_writes_weights_writes_no_file(external_data, tmp_path, monkeypatch,
                                                                 python_sigint_handler):
    trainer = _trained()
    if external_data:
        _interrupt_on_call(monkeypatch, np, "ascontiguousarray", 2)  # the data file's second weight
    else:
        _interrupt_on_call(monkeypatch, _onnx_files, "_write_initializer", 1)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_as_onnx(tmp_path / "model.onnx", external_data=external_data)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    trainer.save_as_onnx(tmp_path / "model.onnx", external_data=external_data)
    onnx.checker.check_model(str(tmp_path / "model.onnx"))


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    # h5py's own report of the same: a RuntimeError with the system's number in its message
    RuntimeError("Can't write data (file write failed: time = Sat Nov 28, errno = 28, error message = "
                 "'No space left on device')"),
], ids=["system", "h5py"])
def test_a_full_disk_names_the_path_and_the_operation_and_keeps_the_earlier_file(failure, tmp_path, monkeypatch):
    trainer = _trained()
    trainer.save_as_onnx(tmp_path / "model.onnx")
    before = (tmp_path / "model.onnx").read_bytes()

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(h5py.Group, "create_dataset", full)
    monkeypatch.setattr(_onnx_files, "_write_initializer", full)
    with pytest.raises(OSError) as error:
        trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert error.value.errno == errno.ENOSPC
    assert str(error.value) == (f"[Errno 28] save_checkpoint: could not write {str(tmp_path / 'run.ckpt')!r}: No space "
                                f"left on device: the file system of {str(tmp_path)!r} is full: free space there or "
                                "write elsewhere; nothing was written there")
    with pytest.raises(OSError, match=r"save_as_onnx: could not write .*model\.onnx': No space left on device"):
        trainer.save_as_onnx(tmp_path / "model.onnx")
    assert (tmp_path / "model.onnx").read_bytes() == before and not (tmp_path / "run.ckpt").exists()
    assert _leftovers(tmp_path) == []


_FILE_SIZE_LIMIT = textwrap.dedent("""
    import os, resource, signal, sys
    import torch, torch.nn.functional as F
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import AdamConfig

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 3))
    desc = {"inputs": [("x", ["batch", 256]), ("label", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 3])]}
    trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-3), loss_fn=F.cross_entropy)
    trainer.train_step(torch.randn(4, 256), torch.randint(0, 3, (4,)))
    directory = sys.argv[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, resource.RLIM_INFINITY))  # the weights: 1 MB
    for name, save in [("run.ckpt", trainer.save_checkpoint), ("model.onnx", trainer.save_as_onnx)]:
        try:
            save(os.path.join(directory, name))
        except OSError as error:
            print(error.errno, error)
    print(sorted(os.listdir(directory)))
""")


def test_a_write_the_system_refuses_names_the_path(tmp_path):
    """A real failed write: the process's file size limit below the files' size."""
    done = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith(f"27 [Errno 27] save_checkpoint: could not write {str(tmp_path / 'run.ckpt')!r}: "
                               "File too large")
    assert lines[1].startswith(f"27 [Errno 27] save_as_onnx: could not write {str(tmp_path / 'model.onnx')!r}")
    assert lines[2] == "[]"  # nothing left behind


def test_loading_a_directory_says_it_is_one(tmp_path):
    with pytest.raises(CheckpointError, match=r"load_checkpoint: '.*' is a directory; give the checkpoint file in it"):
        _trained().load_checkpoint(tmp_path)


class _Deeper(torch.nn.Module):
    """Another model: wider, with a layer more."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(20, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 5)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_a_checkpoint_of_another_model_is_reported_with_a_summary_first(tmp_path):
    _trained().save_checkpoint(tmp_path / "mlp.ckpt")
    with pytest.raises(CheckpointError) as error:
        _trained(_Deeper()).load_checkpoint(tmp_path / "mlp.ckpt")
    lines = str(error.value).splitlines()
    assert lines[1].startswith("  16 problems: 2 of the model's 6 weights missing, 12 shape or dtype mismatches, "
                               "2 other problems (6 of the 6 weights are missing or of another shape: a checkpoint "
                               "of another model, or of another size of this one?)")
    assert lines[2].startswith("  first mismatches: weight 'fc1.weight': shape [")
    assert lines[3] == "  all problems, mismatches first:"
    assert lines[4].startswith("    weight 'fc1.weight': shape") and "missing weight 'fc3.weight'" in str(error.value)
