"""The main job and the README's usage snippet run as documented."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]


def test_digits_main_job_trains_exports_and_verifies(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits_classifier.py"), "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.95
    assert "predictions agree on 100.00%" in result.stdout
    session = ort.InferenceSession(str(tmp_path / "digits.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["pixels"]
    assert [o.name for o in session.get_outputs()] == ["logits"]
    (logits,) = session.run(None, {"pixels": np.zeros((3, 64), np.float32)})
    assert logits.shape == (3, 10)


def test_readme_usage_snippet_runs(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"## Using it\n\n```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert (tmp_path / "model.onnx").exists()
    assert namespace["loss"].dim() == 0 and tuple(namespace["logits"].shape) == (64, 10)
