"""The benchmark report: a row per model per runtime, both runtimes against one eager/compile measurement."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tolerances import FLOAT64

REPO = Path(__file__).resolve().parents[1]

# A chart value is a ratio of two medians in milliseconds, in float64 (unit roundoff FLOAT64 =
# 2^-53): each median (0.25 s, 0.26 s, 0.30 s, 0.31 s) is rounded when written, scaled by 1000, and
# the two are divided: 5 roundings on the report's side, 1 in the expected ``260 / 300``: at most
# 6 · 2^-53 = 6.7e-16 relative apart. Observed at 1 and 2 threads: 0 (the same bits).
RATIO_BOUND = 6 * FLOAT64


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    charts = []
    # (the page and its chart: benchmarks/run_report.py, which run.py imports)
    monkeypatch.setattr(sys.modules["run_report"], "_chart", lambda chart, path: charts.append(chart))
    module.charts = charts
    return module


def _timed(train_s: list[float], runtime: str | None = None, source: str | None = None) -> dict:
    """One implementation's timing as the rounds leave it: every timed step of every round."""
    record = {"train": train_s, "eval": [t / 3 for t in train_s], "round_medians_ms": [1000 * train_s[0]],
              "round_other_cores": [0.05], "errors": []}
    if runtime:
        record.update(runtime=runtime, gradient_source=source)
    return record


def _runtime_entry(rss_ort_mb: float) -> dict:
    return {"build_cold": {"first_step_s": 7.5, "step_s": 0.5},
            "build_cached": {"first_step_s": 1.2, "step_s": 0.5},
            "rss": {"ort": {"peak_rss_mb": rss_ort_mb}, "eager": {"peak_rss_mb": 750.0}}}


def _report() -> dict:
    current, legacy = "onnxruntime 1.31.1", "onnxruntime-training-cpu 1.19.2"
    return {
        "machine": "test machine", "load_before": (1.5, 1.25, 1.0), "load_after": (2.0, 1.5, 1.0),
        "timing_settings": {"steps": 10, "min_seconds": 2.0},
        "timing": {
            # medians: the middle of the pooled steps (0.25 here), not the mean
            "bert": {"ort@current": _timed([0.25, 0.24, 0.9], current, "torch"),
                     "ort@legacy": _timed([0.26, 0.26, 0.26], legacy, "onnxruntime"),
                     "eager": _timed([0.30, 0.30, 0.31]), "compile": _timed([0.31, 0.31, 0.31])},
            "mlp": {"ort@current": _timed([0.002] * 3, current, "torch"),
                    "ort@legacy": _timed([0.003] * 3, legacy, "onnxruntime"),
                    "eager": _timed([0.0025] * 3)},
        },
        "runtimes": {"current": {"bert": _runtime_entry(700.0), "mlp": _runtime_entry(700.0)},
                     "legacy": {"bert": _runtime_entry(600.0), "mlp": _runtime_entry(600.0)}},
    }


