"""Benchmark ort_trainer against PyTorch eager and torch.compile; write docs/benchmarks.md and a chart.

Run: ``make bench`` (or ``python benchmarks/run.py [--legacy-python .venv-legacy/bin/python]``).
Every measurement below runs once per runtime: today's ``onnxruntime`` (this interpreter: PyTorch's
autograd as the gradient source) and, given ``--legacy-python``, the 1.19.2 training build in that
environment (ONNX Runtime's gradient builder); each runtime's ratios are taken against PyTorch
measured in the same process. For each model of ``benchmarks/models.py``:

1. timing: one process holds ort_trainer, eager PyTorch and torch.compile versions of the model
   (same initial weights, AdamW, clipping at 1.0) and runs them in alternating rounds; the table
   reports medians of the per-step times after warm-up, and the same for evaluation
   (``eval_step`` vs ``torch.no_grad()`` eager);
2. peak RSS: one fresh process per implementation trains a few steps and reports ``ru_maxrss``;
3. graph build: ort_trainer's first step in a process with an empty graph cache, then in a
   second process that finds the graph in the cache;
4. ablation: ort_trainer with all graph optimisations against the same with one turned off,
   alternating in one process.

The training loops read back only the loss (``TrainStepInfo.fetches = ["loss"]`` for
ort_trainer), as a training script does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

PASSES = ("shape_specialization", "sparse_labels", "cross_entropy", "embedding_gradient", "fast_gelu_gradient",
          "integer_powers")


# ---- the implementations -------------------------------------------------------------------------
def _ort(workload, model, passes_off=()):
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import AdamConfig

    options = {"graph_optimizations": {name: False for name in passes_off}}
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
    """Alternate the implementations in one process; per-step times after warm-up."""
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
                evaluate()
            result.setdefault("warmup_s", {})[impl] = time.perf_counter() - started
            impls[impl] = (train, evaluate)
        except Exception as exc:  # torch.compile may fail on a machine: report it honestly
            result["errors"][impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    for _ in range(args.rounds):
        for impl, (train, evaluate) in impls.items():
            result["train"].setdefault(impl, []).extend(_timed(train) for _ in range(args.steps))
            result["eval"].setdefault(impl, []).extend(_timed(evaluate) for _ in range(max(3, args.steps // 4)))
    return result


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
           env: dict | None = None, python: str = sys.executable) -> dict:
    command = [python, __file__, "--worker", kind, "--model", model, "--impls", impls,
               "--steps", str(steps), "--warmup", str(warmup), "--rounds", str(rounds)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        return {"error": (result.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1][len("RESULT "):])


def _median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


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
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-ablation", action="store_true")
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
    report = {"machine": _machine(), "runtimes": {}}
    for runtime, python in runtimes.items():
        # torch.compile once, beside today's runtime: its time does not depend on ONNX Runtime
        impls = args.impls if runtime == "current" else ",".join(i for i in args.impls.split(",") if i != "compile")
        models = report["runtimes"][runtime] = {}
        for model in args.models.split(","):
            print(f"== {runtime}: {model}", flush=True)
            entry = models[model] = {}
            with tempfile.TemporaryDirectory() as cache:
                env = {"ORT_TRAINER_CACHE_DIR": cache}
                entry["build_cold"] = _spawn("build", model, "ort", 1, env=env, python=python)
                entry["build_cached"] = _spawn("build", model, "ort", 1, env=env, python=python)
                entry["timing"] = _spawn("timing", model, impls, args.steps, args.warmup, args.rounds, env=env,
                                         python=python)
                entry["rss"] = {impl: _spawn("rss", model, impl, 8, env=env, python=python)
                                for impl in impls.split(",")}
                if not args.no_ablation:
                    entry["ablation"] = {}
                    for name in PASSES:
                        entry["ablation"][name] = _spawn("timing", model, f"ort,ort_without:{name}",
                                                         max(5, args.steps // 2), 3, args.rounds, env=env,
                                                         python=python)
            print(json.dumps(_summary(entry)), flush=True)
    write_report(report, args.out)


def _summary(entry: dict) -> dict:
    timing = entry["timing"]
    return {impl: round(_median_ms(times), 1) for impl, times in timing.get("train", {}).items()}


RUNTIME_NAMES = {"current": "today's onnxruntime", "legacy": "1.19.2 training build"}


def _medians(result: dict, kind: str) -> dict[str, float]:
    return {impl: _median_ms(times) for impl, times in result.get(kind, {}).items() if times}


def _build_seconds(result: dict) -> float:
    return result.get("first_step_s", float("nan")) - result.get("step_s", 0)


def _ratio(numerator: float | None, denominator: float | None) -> float:
    return numerator / denominator if numerator and denominator else float("nan")


def write_report(report: dict, out: Path) -> None:
    """The markdown tables (a row per model per runtime) and the PNG chart."""
    runtimes = report["runtimes"]
    lines = ["# Benchmarks", "", f"Machine: {report['machine']}.", ""]
    for runtime, models in runtimes.items():
        first = next(iter(models.values()))["timing"]
        lines.append(f"- **{runtime}** ({RUNTIME_NAMES.get(runtime, runtime)}): {first.get('runtime', '?')}, "
                     f"gradient source `{first.get('gradient_source', '?')}`.")
    lines += ["",
              "Written by `make bench` (`benchmarks/run.py`); medians of per-step times after warm-up, ort_trainer and "
              "PyTorch alternating in one process per runtime. Speed-up = PyTorch time / ort_trainer time "
              "(> 1: ort_trainer is faster), each runtime against the PyTorch of its own process. RSS = peak "
              "resident memory of a process training that model.", "",
              "## Training step", "",
              "| model | runtime | ort_trainer ms | eager ms | torch.compile ms | vs eager | vs compile | "
              "RSS ort / eager MB | RSS ratio |",
              "|---|---|---|---|---|---|---|---|---|"]
    chart: dict = {}
    model_names = list(dict.fromkeys(m for models in runtimes.values() for m in models))
    compiled = {m: _medians(runtimes.get("current", {}).get(m, {}).get("timing", {}), "train").get("compile")
                for m in model_names}
    for model in model_names:
        for runtime, models in runtimes.items():
            entry = models.get(model)
            if entry is None:
                continue
            med = _medians(entry["timing"], "train")
            rss = {impl: value.get("peak_rss_mb") or 0 for impl, value in entry["rss"].items()}
            errors = entry["timing"].get("errors", {}) or {"ort": entry["timing"].get("error")}
            ort, eager, comp = med.get("ort"), med.get("eager"), compiled.get(model)
            if ort is None or eager is None:
                lines.append(f"| {model} | {runtime} | failed: {errors} | | | | | | |")
                continue
            # torch.compile ran beside today's runtime: its ratio to another runtime's step compares processes
            comp_cell = f"{comp:.1f}" if comp else f"failed: {errors.get('compile', 'not run')}"
            lines.append(
                f"| {model} | {runtime} | {ort:.1f} | {eager:.1f} | {comp_cell if runtime == 'current' else ''} | "
                f"{eager / ort:.2f}× | {_ratio(comp, ort) if runtime == 'current' else float('nan'):.2f}× | "
                f"{rss.get('ort', 0):.0f} / {rss.get('eager', 0):.0f} | {_ratio(rss.get('ort'), rss.get('eager')):.2f} |")
            chart.setdefault(model, {"eager": 1.0})[f"ort_trainer ({runtime})"] = ort / eager
            if comp and runtime == "current":
                chart[model]["torch.compile"] = comp / eager
    lines += ["", "## Evaluation step", "", "| model | runtime | eval_step ms | eager no_grad ms | speed-up |",
              "|---|---|---|---|---|"]
    for model in model_names:
        for runtime, models in runtimes.items():
            ev = _medians(models.get(model, {}).get("timing", {}), "eval")
            if "ort" in ev and "eager" in ev:
                lines.append(f"| {model} | {runtime} | {ev['ort']:.1f} | {ev['eager']:.1f} | "
                             f"{ev['eager'] / ev['ort']:.2f}× |")
    lines += ["", "## Graph build", "",
              "| model | runtime | first step, empty cache (s) | first step, graph from the cache (s) |",
              "|---|---|---|---|"]
    for model in model_names:
        for runtime, models in runtimes.items():
            if model in models:
                entry = models[model]
                lines.append(f"| {model} | {runtime} | {_build_seconds(entry['build_cold']):.2f} | "
                             f"{_build_seconds(entry['build_cached']):.2f} |")
    lines += ["", "## Targets", "", "| target | measured | met? |", "|---|---|---|"]
    current, legacy = runtimes.get("current", {}), runtimes.get("legacy", {})
    for model in model_names:
        entry = current.get(model)
        if entry is None:
            continue
        train, ev = _medians(entry["timing"], "train"), _medians(entry["timing"], "eval")
        rss = {impl: value.get("peak_rss_mb") or 0 for impl, value in entry["rss"].items()}
        speed = _ratio(train.get("eager"), train.get("ort"))
        checks = []
        if model in legacy:
            old = _medians(legacy[model]["timing"], "train")
            old_speed = _ratio(old.get("eager"), old.get("ort"))
            checks.append((f"{model}: step vs eager on today's runtime ≥ on 1.19.2 ({old_speed:.2f}×)", speed,
                           old_speed, True))
        checks += [(f"{model}: step ≥ 1.3× eager", speed, 1.3, True),
                   (f"{model}: eval_step ≥ 1.3× eager no_grad", _ratio(ev.get("eager"), ev.get("ort")), 1.3, True),
                   (f"{model}: peak RSS ≤ 1.0× eager", _ratio(rss.get("ort"), rss.get("eager")), 1.0, False)]
        if compiled.get(model):
            checks.insert(len(checks) - 3, (f"{model}: step ≥ 1.0× torch.compile", _ratio(compiled[model], train.get("ort")),
                                            1.0, True))
        for label, value, bound, higher in checks:
            met = value >= bound if higher else value <= bound
            lines.append(f"| {label} | {value:.2f}× | {'yes' if met else f'no, by {abs(value - bound) / bound:.0%}'} |")
        if model == "bert":
            cold, warm = _build_seconds(entry["build_cold"]), _build_seconds(entry["build_cached"])
            lines.append(f"| bert: first graph build < 10 s | {cold:.2f} s | {'yes' if cold < 10 else 'no'} |")
            lines.append(f"| bert: graph from the cache < 1 s | {warm:.2f} s | {'yes' if warm < 1 else 'no'} |")
    lines += ["", "Why the missed targets are missed, with the profiles: `docs/performance.md`."]
    if any("ablation" in entry for models in runtimes.values() for entry in models.values()):
        lines += ["", "## Graph optimisations", "",
                  "Each row: the step time with every optimisation on, and with that one turned off "
                  "(`graph_optimizations.<name>: false`), alternating in one process.", "",
                  "| model | runtime | optimisation | all on ms | without it ms | its effect |",
                  "|---|---|---|---|---|---|"]
        for model in model_names:
            for runtime, models in runtimes.items():
                for name, result in models.get(model, {}).get("ablation", {}).items():
                    train = _medians(result, "train")
                    if "ort" not in train or f"ort_without:{name}" not in train:
                        lines.append(f"| {model} | {runtime} | {name} | | | failed: "
                                     f"{result.get('error', result.get('errors'))} |")
                        continue
                    on, off = train["ort"], train[f"ort_without:{name}"]
                    lines.append(f"| {model} | {runtime} | {name} | {on:.1f} | {off:.1f} | {off / on:.2f}× |")
    out.write_text("\n".join(lines) + "\n")
    _chart(chart, out.with_suffix(".png"))
    print("\n".join(lines))


def _chart(chart: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(chart)
    impls = list(dict.fromkeys(impl for values in chart.values() for impl in values))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        values = [chart[m].get(impl, 0) for m in models]
        ax.bar([x + (i - (len(impls) - 1) / 2) * width for x in range(len(models))], values, width, label=impl)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("training step time / eager")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title("Training step time relative to PyTorch eager (lower is faster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
