"""Helpers in the style of the classic ONNX Runtime BERT example's ``ort_supplement`` module.

``setup_onnxruntime_with_mpi`` prepares the process (one per rank under mpirun),
``create_ort_trainer`` builds an ORTTrainer with Lamb, a no-decay group for biases and LayerNorm
weights and a polynomial warmup schedule, and ``run_ort_training_step`` runs one step.
"""

from __future__ import annotations

import argparse

import torch

from ort_trainer import ORTTrainer
from ort_trainer.distributed import MPIContext
from ort_trainer.distributed import setup_onnxruntime_with_mpi as _setup
from ort_trainer.optim import LambConfig
from ort_trainer.optim.lr_scheduler import PolyWarmupLRScheduler


def setup_onnxruntime_with_mpi(args: argparse.Namespace) -> MPIContext:
    """Rank, size, device and seed for this process; fills ``args.world_rank`` etc."""
    ctx = _setup(seed=args.seed)
    args.world_rank, args.world_size, args.local_rank, args.device = ctx.world_rank, ctx.world_size, ctx.local_rank, ctx.device
    return ctx


def create_ort_trainer(args: argparse.Namespace, ctx: MPIContext, model: torch.nn.Module, model_desc: dict) -> ORTTrainer:
    """Lamb (no weight decay for biases and LayerNorm), poly warmup, gradient accumulation."""
    no_decay = [n for n, _ in model.named_parameters() if "bias" in n or "LayerNorm" in n]
    optim_config = LambConfig(params=[{"params": no_decay, "lambda_coef": 0.0}], lr=args.learning_rate,
                              lambda_coef=0.01)
    scheduler = PolyWarmupLRScheduler(total_steps=args.max_steps, warmup=args.warmup_proportion)
    options = ctx.trainer_options(
        batch={"gradient_accumulation_steps": args.gradient_accumulation_steps},
        lr_scheduler=scheduler,
        utils={"grad_norm_clip": True},
    )
    return ORTTrainer(model, model_desc, optim_config, options=options)


def run_ort_training_step(args: argparse.Namespace, trainer: ORTTrainer, batch: tuple) -> float:
    """One micro-batch; returns its loss."""
    trainer._train_step_info.fetches = ["loss"]
    return float(trainer.train_step(*batch))
