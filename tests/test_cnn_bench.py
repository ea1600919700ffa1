"""``benchmarks/cnn.py``: each implementation trains the ResNet in its own process, and its table says what it
measured."""

import sys
from pathlib import Path

import pytest

from ort_trainer import _runtime

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cnn  # noqa: E402  (benchmarks/cnn.py)

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")


def test_the_bench_runs_each_implementation_in_its_own_process_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "cnn.md"
    cnn.main(["--tiny", "--rounds", "1", "--steps", "1", "--out", str(out)])
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(runs) == 3  # one process per implementation
    text = out.read_text()
    assert text.startswith("# ResNet-18 training: ort_trainer against eager PyTorch (tiny size)")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| implementation")}
    assert list(rows) == ["eager", "torch_kernels", "onnx_backward"]
    assert rows["eager"][2] == "1.00×"
    for cells in rows.values():
        assert float(cells[1]) > 0 and float(cells[3]) > 0 and float(cells[5]) > 0


def test_the_performance_page_gives_the_command():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert "python benchmarks/cnn.py --rounds 2 --steps 10 --out docs/benchmarks_cnn.md" in page
