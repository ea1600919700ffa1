"""The page ``benchmarks/real_sizes.py`` writes: the table of its rows, what each column means, the CPU
it ran on; and the index of the results per CPU kind (``docs/benchmarks_real.md``)."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import host

LOSS_STEPS = 10  # losses compared with eager's

_COLUMNS = [
    "model", "B×S", f"losses vs eager (max rel., first {LOSS_STEPS})", "first step, cold cache s",
    "first step, warm cache s (graph ready)", "torch.compile first step s", "step ort / eager / compile s",
    "speed-up vs eager (rounds' range)", "speed-up vs torch.compile", "host GEMM GFLOP/s (range)",
    "GFLOP/s ort / eager / compile / GEMM peak", "speed-up ceiling",
    "peak RSS ort cold build / warm build / eager / compile MB", "ratio to eager cold / warm", "save_as_onnx s",
    "peak before / after save MB", "first eval_step (loss) after a cold / warm build s",
    "first eval_step, every output, after a cold build s", "eval_step, every output, ort / eager no_grad s (speed-up)",
]


def table(rows: list[dict]) -> str:
    """The markdown table of ``real_sizes.row``'s figures (``—`` where a figure was not measured)."""
    def number(value, fmt):
        return "—" if value is None else format(value, fmt)

    def span(values: list[float], fmt: str) -> str:  # " (least–most)" of two samples or more
        return f" ({min(values):{fmt}}–{max(values):{fmt}})" if len(values) > 1 else ""

    def spread(value, values: list[float]):  # a median, with the samples' range where there are several
        return number(value, ".1f") + ("" if value is None else span(values, ".1f"))

    def rate(row: dict, step_s):  # the step's matrix-product GFLOP per second
        return None if step_s is None else row["gflop"] / step_s

    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for r in rows:
        compile_s = r.get("compile_step_s")
        lines.append(
            f"| {r['model']} | {r['size']} | {r['loss_rel_diff']:.1e} | {spread(r['cold_s'], r['cold_range'])} "
            f"| {number(r['warm_s'], '.1f')} ({number(r['warm_graph_s'], '.2f')}) "
            f"| {spread(r.get('compile_first_s'), r.get('compile_first_range', []))} "
            f"| {r['ort_step_s']:.3g} / {r['eager_step_s']:.3g} / {number(compile_s, '.3g')} "
            f"| {r['speedup']:.2f}×{span(r['round_speedups'], '.2f')} "
            f"| {number(compile_s and compile_s / r['ort_step_s'], '.2f')}{'×' if compile_s else ''} "
            f"| {number(statistics.median(r['host_gflops']) if r['host_gflops'] else None, '.0f')}"
            f"{span(r['host_gflops'], '.0f')} "
            f"| {rate(r, r['ort_step_s']):.3g} / {rate(r, r['eager_step_s']):.3g} "
            f"/ {number(rate(r, compile_s), '.3g')} "
            f"/ {r['gemm_gflops']:.3g} "
            f"| {r['gemm_gflops'] * r['eager_step_s'] / r['gflop']:.2f}× "
            f"| {r['ort_peak_cold_mb']:.0f} / {number(r['ort_peak_warm_mb'], '.0f')} / {r['eager_peak_mb']:.0f} "
            f"/ {number(r.get('compile_peak_mb'), '.0f')} "
            f"| {r['ort_peak_cold_mb'] / r['eager_peak_mb']:.2f} / "
            f"{number(r['ort_peak_warm_mb'] and r['ort_peak_warm_mb'] / r['eager_peak_mb'], '.2f')} "
            f"| {spread(r['save_s'], r['save_range'])} "
            f"| {number(r['presave_peak_mb'], '.0f')} / {number(r['save_peak_mb'], '.0f')} "
            f"| {r['first_eval_cold_s']:.2f} / {number(r['first_eval_warm_s'], '.2f')} | {r['first_eval_all_cold_s']:.2f} "
            f"| {r['ort_eval_s']:.3g} / {r['eager_eval_s']:.3g} ({r['eager_eval_s'] / r['ort_eval_s']:.2f}×) |")
    return "\n".join(lines)


