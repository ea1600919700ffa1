"""Quiet by default: no ONNX Runtime INFO chatter unless asked for."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from models import MLP, MLP_DESC, mlp_batch
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import AdamConfig
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=torch.nn.functional.cross_entropy)
    trainer.train_step(*mlp_batch(torch.Generator().manual_seed(0)))
""")


def _run(tmp_path, level=None):
    env = dict(os.environ, ORT_TRAINER_CACHE_DIR="off")
    env.pop("ORT_TRAINER_LOG_LEVEL", None)
    if level:
        env["ORT_TRAINER_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(Path(__file__).parent))], env=env,
                          capture_output=True, text=True, timeout=300, check=True)


def test_default_run_prints_nothing(tmp_path):
    result = _run(tmp_path)
    assert result.stdout == ""
    assert result.stderr == ""


def test_debug_level_shows_onnx_runtime_logs(tmp_path):
    result = _run(tmp_path, "DEBUG")
    assert "built the training graph" in result.stderr
    assert "onnxruntime" in result.stderr  # ONNX Runtime's own INFO lines, asked for


def test_bad_log_level_is_a_clear_error(tmp_path):
    env = dict(os.environ, ORT_TRAINER_LOG_LEVEL="LOUD")
    result = subprocess.run([sys.executable, "-c", "import ort_trainer"], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "ORT_TRAINER_LOG_LEVEL='LOUD' is not a logging level" in result.stderr


def test_importing_leaves_the_root_logger_alone():
    script = "import logging, ort_trainer; print(len(logging.getLogger().handlers))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "0"
