"""Benchmark: 1 rank x 2 threads vs 2 ranks x 1 thread (under mpirun, MPI; under torchrun, gloo) on
the same training job.

Run: ``python benchmarks/data_parallel.py [--steps 30] [--rounds 2]``. It launches the worker
(this file with ``--worker``) alternately as one process, under ``mpiexec -n 2`` and under
``torchrun --standalone --nproc_per_node 2``, takes the median step time of each run after
warm-up, prints a table and writes ``docs/benchmarks_data_parallel.md``, naming the CPU. The job: a 4-layer transformer encoder (hidden 128, 4 heads,
vocab 2000, sequence 64), masked-LM loss, AdamW, global batch 16 split across the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import host  # noqa: E402

# label -> (ranks, launcher)
CONFIGURATIONS = {"1 rank x 2 threads": (1, None), "2 ranks x 1 thread, mpirun (MPI)": (2, "mpiexec"),
                  "2 ranks x 1 thread, torchrun (gloo)": (2, "torchrun")}


def worker(args: argparse.Namespace) -> None:
    """One training run; rank 0 writes its step times to ``args.out``."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from models import TinyEncoder, mlm_loss

    from ort_trainer import ORTTrainer
    from ort_trainer.distributed import setup_distributed
    from ort_trainer.optim import AdamConfig

    ctx = setup_distributed(seed=0)
    vocab, seq = 2000, 64
    desc = {"inputs": [("ids", ["batch", seq]), ("labels", ["batch", seq])],
            "outputs": [("loss", [], True), ("logits", ["batch", seq, vocab])]}
    model = TinyEncoder(vocab=vocab, hidden=128, layers=4, heads=4)
    trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-4), loss_fn=mlm_loss, options=ctx.trainer_options())
    gen = torch.Generator().manual_seed(0)
    share = args.global_batch // ctx.world_size
    times = []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.global_batch, seq), generator=gen)
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=gen) < 0.85] = -100
        mine = slice(ctx.world_rank * share, (ctx.world_rank + 1) * share)
        started = time.perf_counter()
        trainer.train_step(ids[mine], labels[mine])
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    if ctx.world_rank == 0:
        Path(args.out).write_text(json.dumps({"ranks": ctx.world_size, "threads": ctx.threads, "times": times}))


def run(label: str, ranks: int, launcher: str | None, args: argparse.Namespace) -> dict:
    """Launch one worker run (``launcher``: ``"mpiexec"``, ``"torchrun"`` or None) and return its report."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    command = [__file__, "--worker", "--out", out, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--global-batch", str(args.global_batch)]
    program = shutil.which(launcher, path=str(Path(sys.executable).parent)) or launcher if launcher else None
    if launcher == "mpiexec":
        command = [program, "-n", str(ranks), sys.executable, *command]
    elif launcher == "torchrun":  # runs the script with its own Python
        command = [program, "--standalone", "--nproc_per_node", str(ranks), *command]
    else:
        command = [sys.executable, *command]
    subprocess.run(command, check=True, stdin=subprocess.DEVNULL)
    report = json.loads(Path(out).read_text())
    os.unlink(out)
    report["label"] = label
    return report


def main() -> None:
    """Alternate the two configurations, then print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write", type=Path, default=ROOT / "docs" / "benchmarks_data_parallel.md")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    medians: dict[str, list[float]] = {label: [] for label in CONFIGURATIONS}
    for _ in range(args.rounds):
        for label, (ranks, launcher) in CONFIGURATIONS.items():
            medians[label].append(statistics.median(run(label, ranks, launcher, args)["times"]))
    rows = []
    base = statistics.median(medians["1 rank x 2 threads"])
    for label, values in medians.items():
        step = statistics.median(values)
        rows.append(f"| {label} | {step * 1000:.1f} | {args.global_batch / step:.1f} | {base / step:.2f} |")
    table = "\n".join(["| configuration | median step (ms) | samples/s | speed vs 1 rank |",
                       "|---|---|---|---|", *rows])
    print(table)
    text = (
        "# Data-parallel benchmark\n\n"
        f"`python benchmarks/data_parallel.py` on {host.sentence(host.describe())}, "
        f"{args.rounds} alternating rounds of {args.steps} steps after {args.warmup} warm-up steps.\n"
        "Job: 4-layer transformer encoder (hidden 128, 4 heads, vocab 2000, sequence 64), masked-LM "
        f"loss, AdamW, global batch {args.global_batch}.\n\n{table}\n"
    )
    args.write.write_text(text)


if __name__ == "__main__":
    main()
