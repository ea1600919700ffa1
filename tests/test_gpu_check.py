"""``make gpu-check``'s parts that run without a GPU: the preflight that says what is missing, and
the report ``benchmarks/gpu.py`` writes from its measurements."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu  # noqa: E402  (benchmarks/gpu.py)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the preflight passes here")
def test_the_preflight_says_what_this_machine_lacks():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--preflight"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "gpu-check cannot run: torch" in result.stderr and "sees no GPU" in result.stderr
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert 'pip install "ort_trainer[cuda]"' in result.stderr


def test_make_gpu_check_runs_the_preflight_the_cuda_tests_and_the_benchmark():
    for extra, pytest_args in (([], ""), (["GPU_PYTEST_ARGS=--junitxml=cuda.xml"], " --junitxml=cuda.xml")):
        dry = subprocess.run(["make", "-n", "--no-print-directory", "gpu-check", "GPU_PYTHON=py", *extra], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, dry.stderr
        # under an outer make (make test) make may still announce directories: only the commands count
        commands = [line.rstrip() for line in dry.stdout.splitlines() if not line.startswith("make")]
        assert commands[:3] == ["py benchmarks/gpu.py --preflight", "py -m pytest -q -m cuda -rs tests" + pytest_args,
                                "py benchmarks/gpu.py"]


def _entry(ort_ms: float, torch_ms: float) -> dict:
    def side(ms):
        return {"train": [ms / 1000] * 3, "round_medians_ms": [ms], "errors": [], "peak_gpu_mb": 100.0,
                "device": "NVIDIA H100"}
    return {"ort": side(ort_ms), "torch": side(torch_ms)}


def test_the_report_gives_ratios_and_says_which_target_is_missed(tmp_path):
    report = {"bert/fp32": _entry(10.0, 12.0), "bert/fp16": _entry(8.0, 6.0)}
    report["gpt2/fp32"] = _entry(10.0, 10.0)
    report["gpt2/fp32"]["ort"].update(train=[], round_medians_ms=[], errors=["exit 1: CUDA out of memory"])
    out = tmp_path / "benchmarks_gpu.md"
    missed = gpu.write_report(report, out, SimpleNamespace(rounds=1, steps=3, warmup=1))
    text = out.read_text()
    assert "| bert | fp32 | 10.0 | 12.0 | 1.20× | ≥ 1.0×: met |" in text
    assert "| bert | fp16 | 8.0 | 6.0 | 0.75× | ≥ 1.0×: MISSED |" in text
    assert "| gpt2 | fp32 | failed | 10.0 | — | ≥ 1.0×: MISSED |" in text
    assert "- gpt2/fp32 ort: exit 1: CUDA out of memory" in text
    assert missed == ["bert/fp16: ratio 0.75", "gpt2/fp32: not measured"]
