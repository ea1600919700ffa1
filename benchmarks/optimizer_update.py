"""The optimizer update, ``graph.optimizer="fused"`` against ``"graph"``, on a benchmark workload.

Run: ``python benchmarks/optimizer_update.py [--model bert] [--rounds 3]``. Each measurement runs in a
fresh process per implementation, the implementations alternating (the order reversed every other
round), so neither side's threads or memory touch the other's:

1. ``update``: after a few training steps, ``engine.update.step`` + ``commit`` alone, timed
   ``--updates`` times on the last step's gradients (restored before each update, outside the
   timing: the fused kernel writes the scaled gradient back); AdamW, clipping at 1.0 as the
   benchmarks train;
2. ``step``: whole training steps (``fetches = ["loss"]``), and the process's peak RSS (``ru_maxrss``).

Prints one JSON line per worker (with its medians) and the medians over every round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
IMPLEMENTATIONS = ("fused", "graph")


def _trainer(model_name: str, implementation: str):
    import torch

    from models import workload
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import AdamConfig

    torch.manual_seed(0)
    work = workload(model_name)
    trainer = ORTTrainer(work.make_model(), work.desc, AdamConfig(lr=1e-4, lambda_coef=0.01), loss_fn=work.loss_fn,
                         options={"graph": {"optimizer": implementation}})
    trainer._train_step_info.fetches = list(work.fetches)
    return trainer, work


def worker(args) -> dict:
    trainer, work = _trainer(args.model, args.impl)
    for _ in range(args.warmup):
        trainer.train_step(*work.batch)
    engine = trainer._engine
    result = {"impl": args.impl, "kind": args.kind, "update_class": type(engine.update).__name__,
              "weights": int(engine.weights_flat[0].numel())}
    if args.kind == "update":
        saved = engine.accumulated_flat.clone()
        times = []
        for t in range(args.updates):
            engine.accumulated_flat.copy_(saved)
            started = time.perf_counter()
            outcome = engine.update.step([1e-4], args.warmup + 1 + t, 1.0)
            engine.update.commit()
            times.append(time.perf_counter() - started)
            assert outcome.all_finite and outcome.weights_finite
        result["update_ms"] = [1e3 * x for x in times]
    else:
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            trainer.train_step(*work.batch)
            times.append(time.perf_counter() - started)
        result["step_ms"] = [1e3 * x for x in times]
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--kind", choices=["update", "step"], default="update")
    parser.add_argument("--impl", choices=IMPLEMENTATIONS, default="fused")
    parser.add_argument("--model", default="bert")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--updates", type=int, default=25)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    results: dict = {}
    for kind in ("update", "step"):
        for r in range(args.rounds):
            for impl in IMPLEMENTATIONS if r % 2 == 0 else IMPLEMENTATIONS[::-1]:
                command = [sys.executable, __file__, "--worker", "--kind", kind, "--impl", impl, "--model", args.model,
                           "--warmup", str(args.warmup), "--updates", str(args.updates), "--steps", str(args.steps)]
                done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy(), check=True)
                line = json.loads(done.stdout.strip().splitlines()[-1])
                summary = {k: v for k, v in line.items() if not k.endswith("_ms")}
                summary.update({f"median_{k}": round(statistics.median(v), 2)
                                for k, v in line.items() if k.endswith("_ms")})
                print(json.dumps(summary), flush=True)
                for key in ("update_ms", "step_ms"):
                    results.setdefault((key, impl), []).extend(line.get(key, []))
                if "peak_rss_mb" in line:
                    results.setdefault(("peak_rss_mb", impl), []).append(line["peak_rss_mb"])
    for (key, impl), values in sorted(results.items()):
        print(f"{args.model} {key:12s} {impl:6s} median {statistics.median(values):8.2f}  (n={len(values)}, "
              f"min {min(values):.2f}, max {max(values):.2f})")


if __name__ == "__main__":
    main()
