"""Implementations timed against eager PyTorch, each in a process of its own, the order alternating from round to
round (``lstm.py``, ``cnn.py``): the runner and the markdown page of its results.

A worker process prints one JSON object as its last line: ``impl``, ``first_s`` (its first step, the build
included), ``step_ms`` (the mean of the timed steps), ``loss`` and ``peak_mb`` (the whole process's peak RSS). The
first round's ort_trainer processes build their graphs (cold), the later ones find them in the run's graph cache
(warm).
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
from typing import Any, Callable


def cpu_name() -> str:
    """This machine's CPU model, as ``/proc/cpuinfo`` names it."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def parser(description: str, steps: int) -> argparse.ArgumentParser:
    """The benchmarks' common arguments: ``--rounds``, ``--steps`` (default ``steps``), ``--tiny``, ``--out`` and the
    worker's own ``--worker IMPL``."""
    arguments = argparse.ArgumentParser(description=description)
    arguments.add_argument("--rounds", type=int, default=2)
    arguments.add_argument("--steps", type=int, default=steps)
    arguments.add_argument("--tiny", action="store_true", help="a toy size (the test's)")
    arguments.add_argument("--out", help="write the table there too")
    arguments.add_argument("--worker", help=argparse.SUPPRESS)
    return arguments


def timed(impl: str, model: Any, batches: list[tuple], steps: int, optimizer: Callable[[Any], Any],
          trainer: Callable[[], Any]) -> dict:
    """A worker's result: ``impl``'s first step (its build, ``trainer()`` or ``optimizer(parameters)`` included) and
    ``steps`` timed steps over ``batches`` in turn; "eager" steps ``model`` with the torch optimizer, anything else
    the ORTTrainer."""
    started = time.perf_counter()
    if impl == "eager":
        torch_optimizer = optimizer(model.parameters())

        def step(*batch):
            torch_optimizer.zero_grad(set_to_none=True)
            loss = model(*batch)
            loss.backward()
            torch_optimizer.step()
            return float(loss)
    else:
        ort_trainer = trainer()

        def step(*batch):
            return float(ort_trainer.train_step(*batch))
    step(*batches[0])
    first = time.perf_counter() - started
    started = time.perf_counter()
    losses = [step(*batches[i % len(batches)]) for i in range(steps)]
    return {"impl": impl, "first_s": first, "step_ms": (time.perf_counter() - started) / steps * 1000,
            "loss": losses[-1], "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_rounds(script: str, implementations: tuple[str, ...], rounds: int, arguments: list[str]) -> list[dict]:
    """``rounds`` rounds of one ``script --worker IMPL *arguments`` process per implementation, alternating the
    order, all with one fresh graph cache; each result printed as it comes. Returns them by implementation (each
    implementation's rounds in order)."""
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        for round_ in range(rounds):
            for impl in implementations if round_ % 2 == 0 else implementations[::-1]:
                done = subprocess.run([sys.executable, script, "--worker", impl, *arguments], capture_output=True,
                                      text=True, env={**os.environ, "ORT_TRAINER_CACHE_DIR": cache}, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps(runs[-1]), flush=True)
    return sorted(runs, key=lambda r: implementations.index(r["impl"]))  # (stable)


def table(runs: list[dict], title: str, command: str, steps: int, implementations: tuple[str, ...]) -> str:
    """The markdown page of ``runs`` (``run_rounds``' results; ``implementations[0]`` is eager PyTorch's), headed
    ``title``."""
    by = {impl: [r for r in runs if r["impl"] == impl] for impl in implementations}

    def warm(rows: list[dict]) -> list[dict]:  # the rounds after the first (the first alone where there is one)
        return rows[1:] or rows

    eager = by[implementations[0]]
    eager_ms = statistics.median(r["step_ms"] for r in warm(eager))
    eager_mb = max(r["peak_mb"] for r in warm(eager))
    lines = [f"# {title}", "",
             f"`{command}`, {os.cpu_count()} cores of {cpu_name()}, {len(eager)} rounds of {steps} steps per "
             "process, processes alternating. Step: each round's mean; the speed-up is of the warm rounds' median "
             "over eager's (the rounds after the first; in the first, the ort_trainer processes build their graphs "
             "and, from this run's empty cache, the torch operators' library). Peak RSS: the whole process's, cold "
             "(the first round's) / warm (the later rounds': the graph cache), and warm over eager's.", "",
             "| implementation | step (ms) | speed-up | first step (s) | peak RSS cold / warm (MB) | warm / eager |",
             "|---|---|---|---|---|---|"]
    for impl in implementations:
        rows = by[impl]
        median = statistics.median(r["step_ms"] for r in warm(rows))
        warm_mb = max(r["peak_mb"] for r in warm(rows))
        steps_ms = " / ".join(f"{r['step_ms']:.0f}" for r in rows)
        firsts = " / ".join(f"{r['first_s']:.1f}" for r in rows)
        lines.append(f"| {impl} | {steps_ms} | {eager_ms / median:.2f}× | {firsts} | {rows[0]['peak_mb']:.0f} / "
                     f"{warm_mb:.0f} | {warm_mb / eager_mb:.2f} |")
    return "\n".join(lines) + "\n"


def report(runs: list[dict], title: str, command: str, steps: int, implementations: tuple[str, ...],
           out: str | None) -> None:
    """Print ``table``'s page, and write it to ``out`` where given."""
    page = table(runs, title, command, steps, implementations)
    print(page)
    if out:
        Path(out).write_text(page)


__all__ = ["cpu_name", "parser", "report", "run_rounds", "table", "timed"]
