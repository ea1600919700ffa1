"""Benchmark ort_trainer against PyTorch eager and torch.compile; write docs/benchmarks.md and a chart.

Run: ``make bench`` (or ``python benchmarks/run.py [--legacy-python .venv-legacy/bin/python]``).
ort_trainer is measured on each runtime: today's ``onnxruntime`` (this interpreter: PyTorch's
autograd as the gradient source) and, given ``--legacy-python``, the 1.19.2 training build in that
environment (ONNX Runtime's gradient builder). For each model of ``benchmarks/models.py``:

1. timing: each implementation in its own process, alternating rounds. A round starts one fresh
   worker per implementation, in turn (the order reversed every other round): ort_trainer on
   today's runtime, ort_trainer on the legacy runtime, eager PyTorch, torch.compile (same initial
   weights, AdamW, clipping at 1.0). A worker warms its implementation up (ort_trainer's graph
   comes from the cache the graph-build workers filled, one cache per runtime), then times
   training steps, then evaluation steps (``eval_step`` vs ``torch.no_grad()`` eager): at least
   ``--steps`` of each (a quarter of that for evaluation), and more until ``--min-seconds`` have
   passed, so a 1 ms step is timed thousands of times. The table reports, per implementation, the
   median over every timed step of every round. Eager and torch.compile run in this interpreter
   only (both environments hold the same torch), so one eager and one torch.compile measurement
   is the baseline of both runtimes: ONNX Runtime's intra-op threads, which spin after each run,
   never share a process with PyTorch;
2. peak RSS: one fresh process per implementation (per runtime) trains a few steps and reports
   ``ru_maxrss``;
3. graph build: ort_trainer's first step in a process with an empty graph cache, then in a
   second process that finds the graph in the cache;
4. ablation: ort_trainer with all graph optimisations against the same with one turned off,
   alternating in one process (both sides are ONNX Runtime, so its spinning threads tax both alike).

The training loops read back only the loss (``TrainStepInfo.fetches = ["loss"]`` for
ort_trainer), as a training script does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from run_report import _eval_steps, _median_ms, _timing_key, write_report  # noqa: E402

PASSES = ("shape_specialization", "sparse_labels", "cross_entropy", "embedding_gradient", "fast_gelu_gradient",
          "integer_powers", "gelu", "host_dropout_masks", "dropout_gradient", "sequences", "output_reshape", "safe_softmax",
          "column_sums", "unfused_skip_layer_norm")
# the graph passes, and the fused in-place optimizer update (off: graph.optimizer="graph")
ABLATIONS = (*PASSES, "fused_optimizer")


# ---- the implementations -------------------------------------------------------------------------
def _ort(workload, model, passes_off=()):
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import AdamConfig

    options = {"graph_optimizations": {name: False for name in passes_off if name in PASSES}}
    if "fused_optimizer" in passes_off:  # the ONNX optimizer graph instead of the fused in-place update
        options["graph"] = {"optimizer": "graph"}
    trainer = ORTTrainer(model, workload.desc, AdamConfig(lr=1e-4, lambda_coef=0.01), loss_fn=workload.loss_fn,
                         options=options)
    trainer._train_step_info.fetches = list(workload.fetches)
    return (lambda: trainer.train_step(*workload.batch)), (lambda: trainer.eval_step(*workload.batch))


def _torch(workload, model, compiled: bool):
    import torch

    runner = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def train():
        runner.train()
        optimizer.zero_grad(set_to_none=True)
        loss = workload.torch_loss(runner)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    def evaluate():
        runner.eval()
        with torch.no_grad():
            return workload.torch_loss(runner)

    return train, evaluate


def _make(impl: str, workload, model, passes_off=()):
    if impl == "ort":
        return _ort(workload, model, passes_off)
    if impl == "ort_without":
        return _ort(workload, model, passes_off)
    return _torch(workload, model, compiled=impl == "compile")


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# ---- workers (one process each) ----------------------------------------------------------------
def _runtime() -> dict:
    """The ONNX Runtime distribution and gradient source of this process."""
    from ort_trainer._runtime import resolve_gradient_source, runtime_description

    return {"runtime": runtime_description(), "gradient_source": resolve_gradient_source("auto")}


def worker_timing(args) -> dict:
    """Per-step times after warm-up of the implementations in ``--impls``, alternating in this process.

    The timing rounds start one worker per implementation; the ablation starts one for ``ort`` and
    ``ort_without:<pass>`` together.
    """
    import torch

    from models import workload as make_workload

    torch.manual_seed(0)
    work = make_workload(args.model)
    base = work.make_model()
    import copy

    impls, result = {}, {"train": {}, "eval": {}, "errors": {}, **_runtime()}
    for impl in args.impls.split(","):
        model = copy.deepcopy(base)
        try:
            started = time.perf_counter()
            train, evaluate = _make(impl.split(":")[0], work, model,
                                    passes_off=tuple(p for p in impl.split(":")[1:] if p))
            for _ in range(args.warmup):
                train()
                if not args.no_eval:
                    evaluate()
            result.setdefault("warmup_s", {})[impl] = time.perf_counter() - started
            impls[impl] = (train, evaluate)
        except Exception as exc:  # torch.compile may fail on a machine: report it honestly
            result["errors"][impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    for _ in range(args.rounds):
        for impl, (train, evaluate) in impls.items():
            result["train"].setdefault(impl, []).extend(_timed_steps(train, args.steps, args.min_seconds))
            if not args.no_eval:
                result["eval"].setdefault(impl, []).extend(
                    _timed_steps(evaluate, _eval_steps(args.steps), args.min_seconds))
    return result


def _timed_steps(fn, steps: int, min_seconds: float) -> list[float]:
    """Times of ``fn``'s calls: at least ``steps`` of them, and more until ``min_seconds`` have passed.

    A 1 ms MLP step timed 10 times gives a median of 10 noisy samples; timed for 2 s it gives
    ~2000, while a 250 ms transformer step is timed ``steps`` times as before.
    """
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < steps or time.perf_counter() - started < min_seconds:
        times.append(_timed(fn))
    return times


def worker_rss(args) -> dict:
    """Peak RSS of one implementation training a few steps."""
    import torch

    from models import workload as make_workload

    torch.manual_seed(0)
    work = make_workload(args.model)
    train, _ = _make(args.impls, work, work.make_model())
    for _ in range(args.steps):
        train()
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def worker_build(args) -> dict:
    """Time to the end of ort_trainer's first step (graph build included), and of a second step."""
    import torch

    from models import workload as make_workload

    torch.manual_seed(0)
    work = make_workload(args.model)
    model = work.make_model()
    started = time.perf_counter()
    train, _ = _ort(work, model)
    train()
    first = time.perf_counter() - started
    step = _timed(train)
    return {"first_step_s": first, "step_s": step}