def test_both_runtimes_are_rated_against_the_same_eager_and_compile_measurement(bench, tmp_path):
    out = tmp_path / "benchmarks.md"
    bench.write_report(_report(), out)
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| bert | ") or line.startswith("| mlp | ")]
    training = [r for r in rows if r.count("|") == 10]
    assert [r.split("|")[1:3] for r in training] == [[" bert ", " current "], [" bert ", " legacy "],
                                                     [" mlp ", " current "], [" mlp ", " legacy "]]
    # one eager (300 ms) and one torch.compile (310 ms) in both rows; the legacy row has its vs-compile ratio
    assert "| bert | current | 250.0 | 300.0 | 310.0 | 1.20× | 1.24× | 700 / 750 | 0.93 |" in text
    assert "| bert | legacy | 260.0 | 300.0 | 310.0 | 1.15× | 1.19× | 600 / 750 | 0.80 |" in text
    assert "| mlp | legacy | 3.00 | 2.50 | not run | 0.83× | nan× |" in text  # two decimals below 10 ms
    assert "| bert | legacy | 86.7 | 100.0 | 1.15× |" in text  # evaluation against the same eager no_grad
    assert "| bert | ort@current | 250.0 (0.05) |" in text and "| bert | eager | 300.0 (0.05) |" in text
    # today's runtime against the legacy ratio: two ort processes against one eager
    assert "| bert: step vs eager on today's runtime ≥ on 1.19.2 (1.15×) | 1.20× | yes |" in text
    assert "| mlp: step vs eager on today's runtime ≥ on 1.19.2 (0.83×) | 1.25× | yes |" in text
    assert "| bert: step ≥ 1.0× torch.compile | 1.24× | yes |" in text
    assert "| bert: step ≥ 1.3× eager | 1.20× | no, by 8% |" in text
    assert "mlp: step ≥ 1.0× torch.compile" not in text
    assert "| bert: first graph build < 10 s | 7.00 s | yes |" in text
    assert "| bert: graph from the cache < 1 s | 0.70 s | yes |" in text
    assert "gradient source `torch`" in text and "gradient source `onnxruntime`" in text
    assert "each implementation in its own process, alternating rounds; both runtimes against the same " \
           "eager/compile measurement" in text
    assert "1.50 / 1.25 / 1.00 at the start, 2.00 / 1.50 / 1.00 at the end" in text
    assert "(training steps: at least 10 and for at least 2 s; then evaluation steps: at least 3 and for at " \
           "least 2 s)" in text
    chart = bench.charts[0]["bert"]
    assert chart["ort_trainer (legacy)"] == pytest.approx(260 / 300, rel=RATIO_BOUND, abs=0)
    assert chart["ort_trainer (current)"] == pytest.approx(250 / 300, rel=RATIO_BOUND, abs=0)
    assert chart["torch.compile"] == pytest.approx(310 / 300, rel=RATIO_BOUND, abs=0)


def test_a_failed_runtime_gets_a_failed_row_and_the_ablation_says_it_shares_a_process(bench, tmp_path):
    report = _report()
    report["timing"]["mlp"]["ort@legacy"] = {"train": [], "eval": [], "round_medians_ms": [],
                                             "errors": ["ImportError: no onnxruntime"]}
    report["runtimes"]["current"]["mlp"]["ablation"] = {
        "sparse_labels": {"train": {"ort": [0.002] * 3, "ort_without:sparse_labels": [0.003] * 3}}}
    out = tmp_path / "benchmarks.md"
    bench.write_report(report, out)
    text = out.read_text()
    assert "| mlp | legacy | failed: {'ort@legacy': ['ImportError: no onnxruntime'], 'eager': []} |" in text
    assert "| mlp | current | 2.00 | 2.50 |" in text
    assert "| mlp | current | sparse_labels | 2.00 | 3.00 | 1.50× |" in text
    assert "alternating in one process per runtime: both sides are ONNX Runtime" in text
    assert "| mlp: step vs eager on today's runtime ≥ on 1.19.2 (nan×) | 1.25× | not measured |" in text


def test_the_rounds_alternate_fresh_processes_and_pool_every_timed_step(bench, monkeypatch):
    calls = []

    def spawn(kind, model, impls, steps, warmup=3, rounds=1, env=None, python="python", min_seconds=0.0):
        calls.append((impls, python, env["ORT_TRAINER_CACHE_DIR"], rounds, min_seconds))
        step = {"ort": 0.001 * len(calls), "eager": 0.002, "compile": 0.003}[impls]
        if python == "legacy-python" and len(calls) > 4:
            return {"error": "RuntimeError: killed"}
        return {"train": {impls: [step] * steps}, "eval": {impls: [step / 2]}, "errors": {},
                "runtime": f"runtime of {python}", "gradient_source": "torch"}

    monkeypatch.setattr(bench, "_spawn", spawn)
    args = type("Args", (), {"steps": 2, "warmup": 1, "rounds": 2, "min_seconds": 1.5})()
    envs = {"current": {"ORT_TRAINER_CACHE_DIR": "/c"}, "legacy": {"ORT_TRAINER_CACHE_DIR": "/l"}}
    timing = bench._timing_rounds("mlp", ["ort", "eager", "compile"], {"current": "py", "legacy": "legacy-python"},
                                  envs, args)
    assert [c[:3] for c in calls] == [("ort", "py", "/c"), ("ort", "legacy-python", "/l"), ("eager", "py", "/c"),
                                      ("compile", "py", "/c"), ("compile", "py", "/c"), ("eager", "py", "/c"),
                                      ("ort", "legacy-python", "/l"), ("ort", "py", "/c")]
    assert {c[3] for c in calls} == {1}  # one round per worker process
    assert {c[4] for c in calls} == {1.5}  # each worker times for at least --min-seconds
    assert list(timing) == ["ort@current", "ort@legacy", "eager", "compile"]
    assert timing["ort@current"]["train"] == [0.001, 0.001, 0.008, 0.008]
    assert timing["ort@current"]["round_medians_ms"] == [1.0, 8.0]
    assert timing["eager"]["eval"] == [0.001, 0.001]
    assert timing["ort@legacy"]["train"] == [0.002, 0.002]
    assert timing["ort@legacy"]["errors"] == ["RuntimeError: killed"]
    assert timing["ort@legacy"]["runtime"] == "runtime of legacy-python"
    assert len(timing["ort@current"]["round_other_cores"]) == 2 and len(timing["ort@legacy"]["round_other_cores"]) == 1


