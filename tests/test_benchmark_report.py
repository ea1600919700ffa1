"""The benchmark report: a row per model per runtime, and the runtime-comparison targets."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    charts = []
    monkeypatch.setattr(module, "_chart", lambda chart, path: charts.append(chart))
    module.charts = charts
    return module


def _entry(ort_s: float, eager_s: float, runtime: str, source: str, compiled_s: float | None = None) -> dict:
    train = {"ort": [ort_s] * 3, "eager": [eager_s] * 3}
    if compiled_s:
        train["compile"] = [compiled_s] * 3
    return {
        "build_cold": {"first_step_s": 7.5, "step_s": 0.5},
        "build_cached": {"first_step_s": 1.2, "step_s": 0.5},
        "timing": {"train": train, "eval": {"ort": [ort_s / 3] * 3, "eager": [eager_s / 3] * 3}, "errors": {},
                   "runtime": runtime, "gradient_source": source},
        "rss": {"ort": {"peak_rss_mb": 700.0}, "eager": {"peak_rss_mb": 750.0}},
    }


def test_the_report_has_a_row_per_model_per_runtime_and_compares_the_runtimes(bench, tmp_path):
    report = {"machine": "test machine", "runtimes": {
        "current": {"bert": _entry(0.25, 0.30, "onnxruntime 1.31.1", "torch", compiled_s=0.31),
                    "mlp": _entry(0.002, 0.0025, "onnxruntime 1.31.1", "torch")},
        "legacy": {"bert": _entry(0.26, 0.286, "onnxruntime-training-cpu 1.19.2", "onnxruntime"),
                   "mlp": _entry(0.002, 0.0016, "onnxruntime-training-cpu 1.19.2", "onnxruntime")},
    }}
    out = tmp_path / "benchmarks.md"
    bench.write_report(report, out)
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| bert | ") or line.startswith("| mlp | ")]
    training = [r for r in rows if r.count("|") == 10]
    assert [r.split("|")[1:3] for r in training] == [[" bert ", " current "], [" bert ", " legacy "],
                                                     [" mlp ", " current "], [" mlp ", " legacy "]]
    assert "| bert | current | 250.0 | 300.0 | 310.0 | 1.20× | 1.24× |" in text
    assert "| bert | legacy | 260.0 | 286.0 |  | 1.10× |" in text
    # today's runtime against the legacy ratio measured in the same run
    assert "| bert: step vs eager on today's runtime ≥ on 1.19.2 (1.10×) | 1.20× | yes |" in text
    assert "| mlp: step vs eager on today's runtime ≥ on 1.19.2 (0.80×) | 1.25× | yes |" in text
    assert "| bert: first graph build < 10 s | 7.00 s | yes |" in text
    assert "| bert: graph from the cache < 1 s | 0.70 s | yes |" in text
    assert "gradient source `torch`" in text and "gradient source `onnxruntime`" in text
    assert bench.charts[0]["bert"]["ort_trainer (legacy)"] == pytest.approx(260 / 286)
