"""Where ``device.host_threads``' automatic bound belongs on this machine: training steps with the host
work on one torch thread against torch's own count, across update sizes.

Run: ``make bench-threads`` (or ``python benchmarks/host_threads.py [--widths 1024,2048,4096]
[--rounds 2] [--steps 60]``). The model is an MLP ``w-w-w-10`` with ReLUs at batch 128 (``w = 1024``
is ``make bench-real``'s compute-bound MLP, 2.1 M weights; the weights grow as ``2 w²``), trained with
``AdamConfig`` and a gradient-norm clip of 1.0, fetching the loss. Each (width, thread count) runs in a
process of its own, the two counts alternating (the order reversed every other round): the spinning
of torch's OpenMP workers that the option avoids is a property of the process. The first process of
each width builds the graphs into a graph cache of this run's own; the others load them.

The table gives the median step of each process (after ``--warmup`` steps) and the ratio, with the
count ``host_threads``' default (0) picks for that update. On a many-core machine this says whether the
bound (``devices.ONE_THREAD_UPDATE_WEIGHTS``) is set right there; ``--out`` writes the table as markdown.
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

from real_sizes import _mlp  # noqa: E402  (make bench-real's MLP 1024 at other widths)


def worker(args) -> dict:
    """One process: ``args.steps`` timed training steps of the width-``args.width`` MLP with
    ``device.host_threads = args.threads`` (0: the default's choice)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from ort_trainer import ORTTrainer
    from ort_trainer.devices import host_threads
    from ort_trainer.optim import AdamConfig

    torch.manual_seed(0)
    model = _mlp(args.width, hidden=args.width)
    desc = {"inputs": [("x", ["batch", args.width]), ("labels", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 10])]}
    trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-4), options={"device": {"host_threads": args.threads}})
    trainer._train_step_info.fetches = ["loss"]  # as make bench-real's training loop
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, args.width, generator=generator), torch.randint(0, 10, (args.batch,), generator=generator))
               for _ in range(8)]
    torch_count = torch.get_num_threads()
    for step in range(args.warmup):
        trainer.train_step(*batches[step % len(batches)])
    seconds = []
    for step in range(args.steps):
        started = time.perf_counter()
        trainer.train_step(*batches[step % len(batches)])
        seconds.append(time.perf_counter() - started)
    weights = sum(p.numel() for p in model.parameters())
    return {"width": args.width, "threads": args.threads or torch_count, "torch_threads": torch_count,
            "weights": weights, "default_threads": host_threads(0, weights) or torch_count,
            "step_ms": statistics.median(seconds) * 1e3}


def _run_worker(width: int, threads: int, args, cache: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--width", str(width), "--threads", str(threads),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    env = dict(os.environ, ORT_TRAINER_CACHE_DIR=cache)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"the worker for width {width}, {threads} thread(s) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args) -> list[dict]:
    """Every (width, thread count) once per round, each in its own process; the results in run order."""
    import torch

    many = args.threads or torch.get_num_threads()
    if many == 1:
        raise SystemExit("torch has one thread on this machine: there is nothing to compare (give --threads N)")
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for round_ in range(args.rounds):
            for width in args.widths:
                order = (1, many) if (round_ + args.widths.index(width)) % 2 == 0 else (many, 1)
                for threads in order:
                    result = _run_worker(width, threads, args, cache)
                    result["round"] = round_ + 1
                    print(json.dumps(result), flush=True)
                    results.append(result)
    return results


def table(results: list[dict]) -> str:
    """The markdown table of ``results``: per width, the median over the rounds of each count's step."""
    lines = ["| width | weights (M) | step, 1 thread ms | step, N threads ms | N | 1 thread's speed-up | the default picks |",
             "|---|---|---|---|---|---|---|"]
    for width in sorted({r["width"] for r in results}):
        rows = [r for r in results if r["width"] == width]
        one = statistics.median(r["step_ms"] for r in rows if r["threads"] == 1)
        many_rows = [r for r in rows if r["threads"] != 1]
        many = statistics.median(r["step_ms"] for r in many_rows)
        n = many_rows[0]["threads"]
        default = "1" if rows[0]["default_threads"] == 1 else f"{rows[0]['torch_threads']} (torch's)"
        lines.append(f"| {width} | {rows[0]['weights'] / 1e6:.3g} | {one:.2f} | {many:.2f} | {n} | {many / one:.2f}× | {default} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="1024,1448,2048,2896,4096",
                        help="comma-separated MLP widths (weights ~2 w^2: 2.1, 4.2, 8.4, 16.8, 33.6 M)")
    parser.add_argument("--threads", type=int, default=0, help="the count to compare with one thread (0: torch's)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=600, help="seconds one worker process may take")
    parser.add_argument("--out", help="write the table, with the machine it ran on, to this markdown file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    args.widths = [int(w) for w in args.widths.split(",")]
    results = measure(args)
    text = table(results)
    print(text)
    if args.out:
        import torch

        header = (f"# host_threads: one torch thread against {results[0]['torch_threads'] if not args.threads else args.threads}\n\n"
                  f"`python benchmarks/host_threads.py --widths {','.join(map(str, args.widths))} --rounds {args.rounds} "
                  f"--steps {args.steps}` on {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
                  f"{time.strftime('%Y-%m-%d')}. The median step of each process, the median over the rounds.\n\n")
        Path(args.out).write_text(header + text + "\n")


if __name__ == "__main__":
    main()