def test_the_load_of_other_processes_excludes_the_worker(bench):
    # 10 s of wall clock, 14 CPU-seconds busy on the machine, 9 of them the worker's: others kept 0.5 cores busy
    assert bench._cores_used_by_others((100.0, 50.0, 3.0), (110.0, 64.0, 12.0)) == 0.5
    assert bench._cores_used_by_others((100.0, 50.0, 3.0), (110.0, 55.0, 12.0)) == 0.0
    assert bench._cores_used_by_others(None, (110.0, 64.0, 12.0)) is None


def test_a_worker_times_at_least_the_steps_and_at_least_the_seconds(bench, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def step(seconds):
        return lambda: clock.__setitem__(0, clock[0] + seconds)

    assert bench._timed_steps(step(1.0), 5, 2.0) == [1.0] * 5  # a slow step: the steps bound
    assert bench._timed_steps(step(0.25), 3, 2.0) == [0.25] * 8  # a fast step: timed for 2 s


def test_the_real_size_benchmark_times_evaluations_for_at_least_the_calls_and_the_seconds(monkeypatch):
    """``real_sizes._timed_calls``: every batch once, then the batches after the first in turn until
    the calls after the first add up to the seconds asked for (the MLP's 4 ms evaluations)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import real_sizes

    clock, seen = [0.0], []
    monkeypatch.setattr(real_sizes.time, "perf_counter", lambda: clock[0])

    def call(seconds):
        def run(batch):
            seen.append(batch)
            clock[0] += seconds
        return run

    assert real_sizes._timed_calls(call(1.0), [[0], [1], [2], [3]], least_seconds=2.0) == [1.0] * 4  # slow: each once
    assert seen == [0, 1, 2, 3]
    seen.clear()
    assert real_sizes._timed_calls(call(0.25), [[0], [1], [2], [3]], least_seconds=2.0) == [0.25] * 9
    assert seen == [0, 1, 2, 3, 1, 2, 3, 1, 2]  # the first batch (the first use's) is not timed again
    assert len(real_sizes._timed_calls(call(0.0), [[0], [1]], least_seconds=1.0, most=50)) == 50


def test_the_real_size_benchmarks_best_time_takes_the_repeats_or_the_seconds_whichever_is_more(monkeypatch):
    """``real_sizes._best_seconds``: a warm-up call, then at least ``repeats`` timed calls, more until they
    add up to ``least_seconds``; the fastest."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import real_sizes

    clock, calls = [0.0], []
    monkeypatch.setattr(real_sizes.time, "perf_counter", lambda: clock[0])

    def run():  # each call 0.1 s, the fourth 0.05 s
        calls.append(None)
        clock[0] += 0.05 if len(calls) == 4 else 0.1

    assert real_sizes._best_seconds(run, repeats=5) == pytest.approx(0.05) and len(calls) == 6
    calls.clear()
    assert real_sizes._best_seconds(run, repeats=2, least_seconds=0.95) == pytest.approx(0.05)
    assert len(calls) == 1 + 10  # 0.1 × 9 + 0.05 = 0.95 s of timed calls


def test_the_real_size_benchmark_reports_the_median_and_range_of_cold_builds_and_first_saves(monkeypatch):
    """``real_sizes.row``: the first ``cold_rounds`` ort_trainer runs are the cold builds (their median
    first step, their range, their largest peak), the later ones the warm runs and first saves."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import real_sizes

    def run(first_s, peak_mb, save_s=None):
        report = {"first_s": first_s, "peak_mb": peak_mb, "step_s": [1.0], "losses": [2.0], "graph_s": 0.5,
                  "eval_s": [0.3, 0.1], "eval_all_s": [0.4, 0.1], "eval_peak_mb": peak_mb + 0.5}
        return report if save_s is None else {**report, "save_s": save_s, "save_peak_mb": peak_mb + 1}

    runs = {"ort": [run(12.0, 300), run(16.0, 310), run(5.0, 200, 4.5), run(6.0, 210, 4.0), run(7.0, 205, 5.5)],
            "eager": [run(3.0, 250)] * 5, "ceiling": {"flops": 1e9, "gemm_gflops": {"torch": 10.0}}}
    figures = real_sizes.row("gpt2", runs, cold_rounds=2)
    assert (figures["cold_s"], figures["ort_peak_cold_mb"]) == (14.0, 310)
    assert (figures["warm_s"], figures["ort_peak_warm_mb"], figures["save_s"], figures["save_peak_mb"]) == (6.0, 210, 4.5,
                                                                                                           211)
    cells = [cell.strip() for cell in real_sizes.table([figures]).splitlines()[-1].strip("|").split("|")]
    assert (cells[3], cells[14], cells[15]) == ("14.0 (12.0–16.0)", "4.5 (4.0–5.5)", "210 / 211")
    assert cells[9] == "—"  # no process timed the host's GEMM
    assert (cells[5], cells[6], cells[8]) == ("—", "1 / 1 / —", "—")  # no torch.compile process


def test_the_real_size_benchmark_gives_each_rounds_speed_up_and_the_hosts_gemm_rate(monkeypatch):
    """``real_sizes.row``: round i's ort_trainer and eager processes (run back to back) give that round's
    ratio of median steps; the speed-up cell shows their range, the host-GEMM cell the median and range of
    every process's probe."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import real_sizes

    def run(steps, gflops):
        return {"first_s": 1.0, "peak_mb": 100, "step_s": steps, "losses": [2.0], "graph_s": 0.1, "eval_s": [0.3, 0.1],
                "eval_all_s": [0.4, 0.1], "eval_peak_mb": 100, "host_gflops": gflops, "save_s": 4.0, "save_peak_mb": 101}

    # round 1 on a slow minute: both its processes slowed, ort_trainer's more
    runs = {"ort": [run([2.0, 2.2, 2.1], 200.0), run([3.0, 3.0], 140.0), run([2.0], 190.0)],
            "eager": [run([3.0], 198.0), run([3.3, 3.6, 3.4], 150.0), run([2.8], 195.0)],
            "ceiling": {"flops": 1e9, "gemm_gflops": {"torch": 10.0}}}
    figures = real_sizes.row("gpt2", runs, cold_rounds=1)
    assert figures["round_speedups"] == pytest.approx([3.0 / 2.1, 3.4 / 3.0, 2.8 / 2.0])
    assert sorted(figures["host_gflops"]) == [140.0, 150.0, 190.0, 195.0, 198.0, 200.0]
    cells = [cell.strip() for cell in real_sizes.table([figures]).splitlines()[-1].strip("|").split("|")]
    # the pooled medians: ort_trainer's 6 steps 2.15, eager's 5 steps 3.3
    assert cells[7] == f"{3.3 / 2.15:.2f}× (1.13–1.43)"
    assert cells[9] == "192 (140–200)"


def test_the_real_size_benchmark_takes_sizes_and_refuses_bad_ones_all_at_once(monkeypatch):
    """``--batch`` / ``--seq`` replace the rows' sizes (0 keeps them); a negative size and an unknown
    row are refused together, before any process starts."""
    import subprocess
    import sys

    import real_sizes

    monkeypatch.setattr(real_sizes, "SIZES", dict(real_sizes.SIZES))
    real_sizes.resize(["gpt2", "mlp-1024"], seq=512)
    assert real_sizes.SIZES["gpt2"] == (4, 512, 3) and real_sizes.SIZES["mlp-1024"] == (128, 512, 200)
    assert real_sizes.SIZES["bert"] == (4, 128, 3)  # a row not asked for keeps its size
    real_sizes.resize(["gpt2"], batch=1)
    assert real_sizes.SIZES["gpt2"] == (1, 512, 3)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "real_sizes.py"), "--models", "gpt2,gtp2",
                           "--batch", "-2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--batch must be positive" in done.stderr and "unknown ['gtp2']" in done.stderr


