"""``make bench-threads`` (``benchmarks/host_threads.py``): its processes train, and its table says
what it measured and what ``device.host_threads``' default picks."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import host_threads  # noqa: E402  (benchmarks/host_threads.py)

from ort_trainer.devices import ONE_THREAD_UPDATE_WEIGHTS  # noqa: E402


def test_the_bench_trains_each_count_in_its_own_process_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "threads.md"
    # --threads 2: a machine whose torch has one thread still compares two counts
    host_threads.main(["--widths", "16,24", "--threads", "2", "--rounds", "1", "--steps", "3", "--warmup", "1",
                       "--out", str(out)])
    printed = capsys.readouterr().out
    runs = [line for line in printed.splitlines() if line.startswith("{")]
    assert len(runs) == 4  # two widths, two counts, one process each
    text = out.read_text()
    assert text.startswith("# host_threads: one torch thread against 2")
    rows = [line for line in text.splitlines() if line.startswith("| 16 ") or line.startswith("| 24 ")]
    assert len(rows) == 2
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        one, many = float(cells[2]), float(cells[3])
        assert one > 0 and many > 0 and cells[4] == "2"
        # the ratio is of the unrounded steps: the cells' 2 decimals (±0.005 ms each) bound the difference
        ratio = float(cells[5].rstrip("×"))
        assert abs(ratio - many / one) <= many / one * (0.005 / one + 0.005 / many) + 0.005
        assert cells[6] == "1"  # a few hundred weights: under the bound, the default's single thread


def test_the_table_names_the_default_s_choice_on_each_side_of_the_bound():
    below, above = ONE_THREAD_UPDATE_WEIGHTS, ONE_THREAD_UPDATE_WEIGHTS + 1
    results = []
    for width, weights, default in ((1, below, 1), (2, above, 8)):
        for threads, ms in ((1, 10.0), (8, 12.5)):
            results.append({"width": width, "threads": threads, "torch_threads": 8, "weights": weights,
                            "default_threads": default, "step_ms": ms})
    lines = host_threads.table(results).splitlines()
    assert lines[2].endswith("| 10.00 | 12.50 | 8 | 1.25× | 1 |")
    assert lines[3].endswith("| 8 | 1.25× | 8 (torch's) |")


def test_make_bench_threads_runs_the_script_into_the_docs_table():
    import subprocess

    dry = subprocess.run(["make", "-n", "--no-print-directory", "bench-threads", "PY=py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    commands = [line.rstrip() for line in dry.stdout.splitlines() if not line.startswith("make")]
    assert commands[-1] == "py benchmarks/host_threads.py --out docs/benchmarks_threads.md"
    assert "make bench-threads" in (ROOT / "README.md").read_text()