def page(command: str, rounds: dict, compile_rounds: dict, cpu: dict, rows: list[dict], eval_calls: int,
         eval_seconds: float) -> str:
    """The whole page: the command, the CPU and versions, what the columns mean, the table."""
    import onnxruntime
    import torch

    counts = ", ".join(f"{model} {count} ({compile_rounds[model]} compiled)" for model, count in rounds.items())
    return (
        f"# Real-size benchmark: {cpu['model']} ({cpu['kind']})\n\n`{command}` (rounds: {counts}) on "
        f"{host.sentence(cpu)}; torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; "
        f"{time.strftime('%Y-%m-%d')}.\n\n"
        "Speed-up: eager's (or torch.compile's) median step over ort_trainer's. torch.compile: "
        "`torch.compile(model)` with its default backend (inductor), trained as eager is (AdamW, clipping); its first "
        "step compiles (its column); its steps are timed after it, and it is not evaluated. Cold first step: the "
        "median over the first rounds' ort_trainer processes, each starting from an empty graph cache (the range in "
        "brackets where there are several). Peak RSS: the whole process's; ort_trainer's the most over the processes "
        "that built the graphs (they also import torch's export stack) and the most over the processes that found "
        "them in the cache, eager's and torch.compile's the most over rounds. save_as_onnx: each warm process's first "
        "save, pointed at an empty graph cache (the model's first save ever: it imports torch's export stack and "
        "exports the symbolic eval graph), the median (the range in brackets); the peak before it (after training and "
        "evaluating) and after it, the most over those processes. The warm first step is a new process finding the "
        "graph in the on-disk cache; graph ready: the part of it that found and loaded the graph (the rest makes the "
        "engine's buffers and sessions and runs the step). GFLOP/s: the step's matrix-product FLOPs (torch's flop "
        "counter, forward and backward) per second of step; GEMM peak: the best float32 matrix-product rate torch or "
        "ONNX Runtime reached on this machine at the row's layer shapes; host GEMM: torch's rate at the row's largest "
        "layer shape, timed by every training process just before its first step (the median and range over the "
        "processes: the host's speed drifts from minute to minute); the speed-up's range is the rounds' own ratios, "
        "each of two processes run back to back; speed-up ceiling: that peak over eager's rate, the most a step of "
        "nothing but matrix products at the peak could gain over eager. Evaluation: eager's forward under no_grad in "
        "eval mode; ort_trainer's eval_step first with the loop's fetches (the loss), its first call the eval graph's "
        "first use in a process whose training graph was built (cold) or found in the cache (warm), then with every "
        "output (fetches = [], graphs of their own: the first call after the cold build, then the timed ones). The "
        f"timed evaluations of a process: {eval_calls - 1} or more, until they add up to {eval_seconds:g} s (a few "
        "milliseconds each: hundreds), the median over the processes of the row.\n\n" + table(rows) + "\n")


def write_index(index: Path, directory: Path) -> None:
    """``index``: a line per results page in ``directory`` (one per CPU kind), with its CPU and date."""
    lines = ["# Real-size benchmark results, per CPU kind", "",
             "`make bench-real` writes the results of the machine it runs on to `docs/benchmarks_real/<kind>.md` "
             "(its CPU's vendor and microarchitecture) and lists them here: ratios against PyTorch differ from one "
             "CPU kind to another (ONNX Runtime's MLAS and PyTorch's oneDNN pick kernels by instruction-set "
             "extension).", ""]
    for path in sorted(directory.glob("*.md")):
        text = path.read_text()
        heading = text.splitlines()[0].removeprefix("# Real-size benchmark: ") if text else path.stem
        found = re.search(r" on (.*?); torch ([^,]+), onnxruntime ([^;]+); (\d{4}-\d{2}-\d{2})\.", text)
        where = f": {found.group(1)}; torch {found.group(2)}, onnxruntime {found.group(3)}, {found.group(4)}" \
            if found else ""
        lines.append(f"- [{heading}](benchmarks_real/{path.name}){where}")
    index.write_text("\n".join(lines) + "\n")


__all__ = ["LOSS_STEPS", "page", "table", "write_index"]
