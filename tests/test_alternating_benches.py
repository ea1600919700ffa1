"""``benchmarks/lstm.py`` and ``benchmarks/cnn.py`` (``benchmarks/alternating.py``): each implementation trains in its
own process, and the table says what it measured; the performance page gives each command."""

import sys
from pathlib import Path

import pytest

from ort_trainer import _runtime

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cnn  # noqa: E402  (benchmarks/cnn.py)
import lstm  # noqa: E402  (benchmarks/lstm.py)

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# the bench, its arguments, its page's title and command, and its implementations (eager PyTorch's first)
_BENCHES = {
    "lstm": (lstm, [], "LSTM training", "python benchmarks/lstm.py", ["eager", "fused", "unrolled"]),
    "packed lstm": (lstm, ["--packed"], "packed LSTM training", "python benchmarks/lstm.py --packed",
                    ["eager", "fused", "unrolled"]),
    "cnn": (cnn, [], "ResNet-18 training", "python benchmarks/cnn.py", ["eager", "torch_kernels", "onnx_backward"]),
}


@pytest.mark.parametrize("bench", list(_BENCHES))
def test_the_bench_runs_each_implementation_in_its_own_process_and_writes_its_table(bench, tmp_path, capsys):
    module, arguments, title, command, implementations = _BENCHES[bench]
    out = tmp_path / "bench.md"
    module.main(["--tiny", "--rounds", "1", "--steps", "1", "--out", str(out), *arguments])
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(runs) == len(implementations)  # one process per implementation
    text = out.read_text()
    assert text.startswith(f"# {title}: ort_trainer against eager PyTorch (tiny size)")
    assert f"`{command}`, " in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| implementation")}
    assert list(rows) == implementations
    assert rows["eager"][2] == "1.00×"
    for cells in rows.values():
        assert float(cells[1]) > 0 and float(cells[3]) > 0 and float(cells[5]) > 0


def test_the_performance_page_gives_the_commands():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert "python benchmarks/lstm.py --rounds 2 --steps 20 --out docs/benchmarks_lstm.md" in page
    assert "python benchmarks/lstm.py --packed --rounds 2 --steps 20 --out docs/benchmarks_lstm_packed.md" in page
    assert "python benchmarks/cnn.py --rounds 3 --steps 10 --out docs/benchmarks_cnn.md" in page