# ---- orchestration ------------------------------------------------------------------------------
def _spawn(kind: str, model: str, impls: str, steps: int, warmup: int = 3, rounds: int = 1,
           env: dict | None = None, python: str = sys.executable, min_seconds: float = 0.0,
           evaluation: bool = True) -> dict:
    command = [python, __file__, "--worker", kind, "--model", model, "--impls", impls,
               "--steps", str(steps), "--warmup", str(warmup), "--rounds", str(rounds),
               "--min-seconds", str(min_seconds), *([] if evaluation else ["--no-eval"])]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        return {"error": (result.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1][len("RESULT "):])


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall clock, CPU time of the whole machine, CPU time of this process's finished children), or None."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: everything but idle and iowait is busy
    ticks = [int(value) for value in fields[:8]]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.perf_counter(), (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"),
            children.ru_utime + children.ru_stime)


def _cores_used_by_others(before, after) -> float | None:
    """The cores that processes other than the worker kept busy while it ran (on average)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    worker = after[2] - before[2]
    return round(max(0.0, (after[1] - before[1] - worker) / (after[0] - before[0])), 2)


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}, torch {torch.__version__}"


def main() -> None:
    """Parse arguments; run a worker, or orchestrate every measurement and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["timing", "rss", "build"])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--models", default="mlp,bert,gpt2")
    parser.add_argument("--impls", default="ort,eager,compile")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation per round (at least)")
    parser.add_argument("--min-seconds", type=float, default=2.0,
                        help="time steps (and evaluation steps) for at least this long per implementation per round; "
                             "the ablation uses a quarter of it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-ablation", action="store_true")
    parser.add_argument("--no-eval", action="store_true",
                        help="a timing worker times training steps only (the ablation reports nothing else)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--legacy-python", default="",
                        help="python of an environment with the 1.19.2 training build (e.g. .venv-legacy/bin/python); "
                             "its runtime is measured beside this one")
    args = parser.parse_args()
    if args.worker:
        result = {"timing": worker_timing, "rss": worker_rss, "build": worker_build}[args.worker](args)
        print("RESULT " + json.dumps(result), flush=True)
        return

    runtimes = {"current": sys.executable, **({"legacy": args.legacy_python} if args.legacy_python else {})}
    impls = args.impls.split(",")
    report = {"machine": _machine(), "load_before": os.getloadavg(), "timing": {},
              "timing_settings": {"steps": args.steps, "min_seconds": args.min_seconds},
              "runtimes": {runtime: {} for runtime in runtimes}}
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as cache_root:
            envs = {runtime: {"ORT_TRAINER_CACHE_DIR": str(Path(cache_root) / runtime)} for runtime in runtimes}
            entries = {runtime: report["runtimes"][runtime].setdefault(model, {}) for runtime in runtimes}
            for runtime, python in runtimes.items():
                print(f"== {model}: graph build on {runtime}", flush=True)
                entries[runtime]["build_cold"] = _spawn("build", model, "ort", 1, env=envs[runtime], python=python)
                entries[runtime]["build_cached"] = _spawn("build", model, "ort", 1, env=envs[runtime], python=python)
            timing = report["timing"][model] = _timing_rounds(model, impls, runtimes, envs, args)
            print(json.dumps({key: round(_median_ms(value["train"]), 1) for key, value in timing.items()
                              if value["train"]}), flush=True)
            for runtime, python in runtimes.items():
                print(f"== {model}: peak RSS and ablation on {runtime}", flush=True)
                # torch.compile beside today's runtime only: its memory does not depend on ONNX Runtime
                rss_impls = [impl for impl in impls if runtime == "current" or impl != "compile"]
                entries[runtime]["rss"] = {impl: _spawn("rss", model, impl, 8, env=envs[runtime], python=python)
                                           for impl in rss_impls}
                if not args.no_ablation:
                    entries[runtime]["ablation"] = {
                        name: _spawn("timing", model, f"ort,ort_without:{name}", max(5, args.steps // 2), 3,
                                     args.rounds, env=envs[runtime], python=python,
                                     min_seconds=args.min_seconds / 4, evaluation=False)
                        for name in ABLATIONS}
    report["load_after"] = os.getloadavg()
    write_report(report, args.out)


def _timing_rounds(model: str, impls: list[str], runtimes: dict[str, str], envs: dict[str, dict], args) -> dict:
    """Time each implementation in a fresh process per round, alternating the order between rounds.

    Args:
        model: the benchmark model's name.
        impls: ``ort`` (measured on every runtime), ``eager`` and/or ``compile`` (this interpreter).
        runtimes: runtime name to its python interpreter.
        envs: runtime name to the environment of its workers (its graph cache).
        args: the parsed command line (``steps``, ``min_seconds``, ``warmup``, ``rounds``).

    Returns:
        ``{key: {"train": [s, ...], "eval": [s, ...], "round_medians_ms": [...], "round_other_cores":
        [...], "errors": [...], "runtime": ..., "gradient_source": ...}}`` with keys ``ort@<runtime>``,
        ``eager``, ``compile``; the step lists hold every timed step of every round that succeeded.
    """
    workers = [(_timing_key(impl, runtime), impl, python, envs[runtime])
               for impl in impls
               for runtime, python in (runtimes.items() if impl == "ort" else [("current", runtimes["current"])])]
    timing = {key: {"train": [], "eval": [], "round_medians_ms": [], "round_other_cores": [], "errors": []}
              for key, *_ in workers}
    for round_index in range(args.rounds):
        for key, impl, python, env in workers if round_index % 2 == 0 else reversed(workers):
            print(f"== {model}: round {round_index + 1}/{args.rounds}, {key}", flush=True)
            before = _cpu_seconds()
            result = _spawn("timing", model, impl, args.steps, args.warmup, 1, env=env, python=python,
                            min_seconds=args.min_seconds)
            others = _cores_used_by_others(before, _cpu_seconds())
            record = timing[key]
            train = result.get("train", {}).get(impl)
            if not train:
                record["errors"].append(result.get("error") or result.get("errors", {}).get(impl, "no steps timed"))
                continue
            record["train"] += train
            record["eval"] += result["eval"][impl]
            record["round_medians_ms"].append(round(_median_ms(train), 2))
            record["round_other_cores"].append(others)
            for name in ("runtime", "gradient_source"):
                record.setdefault(name, result.get(name))
    return timing


if __name__ == "__main__":
    main()
