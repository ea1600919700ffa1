"""A data-parallel job for the MPI tests: run it plainly (1 rank), under ``mpiexec -n 2`` or under
``torchrun --standalone --nproc_per_node 2`` (the same script: ``setup_onnxruntime_with_mpi`` reads
whichever launcher started it).

Every rank trains the MLP on its shard of the same global batches and writes its final weights
to ``<out>/weights_rank<r>.npz`` and a few facts to ``<out>/facts_rank<r>.json``.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from models import MLP, MLP_DESC, mlp_batch  # noqa: E402

from ort_trainer import ORTTrainer  # noqa: E402
from ort_trainer.distributed import setup_onnxruntime_with_mpi  # noqa: E402
from ort_trainer.optim import AdamConfig, LambConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--global-batch", type=int, default=16)
parser.add_argument("--accumulation", type=int, default=1)
parser.add_argument("--post-accumulation", action="store_true")
parser.add_argument("--zero", type=int, default=0)
parser.add_argument("--fail-at-step", type=int, default=-1)
parser.add_argument("--bad-batch-at-step", type=int, default=-1,
                    help="rank 1 gets a malformed batch at this step, catches the error and skips the step")
parser.add_argument("--leave-at-step", type=int, default=-1, help="rank 1 leaves its loop at this step")
parser.add_argument("--stall-at-step", type=int, default=-1, help="rank 1 stops responding at this step")
parser.add_argument("--vanish-at-step", type=int, default=-1, help="rank 1's process ends at once at this step")
parser.add_argument("--kill-at-step", type=int, default=-1,
                    help="rank 1 is killed (SIGKILL) at this step, after writing the time to <out>/killed_at.txt")
parser.add_argument("--optimizer", choices=["adam", "lamb"], default="adam")
parser.add_argument("--backend", choices=["auto", "mpi", "gloo", "nccl"], default="auto", help="distributed.backend")
parser.add_argument("--device", default="cpu", help="device.id; 'auto': the one setup_onnxruntime_with_mpi picked")
parser.add_argument("--load", default="", help="checkpoint to resume from")
parser.add_argument("--save", default="", help="checkpoint to write at the end")
parser.add_argument("--load-on-rank-0-only", action="store_true", help="rank 1 forgets to load the checkpoint")
args = parser.parse_args()

ctx = setup_onnxruntime_with_mpi(seed=1)
torch.manual_seed(100 + ctx.world_rank)  # ranks start from different weights: rank 0's must win
options = ctx.trainer_options(
    batch={"gradient_accumulation_steps": args.accumulation},
    distributed={"allreduce_post_accumulation": args.post_accumulation,
                 "deepspeed_zero_optimization": {"stage": args.zero}, "backend": args.backend},
)
options["device"]["id"] = ctx.device if args.device == "auto" else args.device
config = (AdamConfig if args.optimizer == "adam" else LambConfig)(lr=1e-2, lambda_coef=0.01)
trainer = ORTTrainer(MLP(), MLP_DESC, config, loss_fn=torch.nn.functional.cross_entropy, options=options)
loads = args.load and not (args.load_on_rank_0_only and ctx.world_rank == 1)
start = trainer.load_checkpoint(args.load)["next_step"] if loads else 0
micro = args.global_batch // args.accumulation  # the global micro-batch, split across ranks
share = micro // ctx.world_size
losses, seconds = [], []
for step in range(start, start + args.steps * args.accumulation):
    if step == args.fail_at_step and ctx.world_rank == 1:
        raise RuntimeError(f"deliberate failure on rank {ctx.world_rank} at step {step}")
    if step == args.leave_at_step and ctx.world_rank == 1:
        break
    if step == args.stall_at_step and ctx.world_rank == 1:
        time.sleep(3600)
    if step == args.vanish_at_step and ctx.world_rank == 1:
        os._exit(0)  # no clean-up, no goodbye: as if the process had been killed quietly
    if step == args.kill_at_step and ctx.world_rank == 1:
        (args.out / "killed_at.txt").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer or `kill -9` does: no handler runs
    x, y = mlp_batch(torch.Generator().manual_seed(1000 + step), batch=micro)
    mine = slice(ctx.world_rank * share, (ctx.world_rank + 1) * share)
    if step == args.bad_batch_at_step and ctx.world_rank == 1:
        try:
            trainer.train_step(x[mine][:, :19], y[mine])  # a malformed batch: the step is refused
        except ValueError:
            continue  # the user skips it on this rank only: the ranks are now one step apart
    started = time.perf_counter()
    losses.append(trainer.train_step(x[mine], y[mine])[0].item())
    seconds.append(time.perf_counter() - started)

if args.save:
    trainer.save_checkpoint(args.save, user_dict={"next_step": start + args.steps * args.accumulation})
state = trainer.state_dict()
np.savez(args.out / f"weights_rank{ctx.world_rank}.npz", **state["model"]["full_precision"])
local_states = sum(a.size for a in trainer._engine.state_arrays().values())
(args.out / f"facts_rank{ctx.world_rank}.json").write_text(json.dumps({
    "rank": ctx.world_rank, "size": ctx.world_size, "local_rank": ctx.local_rank, "threads": ctx.threads,
    "launcher": ctx.launcher,
    "optimization_step": trainer._train_step_info.optimization_step, "local_optimizer_state_elements": int(local_states),
    "gathered_optimizer_weights": len(state["optimizer"]), "first_loss": losses[0],
    "backend": trainer._comm.backend if trainer._comm is not None else None, "device": options["device"]["id"],
    "median_step_seconds": statistics.median(seconds[3:] or seconds),
}))
