"""Train for a while, optionally loading a checkpoint first and saving one at the end.

Used by the resume tests in separate processes: batches depend only on the step index, so a
resumed run sees exactly the batches the uninterrupted run saw.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from models import ENCODER_DESC, TinyEncoder, mlm_batch, mlm_loss  # noqa: E402

from ort_trainer import ORTTrainer  # noqa: E402
from ort_trainer.amp import DynamicLossScaler  # noqa: E402
from ort_trainer.optim import AdamConfig, LambConfig  # noqa: E402
from ort_trainer.optim.lr_scheduler import LinearWarmupLRScheduler  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True, help="train_step calls to run in this process")
parser.add_argument("--optimizer", choices=["adam", "lamb"], default="adam")
parser.add_argument("--accumulation", type=int, default=1)
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--load", default="")
parser.add_argument("--save", default="")
parser.add_argument("--out", required=True)
args = parser.parse_args()

torch.manual_seed(1234 if not args.load else 999)  # a resumed run starts from other weights
config = (AdamConfig(lr=3e-3, lambda_coef=0.01) if args.optimizer == "adam"
          else LambConfig(lr=3e-3, lambda_coef=0.01, do_bias_correction=True))
scheduler = LinearWarmupLRScheduler(total_steps=20, warmup=0.2)
scaler = DynamicLossScaler(loss_scale=2.0 ** 8, up_scale_window=3)
trainer = ORTTrainer(TinyEncoder(dropout=args.dropout), ENCODER_DESC, config, loss_fn=mlm_loss, options={
    "lr_scheduler": scheduler, "mixed_precision": {"loss_scaler": scaler},
    "batch": {"gradient_accumulation_steps": args.accumulation}})
start = 0
if args.load:
    user = trainer.load_checkpoint(args.load)
    start = user["next_step"]
    assert trainer._train_step_info.step == start
losses = []
for step in range(start, start + args.steps):
    ids, labels = mlm_batch(torch.Generator().manual_seed(step))
    losses.append(trainer.train_step(ids, labels)[0].item())
if args.save:
    trainer.save_checkpoint(args.save, user_dict={"next_step": start + args.steps})
np.savez(args.out, losses=np.array(losses), scale=scaler.loss_scale, lr=scheduler.get_last_lr()[0],
         **{f"w/{k}": v for k, v in trainer.state_dict()["model"]["full_precision"].items()},
         **{f"m/{k}": v["Moment_1"] for k, v in trainer.state_dict()["optimizer"].items() if "Moment_1" in v})
