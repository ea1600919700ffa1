"""``benchmarks/accumulation.py``: its processes train k micro-batches per step as eager PyTorch does,
and its table says what it measured."""

import sys
from pathlib import Path

import pytest

from ort_trainer import _runtime

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import accumulation  # noqa: E402  (benchmarks/accumulation.py)

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# Two steps of 2 micro-batches of GPT-2 tiny (2 layers of width 32, vocabulary 500): each loss is a
# forward whose sums (≤ 500 terms, the vocabulary's log-sum-exp) differ in order from torch's, after
# one update that differs by as much carried through Adam: ≤ 2 · 500 · 2^-24 = 6e-5. The cell shows
# two significant digits; the test holds 1e-4. Observed: ~1e-7.
LOSS_BOUND = 1e-4


def test_the_bench_trains_each_implementation_in_its_own_process_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "accumulation.md"
    accumulation.main(["--models", "gpt2-tiny", "--k", "2", "--rounds", "2", "--windows", "2", "--out", str(out)])
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(runs) == 4  # two rounds, one process per implementation each
    text = out.read_text()
    assert text.startswith("# Gradient accumulation at real sizes")
    row = next(line for line in text.splitlines() if line.startswith("| gpt2-tiny "))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == "2×16 × 2"
    assert float(cells[2]) <= LOSS_BOUND
    ort_s, eager_s = (float(v) for v in cells[3].split(" / "))
    assert ort_s > 0 and eager_s > 0
    # the ratio is of the unrounded medians: 3 significant digits each bound the difference
    assert float(cells[4].rstrip("×")) == pytest.approx(eager_s / ort_s, rel=0.01)
    peaks, ratios = cells[5].split(" (")
    cold, warm, eager = (float(v) for v in peaks.split(" / "))
    # each ratio is of the unrounded peaks, shown to 2 decimals (±0.005); the peaks shown are rounded to 1 MB (±0.5
    # each), which moves peak / eager by at most (0.5 + 0.5 · peak / eager) / (eager - 0.5): 0.0023 at ~460 MB
    for shown, peak in zip((float(v) for v in ratios.rstrip(")").split(" / ")), (cold, warm)):
        assert abs(shown - peak / eager) <= 0.005 + (0.5 + 0.5 * peak / eager) / (eager - 0.5) + 1e-9


def test_rows_without_a_language_model_and_a_single_micro_batch_are_refused(capsys):
    with pytest.raises(SystemExit):
        accumulation.main(["--models", "mlp-1024,gpt3", "--k", "1"])
    error = capsys.readouterr().err
    assert "unknown: ['mlp-1024', 'gpt3']" in error and "--k ≥ 2" in error


def test_the_performance_page_gives_the_command():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert "python benchmarks/accumulation.py --models gpt2,bert --k 4 --out docs/benchmarks_accumulation.md" in page