_SAPPHIRE_RAPIDS = """processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8488C
flags		: fpu sse avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8

processor	: 1
vendor_id	: GenuineIntel
"""


def test_the_benchmark_names_the_cpu_kind_and_the_extensions_that_pick_gemm_kernels(monkeypatch, tmp_path):
    """``benchmarks/host.py``: the vendor's microarchitecture from /proc/cpuinfo's numbers, the extensions
    it has and lacks; ``real_sizes_report.write_index`` lists each kind's page."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import host
    import real_sizes_report

    cpu = host.describe(_SAPPHIRE_RAPIDS)
    assert (cpu["kind"], cpu["model"]) == ("intel-sapphire-rapids", "Intel(R) Xeon(R) Platinum 8488C")
    assert cpu["isa"] == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                          "amx_bf16", "amx_int8"]
    assert host.sentence(cpu).endswith("amx_int8; without amx_fp16")
    zen4 = host.describe(_SAPPHIRE_RAPIDS.replace("GenuineIntel", "AuthenticAMD").replace(": 6\n", ": 25\n")
                         .replace(": 143", ": 17").replace(" avx512_fp16 amx_bf16 amx_tile amx_int8", ""))
    assert zen4["kind"] == "amd-zen4" and host.sentence(zen4).endswith("; without avx512_fp16, AMX")
    unknown = host.describe(_SAPPHIRE_RAPIDS.replace(": 143", ": 200"))
    assert unknown["kind"] == "intel-family6-model200" and unknown["microarchitecture"] is None
    pages = tmp_path / "benchmarks_real"
    pages.mkdir()
    (pages / "amd-zen4.md").write_text("# Real-size benchmark: AMD EPYC (amd-zen4)\n\n`cmd` (rounds: gpt2 5) on AMD "
                                       "EPYC (...), 2 cores; avx2; torch 2.13.0+cpu, onnxruntime 1.31.1; 2026-11-28.\n")
    real_sizes_report.write_index(tmp_path / "index.md", pages)
    assert ("- [AMD EPYC (amd-zen4)](benchmarks_real/amd-zen4.md): AMD EPYC (...), 2 cores; avx2; torch 2.13.0+cpu, "
            "onnxruntime 1.31.1, 2026-11-28") in (tmp_path / "index.md").read_text()


def test_the_real_size_benchmark_runs_end_to_end_on_a_tiny_gpt2(tmp_path, monkeypatch):
    """``make bench-real``'s script, at a size that runs in a minute: every column filled, torch.compile's
    among them, the CPU named; the losses of ort_trainer and eager equal to float32 roundoff; ``--seq``
    sets the row's sequence length, in every process."""
    pytest.importorskip("transformers")
    import subprocess
    import sys

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import host

    out = tmp_path / "real.md"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "real_sizes.py"), "--models", "gpt2-tiny",
                           "--rounds", "2", "--compile-rounds", "1", "--seq", "24", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "`python benchmarks/real_sizes.py --models gpt2-tiny --rounds 2 --compile-rounds 1 --seq 24`" in text
    assert f"({host.describe()['kind']})" in text.splitlines()[0]  # the CPU kind in the title
    assert f" on {host.sentence(host.describe())}; torch " in text  # the CPU, its extensions, in the header
    (row,) = [line for line in text.splitlines() if line.startswith("| gpt2-tiny")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == 19 and "—" not in cells, row
    assert cells[1] == "2×24"  # the row's batch, the sequence asked for
    # 3 Adam steps of a 2-layer GPT-2 of width 32 in float32 on both sides: sums of at most 4·32
    # terms in another order, carried through the weights once per step: steps_bound(3, 128) =
    # 2.3e-5 relative (Higham's bound)
    from tolerances import steps_bound

    assert float(cells[2]) <= steps_bound(3, length=128)
    warm, ready = cells[4].rstrip(")").split(" (")
    assert 0 <= float(ready) <= float(warm) + 0.05  # found in the cache within the warm first step (rounded to 0.1 s)
    assert float(cells[5]) > 0  # torch.compile's first step: the compilation
    assert all(float(x) > 0 for x in cells[6].split(" / "))  # ort_trainer's, eager's and torch.compile's steps
    speedup, rounds = cells[7].rstrip(")").split("× (")  # the pooled speed-up, the two rounds' own
    low, high = (float(x) for x in rounds.split("–"))
    assert 0 < low <= high and float(speedup) > 0
    assert float(cells[8].rstrip("×")) > 0  # against torch.compile
    rate, rate_range = cells[9].rstrip(")").split(" (")  # the host's GEMM rate in the 5 training processes
    # (a process whose torch threads shared the cores with another job can read under 0.5 GFLOP/s, printed 0: its
    # product waits for a descheduled thread on every call; the median of such processes too, when all share them)
    assert float(rate) >= 0 and all(float(x) >= 0 for x in rate_range.split("–"))
    ort_rate, eager_rate, compile_rate, peak = (float(x) for x in cells[10].split(" / "))
    assert 0 < ort_rate and 0 < eager_rate and 0 < compile_rate and 0 < peak  # FLOP rates and the GEMM peak
    assert float(cells[11].rstrip("×")) > 0
    cold_mb, warm_mb, eager_mb, compile_mb = (float(x) for x in cells[12].split(" / "))  # peak RSS
    assert 0 < cold_mb and 0 < warm_mb and 0 < eager_mb and 0 < compile_mb
    cold_ratio, warm_ratio = (float(x) for x in cells[13].split(" / "))
    # each ratio printed to 0.01 (±0.005) from unrounded peaks, the peaks to 1 MB (±0.5 each): the
    # rounded figures' ratio is off by at most 0.005 + 0.5·(1 + ratio) / eager, under this for ratios < 3
    slack = 0.01 + 2 / eager_mb
    assert abs(cold_ratio - cold_mb / eager_mb) <= slack and abs(warm_ratio - warm_mb / eager_mb) <= slack
    assert float(cells[14]) > 0  # a save time (one warm round: one save, no range)
    before, after = (float(x) for x in cells[15].split(" / "))  # the peak before and after it
    assert 0 < before <= after
    assert all(float(x) > 0 for x in cells[16].split(" / "))  # the first evaluation, after a cold and a warm build
    assert float(cells[17]) > 0  # the first evaluation of every output
    times, speedup = cells[18].rstrip("×)").split(" (")
    assert all(float(x) > 0 for x in times.split(" / ")) and float(speedup) > 0


def test_the_memory_breakdown_accounts_for_every_buffer_of_a_tiny_gpt2():
    """``benchmarks/memory_breakdown.py``: the phases' memory and the engine's buffers, with the
    module's weights shared with the engine (none held twice)."""
    pytest.importorskip("transformers")
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_breakdown.py"), "--model", "gpt2-tiny",
                           "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert list(report["phases_mb"]) == ["imported", "model built", "trainer constructed", "step 1", "step 2"]
    parts = report["components_mb"]
    weights = report["weights"] * 4 / 2**20
    # the report rounds each figure to 3 decimals of a MB: ≤ 5e-4 MB from the exact size; 5e-3
    # leaves a 10x margin, while a second copy of the weights or a missing moment is 0.17 MB
    assert weights > 0.1
    assert parts["engine weights (flat)"] == pytest.approx(weights, abs=5e-3)
    assert parts["engine optimizer states (flat)"] == pytest.approx(2 * weights, abs=5e-3)  # Adam's two moments
    assert parts["module storage shared with the engine"] >= weights - 5e-3  # the module holds no copy
