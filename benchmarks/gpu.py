"""GPU benchmark at the sizes users train: ort_trainer against PyTorch eager and ``torch.compile``.

Run by ``make gpu-check`` on a machine with a GPU, ``onnxruntime-gpu`` and a CUDA build of torch; it
writes ``docs/benchmarks_gpu.md``. BERT-base MLM at batch 32 × 128 and GPT-2 small at 8 × 512
(random-init Hugging Face configurations, dropout 0), in fp32, fp16 and bf16; each implementation
(``benchmarks/gpu_worker.py``: ort_trainer, eager, ``torch.compile``) in a process of its own.

1. **Warm-up** (``--warm-parallel N``): before round 1 of each (model, precision), each of its ort_trainer
   and ``torch.compile`` configurations runs two steps, N processes at a time, so that the timed processes
   find ort_trainer's graph cache and inductor's cache filled (their builds are not what this benchmark
   times; their times are kept). Under ``--deadline`` a run cut short has whole (model, precision) pairs.
2. **Rounds**: every (model, precision, implementation) once per round, one process at a time, the
   order of the implementations reversed every other round. Each takes ``--steps`` steps; the first
   ``--warmup`` are not timed, and the losses of all of them are compared between implementations.
   Round 1's processes then profile ``--profile-steps`` more steps (``torch.profiler``: on a GPU every
   kernel of the process, ONNX Runtime's included), summed by kind of kernel: where a step goes.
3. **Largest batch** (``--probe MODEL``): at the model's sequence length, the batch doubles from
   ``--probe-start`` until a step runs out of GPU memory, then 1.5 times the last batch that trained is
   tried (``--probe-impls``: ort_trainer and eager; fp16 unless ``--probe-precisions`` says otherwise).
   With ``--batch-of-probe IMPL`` the probe runs first, and the warm-up and the rounds train at the
   largest batch IMPL fitted (the row that fills the GPU: ``--models gpt2-1024 --precisions bf16
   --probe gpt2-1024 --probe-precisions bf16 --probe-impls eager --batch-of-probe eager``); ``--batch N``
   sets the batch of the rounds directly.

``--impls ort,ort+PASS`` A/Bs a lever in one run: ``ort+PASS[+PASS]`` is ort_trainer with those
``graph_optimizations`` on, a row of its own in every round and profile, its ratio ort_trainer's time over
its own (``benchmarks/gpu_levers.sh``).

Every result is appended as one JSON line to ``--results`` when it arrives, so a run that is cut
short keeps what it measured; ``--report-only`` writes the markdown from such a file. A measuring run
starts a new file unless ``--append`` is given: then what the file holds stays, and the page is written
from all of it (several invocations of one GPU lease, e.g. fp16 against ``torch.compile`` first, then
bf16 and fp32 against eager, make one page). ``--deadline``
(seconds) starts no process after that time. ``--device cpu`` runs the whole harness at toy size
(``make test`` does).

Model FLOPs utilisation = 6 × parameters × tokens per step / step time, against the GPU's dense peak
for the precision (fp32 without TF32: torch's default, which ort_trainer follows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("gpu_worker.py")
sys.path.insert(0, str(Path(__file__).parent))

from gpu_worker import IMPLS, PRECISIONS  # noqa: E402

# Dense peak TFLOP/s (no sparsity) by device name: (fp32 without TF32, fp16/bf16 tensor cores).
PEAKS = {"H200": (66.9, 989.4), "H100 80GB HBM3": (66.9, 989.4), "H100 SXM": (66.9, 989.4), "H100 PCIe": (51.2, 756.5),
         "H100 NVL": (60.0, 835.5), "A100": (19.5, 312.0)}
# How far ort_trainer's loss may be from the reference's over the compared steps (relative).
# fp32: the 1e-4 (float32 sums in another order: ~1e-6 per step). fp16/bf16: the two runs round
# different tensors to half precision (torch's autocast chooses per op; ort_trainer's graph per node), one
# rounding is 2^-11 (fp16) or 2^-8 (bf16) relative, and 20 Adam steps compound it: 5e-3 and 2e-2.
LOSS_TOLERANCE = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 2e-2}
GOALS = {"eager": {"fp32": 1.0, "fp16": 1.2, "bf16": 1.2}, "compile": {"fp32": 1.0, "fp16": 1.0, "bf16": 1.0}}
REFERENCE = {"fp32": "PyTorch eager fp32", "fp16": "`torch.autocast` fp16 + `GradScaler`", "bf16": "`torch.autocast` bf16"}


def variant(impl: str) -> tuple[str, dict]:
    """``(implementation, graph_optimizations it turns on)`` of an ``--impls`` entry: ``ort+a+b`` is
    ort_trainer with the passes ``a`` and ``b`` on (over ``--ort-optimizations``), for an A/B of levers in
    one run; a plain name turns nothing on. A lever ``device.X`` is the device option ``X``
    (``ort+device.cuda_graph``)."""
    base, *levers = impl.split("+")
    return base, {lever: True for lever in levers}


def _spawn(args, model: str, impl: str, precision: str, steps: int, batch: int | None = None, profile: int = 0) -> dict:
    base, levers = variant(impl)
    optimizations = json.dumps({**json.loads(args.ort_optimizations), **levers})
    command = [sys.executable, str(WORKER), "--model", model, "--impl", base, "--precision", precision,
               "--device", args.device, "--steps", str(steps), "--compile-backend", args.compile_backend,
               "--profile-steps", str(profile), "--ort-optimizations", optimizations]
    if batch:
        command += ["--batch", str(batch)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy(), timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "impl": impl, "precision": precision, "batch": batch,
                "error": f"timed out after {args.timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        oom = "out of memory" in tail.lower() or "failed to allocate" in tail.lower()
        return {"model": model, "impl": impl, "precision": precision, "batch": batch,
                "error": f"exit {done.returncode}: {tail[-600:]}", "out_of_memory": oom}
    return {**json.loads(lines[-1]), "impl": impl}


class Run:
    """The orchestrator: spawns workers, appends each result to the results file."""

    def __init__(self, args):
        self.args = args
        self.batch = args.batch  # None: each model's own (gpu_worker.MODELS)
        self.probed: dict[str, list[int]] = {}  # implementation -> the batches that trained in the probe
        self.started = time.monotonic()
        args.results.parent.mkdir(parents=True, exist_ok=True)

    def late(self) -> bool:
        """Whether ``--deadline`` has passed (no process starts after it)."""
        return self.args.deadline is not None and time.monotonic() - self.started > self.args.deadline

    def record(self, phase: str, result: dict, **extra) -> dict:
        """Append ``result`` (tagged with its phase) to the results file and print a line of it."""
        result = {"phase": phase, **extra, **result}
        with open(self.args.results, "a", encoding="utf-8") as out:
            out.write(json.dumps(result) + "\n")
        status = result.get("error") or f"median {1000 * statistics.median(result['step_s'][1:] or result['step_s']):.1f} ms"
        if result.get("placed_elsewhere"):  # ort_trainer's nodes that ONNX Runtime ran off the GPU
            status += f" (nodes off the device: {result['placed_elsewhere']})"
        print(f"[{time.monotonic() - self.started:6.0f} s] {phase} {result.get('model')} {result.get('precision')} "
              f"{result.get('impl')} {extra or ''}: {status[:300]}", flush=True)
        return result

    def configs(self):
        """Every (model, precision) pair asked for."""
        return [(m, p) for m in self.args.models.split(",") for p in self.args.precisions.split(",")]

    def warm(self, model: str, precision: str) -> None:
        """Two steps of each ``--warm-impls`` configuration of ``model`` in ``precision``, ``--warm-parallel``
        processes at a time; none starts after ``--deadline``."""
        warm = self.args.warm_impls.split(",")
        jobs = [impl for impl in self.args.impls.split(",") if variant(impl)[0] in warm]

        def spawn(impl: str) -> dict | None:
            return None if self.late() else _spawn(self.args, model, impl, precision, steps=2, batch=self.batch)

        with ThreadPoolExecutor(max(1, self.args.warm_parallel)) as pool:
            for result in pool.map(spawn, jobs):
                if result is not None:
                    self.record("warm", result)

    def round(self, number: int, index: int, model: str, precision: str) -> None:
        """Round ``number`` of one (model, precision), the ``index``-th configuration: its implementations one
        process at a time, their order reversed every other round and configuration."""
        impls = self.args.impls.split(",")
        for impl in impls if (number + index) % 2 == 0 else reversed(impls):
            if self.late():
                return
            profile = self.args.profile_steps if number == 0 else 0  # after the timed steps: timings untouched
            self.record("time", _spawn(self.args, model, impl, precision, self.args.steps, batch=self.batch,
                                       profile=profile), round=number)

    def probe(self) -> None:
        """The largest batch: double it from ``--probe-start`` until a step fails (ort_trainer, eager), then
        try 1.5 times the last batch that trained (the issue's goal is 1.5 times eager's)."""
        for precision in self.args.probe_precisions.split(","):
            for impl in self.args.probe_impls.split(","):
                batch, fitted = self.args.probe_start, None
                while batch <= self.args.probe_max and not self.late():
                    result = self.record("probe", _spawn(self.args, self.args.probe, impl, precision, 2, batch=batch))
                    if "error" in result:
                        break
                    self.probed.setdefault(impl, []).append(batch)
                    fitted, batch = batch, batch * 2
                between = fitted * 3 // 2 if fitted else 0
                if fitted and fitted < between < batch <= self.args.probe_max and not self.late():
                    result = self.record("probe", _spawn(self.args, self.args.probe, impl, precision, 2, batch=between))
                    if "error" not in result:
                        self.probed[impl].append(between)

    def all(self) -> None:
        """Each (model, precision)'s warm-up and round 1, the probe, the other rounds; with ``--batch-of-probe``,
        the probe first.

        Raises:
            SystemExit: ``--batch-of-probe``'s implementation trained no batch of the probe.
        """
        first = bool(self.args.batch_of_probe)
        if first:
            self.probe()
            fitted = self.probed.get(self.args.batch_of_probe)
            if not fitted:
                raise SystemExit(f"--batch-of-probe {self.args.batch_of_probe}: it trained no batch from "
                                 f"{self.args.probe_start} up; lower --probe-start")
            self.batch = max(fitted)
            print(f"timing at batch {self.batch}: the largest {self.args.batch_of_probe} fitted", flush=True)
        for number in range(self.args.rounds):
            for index, (model, precision) in enumerate(self.configs()):
                if number == 0 and self.args.warm_parallel:  # each configuration's caches just before its round:
                    self.warm(model, precision)             # a run cut short has whole configurations measured
                self.round(number, index, model, precision)
            if number == 0 and self.args.probe and not first:
                self.probe()


def _median_ms(runs: list[dict], warmup: int) -> float | None:
    times = [s for r in runs for s in r["step_s"][warmup:]]
    return 1000 * statistics.median(times) if times else None


def _peak_tflops(device_name: str, precision: str) -> float | None:
    for mark, (fp32, half) in PEAKS.items():
        if mark in device_name:
            return fp32 if precision == "fp32" else half
    return None


def _loss_error(runs: list[dict], reference: list[dict]) -> float | None:
    if not runs or not reference:
        return None
    ref = reference[0]["losses"]
    return max(abs(a - b) / max(abs(b), 1e-12) for run in runs for a, b in zip(run["losses"], ref))


def summarize(results: list[dict], warmup: int) -> dict:
    """Per (model, precision): each implementation's figures and the ratios to ort_trainer."""
    table: dict = {}
    for result in results:
        if result.get("phase") != "time":
            continue
        cell = table.setdefault((result["model"], result["precision"]), {}).setdefault(result["impl"], {"runs": [], "errors": []})
        (cell["errors"] if "error" in result else cell["runs"]).append(result)
    for (model, precision), cells in table.items():
        for impl, cell in cells.items():
            runs = cell["runs"]
            cell["ms"] = _median_ms(runs, warmup)
            if not runs:
                continue
            first = runs[0]
            cell["samples_s"] = first["batch"] / (cell["ms"] / 1000) if cell["ms"] else None
            peak = _peak_tflops(first.get("device_name", ""), precision)
            flops = 6 * first["params"] * first["tokens"]
            cell["mfu"] = flops / (cell["ms"] / 1000) / (peak * 1e12) if peak and cell["ms"] else None
            cell["peak_mb"] = max(r["peak_mb"] for r in runs)
            cell["rounds"] = [round(ms, 1) for ms in (_median_ms([r], warmup) for r in runs) if ms is not None]
            cell["first_s"] = statistics.median(r["build_s"] for r in runs)
            allocated = [r["torch_allocated_peak_mb"] for r in runs if "torch_allocated_peak_mb" in r]
            cell["torch_mb"] = max(allocated) if allocated else None
        ort = cells.get("ort", {})
        for other in ("eager", "compile"):
            if ort.get("ms") and cells.get(other, {}).get("ms"):
                cells[other]["speedup"] = cells[other]["ms"] / ort["ms"]
            if ort.get("runs") and cells.get(other, {}).get("runs"):
                cells[other]["loss_error"] = _loss_error(ort["runs"], cells[other]["runs"])
        for name, cell in cells.items():  # a lever's variant: ort_trainer's time over the variant's (> 1: it wins)
            if name not in IMPLS and ort.get("ms") and cell.get("ms"):
                cell["speedup"] = ort["ms"] / cell["ms"]
                cell["loss_error"] = _loss_error(cell["runs"], ort["runs"])
                # and against PyTorch measured in the same run (gpu_levers.sh's REFERENCES): the goals' ratios
                cell["against"] = {other: cells[other]["ms"] / cell["ms"] for other in ("eager", "compile")
                                   if cells.get(other, {}).get("ms")}
    return table


