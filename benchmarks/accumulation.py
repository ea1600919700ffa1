"""Gradient accumulation at the sizes users train: peak memory and time per optimizer step of k
micro-batches, ort_trainer against eager PyTorch accumulating into ``.grad``.

Run: ``python benchmarks/accumulation.py [--models gpt2,bert] [--k 4] [--rounds 2] [--windows 4]
[--out docs/benchmarks_accumulation.md]``. Each micro-batch is a ``make bench-real`` batch of the row
(GPT-2 small, BERT-base MLM: B4×S128, random weights, dropout 0), the same k micro-batches every window.
ort_trainer: ``AdamConfig(lr=1e-4)`` with ``batch.gradient_accumulation_steps = k``, fetching the loss;
eager: ``(loss / k).backward()`` per micro-batch, then ``clip_grad_norm_(1.0)`` and ``torch.optim.AdamW``.
Each implementation runs in a process of its own, the order alternating from round to round; the first
round's ort_trainer process builds its graphs (cold: it imports torch's export stack), the later ones
find them in this run's graph cache (warm). Peak RSS is the whole process's (``ru_maxrss``); a window's
time is the median over the windows after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from real_sizes import SIZES, _peak_mb, eager_loss, workload  # noqa: E402  (make bench-real's rows)


def worker(args) -> dict:
    """One process: ``args.windows`` optimizer steps of ``args.k`` micro-batches with ``args.impl``."""
    import torch

    sys.path.insert(0, str(ROOT))
    model, desc, batch_of = workload(args.model)
    micro = [batch_of() for _ in range(args.k)]
    if args.impl == "ort":
        from ort_trainer import ORTTrainer
        from ort_trainer.optim import AdamConfig

        trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-4), options={"batch": {"gradient_accumulation_steps": args.k}})
        trainer._train_step_info.fetches = ["loss"]

        def window() -> list[float]:
            return [float(trainer.train_step(*inputs)) for inputs in micro]
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def window() -> list[float]:
            optimizer.zero_grad(set_to_none=True)
            losses = []
            for inputs in micro:
                loss = eager_loss(args.model, model, inputs)
                (loss / args.k).backward()  # ort_trainer averages the window's gradients the same way
                losses.append(float(loss))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return losses

    losses, seconds = [], []
    for _ in range(args.windows):
        started = time.perf_counter()
        losses += window()
        seconds.append(time.perf_counter() - started)
    return {"model": args.model, "impl": args.impl, "losses": losses, "first_s": seconds[0],
            "window_s": statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0], "peak_mb": _peak_mb()}


def _spawn(model: str, impl: str, args, cache: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--model", model, "--impl", impl, "--k", str(args.k),
               "--windows", str(args.windows)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "ORT_TRAINER_CACHE_DIR": cache},
                          timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"{model} {impl} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args) -> list[dict]:
    """Every row's processes, alternating implementations; the first ort_trainer process of a row cold."""
    results = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as cache:
            for number in range(args.rounds):
                for impl in ("ort", "eager") if number % 2 == 0 else ("eager", "ort"):
                    result = _spawn(model, impl, args, cache)
                    result["cold"] = impl == "ort" and number == 0
                    print(json.dumps(result), flush=True)
                    results.append(result)
    return results


def table(results: list[dict], k: int) -> str:
    """Per row: the losses' largest relative difference, the median window of each implementation
    and their ratio, and the peaks: ort_trainer's cold and warm process (the most of each), eager's."""
    lines = ["| model | B×S × k | losses vs eager (max rel.) | step of k ort / eager s | speed-up "
             "| peak RSS cold / warm / eager MB (ratios) |", "|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in results):
        ort = [r for r in results if r["model"] == model and r["impl"] == "ort"]
        eager = [r for r in results if r["model"] == model and r["impl"] == "eager"]
        difference = max(abs(a - b) / abs(b) for run in ort for a, b in zip(run["losses"], eager[0]["losses"]))
        ort_s, eager_s = (statistics.median(r["window_s"] for r in runs) for runs in (ort, eager))
        eager_peak = max(r["peak_mb"] for r in eager)
        peaks = [max((r["peak_mb"] for r in ort if r["cold"] == cold), default=None) for cold in (True, False)]
        shown = " / ".join("—" if p is None else f"{p:.0f}" for p in peaks)
        ratios = " / ".join("—" if p is None else f"{p / eager_peak:.2f}" for p in peaks)
        batch, seq = SIZES[model][:2]
        lines.append(f"| {model} | {batch}×{seq} × {k} | {difference:.1e} | {ort_s:.3g} / {eager_s:.3g} | "
                     f"{eager_s / ort_s:.2f}× | {shown} / {eager_peak:.0f} ({ratios}) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,bert", help=f"comma-separated rows of {sorted(SIZES)}")
    parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--windows", type=int, default=4, help="optimizer steps per process (the first untimed)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one worker process may take")
    parser.add_argument("--out", type=Path, help="write the table, with the machine it ran on, to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=("ort", "eager"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in SIZES or m.startswith("mlp")]
    if unknown or args.k < 2 or args.rounds < 1 or args.windows < 1:
        parser.error(f"--models takes GPT-2 and BERT rows of {sorted(m for m in SIZES if not m.startswith('mlp'))} "
                     f"(unknown: {unknown}); --k ≥ 2, --rounds and --windows ≥ 1")
    text = table(measure(args), args.k)
    print(text)
    if args.out:
        import onnxruntime
        import torch

        header = (f"# Gradient accumulation at real sizes\n\n`python benchmarks/accumulation.py --models "
                  f"{','.join(args.models)} --k {args.k} --rounds {args.rounds} --windows {args.windows}` on "
                  f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}, "
                  f"onnxruntime {onnxruntime.__version__}; {time.strftime('%Y-%m-%d')}. A step is k micro-batches and "
                  "one optimizer update; its time the median over each process's steps after its first, then over "
                  "the processes. Peak RSS: the whole process's, the most over ort_trainer's cold processes (they "
                  "built the graphs), over its warm ones (they found them in the cache), and over eager's.\n\n")
        args.out.write_text(header + text + "\n")


if __name__ == "__main__":
    main()
