"""The main job and the README's usage snippet run as documented."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_digits_main_job_trains_exports_and_verifies(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits_classifier.py"), "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.95  # a quality threshold on the trained model, not a rounding tolerance
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


MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec: pip install -e '.[mpi]'")


TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_digits_main_job_on_two_ranks(tmp_path, launcher):
    """The README's two data-parallel commands."""
    command = {"mpirun": [MPIEXEC, "-n", "2", sys.executable], "torchrun": [TORCHRUN, "--standalone",
                                                                           "--nproc_per_node", "2"]}[launcher]
    if command[0] is None:
        pytest.skip(f"needs {launcher}: pip install -e '.[mpi]'")
    result = subprocess.run(
        [*command, str(ROOT / "examples" / "digits_classifier.py"), "--output-dir", str(tmp_path), "--epochs", "20"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("test accuracy") == 1  # only rank 0 reports
    assert "on 2 rank(s)" in result.stdout
    assert float(re.search(r"test accuracy: ([0-9.]+)", result.stdout).group(1)) >= 0.95  # quality, not rounding
    assert (tmp_path / "digits.onnx").exists()


@needs_mpi
def test_data_parallel_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "bench.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "data_parallel.py"), "--steps", "2", "--warmup", "1",
         "--rounds", "1", "--write", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = out.read_text()
    assert all(f"| {label} |" in text for label in ("1 rank x 2 threads", "2 ranks x 1 thread, mpirun (MPI)",
                                                      "2 ranks x 1 thread, torchrun (gloo)")), text


def _example(name, tmp_path, *args):
    pytest.importorskip("transformers", reason="needs the hf extra")
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--output-dir", str(tmp_path), *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_bert_pretraining_example(tmp_path):
    out = _example("bert_pretraining.py", tmp_path, "--max-steps", "12", "--gradient-accumulation-steps", "2",
                   "--layers", "1", "--seq-length", "32")
    assert "12 optimizer steps" in out and "held-out" in out
    assert (tmp_path / "bert.onnx").exists()


def test_gpt2_finetune_example(tmp_path):
    out = _example("gpt2_finetune.py", tmp_path, "--max-steps", "20", "--layers", "1", "--sample-tokens", "16")
    assert "held-out perplexity" in out
    assert (tmp_path / "gpt2.onnx").exists()


def test_benchmark_runner_writes_its_report(tmp_path):
    """`make bench` in miniature: the MLP only, two steps, no ablation."""
    out = tmp_path / "bench.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--models", "mlp", "--steps", "2",
                             "--min-seconds", "0.2", "--rounds", "1", "--warmup", "1", "--impls", "ort,eager",
                             "--no-ablation", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    text = out.read_text()
    assert "| mlp |" in text and "## Targets" in text and "mlp: step ≥ 1.3× eager" in text
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_an_ablation_worker_times_training_steps_only():
    """The ablation's workers (`--no-eval`) time both sides' training steps and no evaluation."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--worker", "timing", "--model", "mlp",
                             "--impls", "ort,ort_without:gelu", "--steps", "3", "--warmup", "1", "--rounds", "2",
                             "--min-seconds", "0", "--no-eval"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert {impl: len(times) for impl, times in report["train"].items()} == {"ort": 6, "ort_without:gelu": 6}
    assert report["eval"] == {} and report["errors"] == {}