def _fmt(value, pattern: str = "{:.1f}", missing: str = "—") -> str:
    return pattern.format(value) if value is not None else missing


def report(results: list[dict], args) -> tuple[str, list[str]]:
    """The markdown page and the goals missed."""
    table = summarize(results, args.warmup)
    devices = sorted({r["device_name"] for r in results if r.get("device_name")})
    rounds = {r["round"] for r in results if r.get("phase") == "time" and "round" in r}
    lines = ["# GPU benchmark (`make gpu-check`)", "",
             f"Device: {', '.join(devices) or 'unknown'}; {args.versions}. Each implementation in its own process, "
             f"{len(rounds)} round(s), the order reversed every other round; {args.steps} steps per process, the first "
             f"{args.warmup} not timed. Step time: median of the timed steps, in ms. Ratio: the other's time / "
             "ort_trainer's (> 1: ort_trainer is faster); on a lever's row (ort_trainer + a pass turned on), ort_trainer's "
             "time / the row's (> 1: the lever wins), and beside it PyTorch's time / the row's where the run measured "
             "PyTorch too (the goals' ratios for that setting). "
             "MFU: 6 × parameters × tokens / step time / dense peak "
             "(fp32 without TF32, the default of both; fp16/bf16 tensor cores). Peak memory: device memory in use by "
             "the process (CUDA context, caching allocator and ONNX Runtime's arena; on the CPU the peak resident set), MB; in brackets the peak of torch's caching allocator alone (for ort_trainer: its weights, gradients and optimizer state; the rest is ONNX Runtime's arena and the context). First step: from the model built to the first step done (graph build or compilation from the warm caches, first step). Loss error: the largest "
             f"relative difference of ort_trainer's losses over all {args.steps} steps from the other's "
             "(fp16/bf16: from autocast's).", "",
             "| model | batch × seq | precision | implementation | step ms | samples/s | MFU | peak MB (torch's allocator) "
             "| ratio | goal | loss error (tolerance) | first step s | per-round ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    missed = []
    for (model, precision), cells in table.items():
        size = next((f"{r['batch']} × {r['tokens'] // r['batch']}" for c in cells.values() for r in c["runs"]), "—")
        for impl in [*IMPLS, *sorted(set(cells) - set(IMPLS))]:
            cell = cells.get(impl)
            if cell is None:
                continue
            goal = GOALS.get(impl, {}).get(precision)
            verdict, loss = "", ""
            if impl not in IMPLS:  # a lever's variant: against ort_trainer without it
                verdict = "lever: ort_trainer's time / this" + "".join(
                    f"; {ratio:.2f}× {_pytorch(other, precision)} (goal {GOALS[other][precision]:.1f}×)"
                    for other, ratio in cell.get("against", {}).items())
                loss = _fmt(cell.get("loss_error"), "{:.1e}") + " (from ort_trainer's)"
            if goal is not None:
                met = cell.get("speedup") is not None and cell["speedup"] >= goal
                verdict = f"≥ {goal:.1f}×: {'met' if met else 'MISSED'}"
                if not met:
                    missed.append(f"{model} {precision} vs {impl}: " + _fmt(cell.get("speedup"), "{:.2f}×", "not measured"))
                error = cell.get("loss_error")
                tolerance = LOSS_TOLERANCE[precision] if impl == "eager" else None
                loss = _fmt(error, "{:.1e}") + (f" ({tolerance:.0e}: {'ok' if error is not None and error <= tolerance else 'OVER'})"
                                                if tolerance else "")
            name = {"ort": "**ort_trainer**", "eager": REFERENCE[precision].replace("PyTorch eager fp32", "PyTorch eager"),
                    "compile": "`torch.compile` of the same"}.get(impl) or "ort_trainer + " + ", ".join(
                        f"`{lever}`" for lever in variant(impl)[1])
            lines.append(f"| {model} | {size} | {precision} | {name} | {_fmt(cell.get('ms'))} | "
                         f"{_fmt(cell.get('samples_s'), '{:.0f}')} | {_fmt(cell.get('mfu'), '{:.1%}')} | "
                         f"{_fmt(cell.get('peak_mb'), '{:.0f}')}{_fmt(cell.get('torch_mb'), ' ({:.0f})', '')} | "
                         f"{_fmt(cell.get('speedup'), '{:.2f}×')} | {verdict} | {loss} | {_fmt(cell.get('first_s'))} | "
                         f"{cell.get('rounds', '')} |")
        ort_peak, eager_peak = cells.get("ort", {}).get("peak_mb"), cells.get("eager", {}).get("peak_mb")
        if ort_peak and eager_peak and ort_peak > eager_peak:
            missed.append(f"{model} {precision}: peak memory {ort_peak:.0f} MB > eager's {eager_peak:.0f} MB")
    growth = [f"{r['model']} {r['precision']} {r['impl']} {r['after_first_step_mb']:.0f} → {r['peak_mb']:.0f}"
              for r in results if r.get("phase") == "time" and r.get("round") == 0 and r.get("after_first_step_mb")]
    if growth:
        lines += ["", "Device memory in use after the first step → the process's peak (MB; a second copy of the "
                  "activations after the first step shows here): " + "; ".join(growth) + "."]
    lines += _probe_lines(results) + _profile_lines(results) + _failure_lines(results)
    lines += ["", "Goals (issue 26): fp16 and bf16 ≥ 1.2× autocast eager and ≥ 1.0× `torch.compile`; fp32 ≥ 1.0× both; "
              "peak memory ≤ eager's. Missed: " + ("; ".join(missed) if missed else "none") + ".", ""]
    return "\n".join(lines), missed


def _pytorch(impl: str, precision: str) -> str:
    """A PyTorch implementation's short name in ``precision``."""
    return "torch.compile" if impl == "compile" else "eager" if precision == "fp32" else "autocast"


def _probe_lines(results: list[dict]) -> list[str]:
    probes = [r for r in results if r.get("phase") == "probe"]
    if not probes:
        return []
    lines = ["", "## Largest batch that trains", "",
             "| model | precision | implementation | batches that trained | smallest that did not | largest | peak MB at largest |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["model"], r["precision"], r["impl"]) for r in probes})
    for model, precision, impl in keys:
        runs = [r for r in probes if (r["model"], r["precision"], r["impl"]) == (model, precision, impl)]
        good = [r for r in runs if "error" not in r]
        bad = [r for r in runs if "error" in r]
        bad = sorted(bad, key=lambda r: r.get("batch", 0))  # the doubling's failure, and 1.5 times the last fit's
        why = ("out of memory" if bad and bad[0].get("out_of_memory") else f"failed: {bad[0]['error'][:120]}") if bad else "—"
        first_bad = f"{bad[0].get('batch', '?')} ({why})" if bad else "none (probe cap)"
        largest = max(good, key=lambda r: r["batch"]) if good else None
        lines.append(f"| {model} | {precision} | {impl} | {[r['batch'] for r in good]} | {first_bad} | "
                     f"{largest['batch'] if largest else '—'} | {_fmt(largest['peak_mb'] if largest else None, '{:.0f}')} |")
    largest_of = {key: max((r["batch"] for r in probes if "error" not in r
                            and (r["model"], r["precision"], r["impl"]) == key), default=None) for key in keys}
    # ort_trainer's and each of its variants' (``ort+layer_recompute``...), over eager's
    ratios = [f"{model} {precision}{'' if impl == 'ort' else f' ({impl})'} "
              f"{largest_of[model, precision, impl] / largest_of[model, precision, 'eager']:.2f}×"
              for model, precision, impl in keys if variant(impl)[0] == "ort" and largest_of[model, precision, impl]
              and largest_of.get((model, precision, "eager"))]
    if ratios:
        lines += ["", "ort_trainer's largest batch over eager's (goal: ≥ 1.5× in fp16): " + ", ".join(ratios) + "."]
    return lines


def _profile_lines(results: list[dict]) -> list[str]:
    profiled = [r for r in results if r.get("phase") == "time" and r.get("profile")]
    failed = [r for r in results if r.get("phase") == "time" and r.get("profile_error")]
    if not profiled:
        return ["", "Profiles failed: " + "; ".join(f"{r['model']} {r['precision']} {r['impl']}: {r['profile_error']}"
                                                   for r in failed)] if failed else []
    what = profiled[0]["profile"]["what"]
    lines = ["", "## Where a step goes", "",
             f"Round 1's processes profile {what} over a few more steps after their timed ones (`torch.profiler`; on a GPU "
             "through CUPTI, which records every kernel of the process, ONNX Runtime's too), in ms per step, by kind "
             "(`gpu_worker.CATEGORIES`). Busy: the kernels' total; the rest of the step the GPU waited for the host.", "",
             "| model | precision | implementation | step ms | busy ms | by kind (ms) | longest kernels (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in profiled:
        prof = r["profile"]
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in prof["categories"].items() if v >= 0.05)
        top = "; ".join(f"`{name[:60]}` {ms:.2f}" for name, ms in prof["top"][:4])
        lines.append(f"| {r['model']} | {r['precision']} | {r['impl']} | {prof['step_ms']:.1f} | "
                     f"{_fmt(prof.get('busy_ms'))} | {kinds} | {top} |")
    return lines + [f"| {r['model']} | {r['precision']} | {r['impl']} | profile failed: {r['profile_error'][:200]} |||||"
                    for r in failed]


def _failure_lines(results: list[dict]) -> list[str]:
    failed = [r for r in results if "error" in r and r.get("phase") != "probe"]
    return (["", "## Failures", ""] + [f"- {r.get('phase')} {r['model']} {r['precision']} {r['impl']}: {r['error'][:400]}"
                                       for r in failed]) if failed else []


def preflight() -> list[str]:
    """What this environment lacks for the GPU check (empty when it has everything)."""
    problems = []
    try:
        import torch
        if not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} sees no GPU (a CUDA build of torch and a GPU are needed)")
    except ImportError as error:
        problems.append(f"torch does not import: {error}")
    try:
        import onnxruntime
        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            problems.append(f"onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider: "
                            "pip install \"ort_trainer[cuda]\" (onnxruntime-gpu) in place of onnxruntime")
    except ImportError as error:
        problems.append(f"onnxruntime does not import: {error}")
    try:
        import ort_trainer  # noqa: F401  (checks that exactly one ONNX Runtime is installed)
    except ImportError as error:
        problems.append(str(error))
    return problems


def _write(text: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_suffix(out.suffix + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(out)


def parse(argv=None):
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preflight", action="store_true", help="only check the environment (exit 2 if lacking)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="bert-base,gpt2")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--impls", default=",".join(IMPLS), help="implementations (ort, eager, compile); ort+PASS[+PASS] "
                        "is ort_trainer with those graph_optimizations on: levers A/B in one run (ort,ort+half_precision_loss)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per process, the losses of all compared")
    parser.add_argument("--warmup", type=int, default=5, help="of those, not timed")
    parser.add_argument("--warm-parallel", type=int, default=6, help="fill the caches first, N processes at a time (0: no)")
    parser.add_argument("--warm-impls", default="ort,compile", help="which implementations the warm-up runs")
    parser.add_argument("--probe", default="gpt2", help="model of the largest-batch probe ('' for none)")
    parser.add_argument("--probe-precisions", default="fp16", help="precisions of the probe (the goal: fp16)")
    parser.add_argument("--probe-impls", default="ort,eager", help="implementations the probe runs")
    parser.add_argument("--batch-of-probe", default="", help="probe first, then time at the largest batch this "
                        "implementation fitted (one model: the probe's)")
    parser.add_argument("--batch", type=int, default=None, help="the batch of the rounds (default: each model's)")
    parser.add_argument("--probe-start", type=int, default=32)
    parser.add_argument("--probe-max", type=int, default=1024)
    parser.add_argument("--profile-steps", type=int, default=3, help="round 1 profiles this many more steps (0: none)")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--ort-optimizations", default="{}",
                        help="ort_trainer's graph_optimizations, as JSON, for an A/B of one pass (a run of its own)")
    parser.add_argument("--deadline", type=float, default=None, help="start no process after this many seconds")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one process may take")
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "benchmarks_gpu.jsonl")
    parser.add_argument("--report-only", action="store_true", help="write the page from --results; measure nothing")
    parser.add_argument("--append", action="store_true",
                        help="keep the results already in --results (else a measuring run starts a new file)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks_gpu.md")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Measure (unless ``--report-only``), write the page; 1 when a goal is missed, 2 when the preflight fails."""
    args = parse(argv)
    if args.batch_of_probe and (args.models != args.probe or args.batch_of_probe not in args.probe_impls.split(",")):
        print(f"--batch-of-probe {args.batch_of_probe!r} needs --models to be the probe's model ({args.probe!r}) and "
              f"the implementation among --probe-impls ({args.probe_impls!r})", file=sys.stderr)
        return 2
    if args.preflight:
        problems = preflight()
        for problem in problems:
            print(f"gpu-check cannot run: {problem}", file=sys.stderr)
        return 2 if problems else 0
    if not args.report_only:
        if args.results.exists() and not args.append:
            args.results.unlink()
        Run(args).all()
    results = [json.loads(line) for line in args.results.read_text(encoding="utf-8").splitlines() if line.strip()]
    args.versions = ", ".join(sorted({r["versions"] for r in results if r.get("versions")})) or "versions unknown"
    text, missed = report(results, args)
    _write(text, args.out)
    print(text)
    if missed:
        print("goals missed: " + "; ".join(missed), file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
