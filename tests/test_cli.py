"""The ort-trainer command line: every shipped config, the files a run writes, resume, export, mpirun."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ort_trainer.cli import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
ORT_TRAINER = shutil.which("ort-trainer", path=str(Path(sys.executable).parent))
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
SHORT = ["train.max_steps=4", "train.log_every=2", "train.eval_every=4", "train.eval_batches=1",
         "export.sample_tokens=12", "data.max_bytes=300000"]


def _cli(*args, timeout=600, launcher=()):
    command = [*launcher, ORT_TRAINER, *map(str, args)] if ORT_TRAINER else [*launcher, sys.executable, "-m",
                                                                             "ort_trainer", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_trains(tmp_path, config):
    if "hf_" in config.stem:
        pytest.importorskip("transformers", reason="needs the hf extra")
    result = _cli("train", config, f"output_dir={tmp_path}", *SHORT)
    assert result.returncode == 0, result.stdout + result.stderr
    records = _records(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    assert all(np.isfinite(r["loss"]) and r["samples_per_s"] > 0 and r["lr"] >= 0 for r in records if "loss" in r)
    assert [r["step"] for r in records if "eval_loss" in r] == [4]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    assert "logits" in [o.name for o in session.get_outputs()]  # (and the loss, for models that return it)
    if (tmp_path / "samples.txt").exists():
        assert len((tmp_path / "samples.txt").read_text()) >= 12


def test_resume_continues_the_step_count_and_export_rebuilds_the_model(tmp_path):
    config = ROOT / "configs" / "gpt_stdlib.yaml"
    common = [f"output_dir={tmp_path}", "train.log_every=2", "train.eval_every=0", "train.checkpoint_every=2",
              "export.sample_tokens=0", "data.max_bytes=300000", "model.n_layer=1"]
    first = _cli("train", config, *common, "train.max_steps=4")
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000002.h5", "step_0000004.h5"]
    second = _cli("train", config, *common, "train.max_steps=6", "--resume")
    assert second.returncode == 0, second.stderr
    steps = [r["step"] for r in _records(tmp_path)]
    assert steps == [2, 4, 6]  # the log continues where the first run stopped
    assert "step 6:" in second.stdout
    out = tmp_path / "exported.onnx"
    exported = _cli("export", tmp_path / "checkpoints" / "step_0000006.h5", out)
    assert exported.returncode == 0, exported.stderr
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"ids": np.zeros((1, 5), np.int64)})
    assert logits.shape == (1, 5, 256)


def test_overrides_reject_unknown_keys_and_wrong_types(tmp_path):
    config = ROOT / "configs" / "digits_mlp.yaml"
    result = _cli("train", config, "train.max_stepz=3", "train.batch_size=big", "options.batch.gradient_accumulation_steps=0")
    assert result.returncode == 2
    assert "train.max_stepz: unknown key" in result.stderr
    assert "train.batch_size: expected int, got str 'big'" in result.stderr
    assert "batch.gradient_accumulation_steps: must be >= 1, got 0" in result.stderr
    with pytest.raises(ConfigError, match="options.lr_scheduler: set the schedule in the lr_scheduler section"):
        load_config(config, ["options.lr_scheduler=1"])
    assert load_config(config, ["optimizer.lr=1"])["optimizer"]["lr"] == 1.0  # an int is a fine float


def test_python_dash_m_runs_the_same_command_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ort_trainer", "train", ROOT / "configs" / "digits_mlp.yaml",
                             f"output_dir={tmp_path}", "train.max_steps=2", "train.log_every=1", "train.eval_every=2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "model.onnx").exists()


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec: pip install -e '.[mpi]'")
def test_command_line_under_mpirun(tmp_path):
    result = _cli("train", ROOT / "configs" / "gpt_stdlib.yaml", f"output_dir={tmp_path}", *SHORT, "model.n_layer=1",
                  launcher=(MPIEXEC, "-n", "2"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("wrote ") == 1  # rank 0 reports
    assert [r["step"] for r in _records(tmp_path) if "loss" in r] == [2, 4]
    assert (tmp_path / "model.onnx").exists() and (tmp_path / "samples.txt").exists()
