"""GPT-2 language-model fine-tuning with ORTTrainer, after ONNX Runtime's classic GPT-2 example.

A Hugging Face ``GPT2LMHeadModel`` from a small config (random initial weights: nothing is
downloaded) is trained on the Python standard library's source, byte by byte, with Adam (decay
mode AFTER, as in the old Hugging Face AdamW), a linear warmup schedule and the loss computed
inside the model. It reports held-out perplexity, exports ONNX and generates text from the export.

    python examples/gpt2_finetune.py --max-steps 100
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ort_trainer import ORTTrainer
from ort_trainer.cli import sample_onnx
from ort_trainer.distributed import setup_onnxruntime_with_mpi
from ort_trainer.optim import AdamConfig, DecayMode
from ort_trainer.optim.lr_scheduler import LinearWarmupLRScheduler
from ort_trainer.text import ByteTokenizer, token_splits


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-tokens", type=int, default=120)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/gpt2_finetune"))
    return parser.parse_args(argv)


def lm_batch(ids: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> tuple:
    """Random windows; the model shifts the labels itself."""
    starts = rng.integers(0, len(ids) - length, size=batch)
    tokens = np.stack([ids[s:s + length] for s in starts])
    return tokens, np.ones_like(tokens), tokens.copy()


def main(argv=None) -> int:
    """Fine-tune, evaluate perplexity, export, generate."""
    args = parse_args(argv)
    ctx = setup_onnxruntime_with_mpi(seed=args.seed)
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=ByteTokenizer.vocab_size, n_positions=args.block_size, n_embd=args.embd,
                        n_layer=args.layers, n_head=4, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                        bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM", use_cache=False)
    model = GPT2LMHeadModel(config)
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", config.vocab_size])]}
    optim_config = AdamConfig(lr=args.learning_rate, lambda_coef=0.01,
                              weight_decay_mode=DecayMode.AFTER_WEIGHT_UPDATE,
                              params=[{"params": [n for n, _ in model.named_parameters() if "bias" in n or "ln_" in n],
                                       "lambda_coef": 0.0}])
    trainer = ORTTrainer(model, desc, optim_config, options=ctx.trainer_options(
        lr_scheduler=LinearWarmupLRScheduler(total_steps=args.max_steps, warmup=0.1)))
    trainer._train_step_info.fetches = ["loss"]
    train_ids, val_ids = token_splits(1_000_000)
    rng = np.random.default_rng([args.seed, ctx.world_rank])
    started, losses = time.perf_counter(), []
    for _ in range(args.max_steps):
        losses.append(float(trainer.train_step(*lm_batch(train_ids, rng, args.batch_size, args.block_size))))
    if ctx.world_rank != 0:
        return 0
    eval_rng = np.random.default_rng(1234)
    eval_loss = float(np.mean([float(trainer.eval_step(*lm_batch(val_ids, eval_rng, 16, args.block_size)))
                               for _ in range(4)]))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / "gpt2.onnx"
    trainer.save_as_onnx(path)
    print(f"{args.max_steps} steps in {time.perf_counter() - started:.1f} s; loss {np.mean(losses[:10]):.3f} -> "
          f"{np.mean(losses[-10:]):.3f}; held-out perplexity {math.exp(eval_loss):.2f} (uniform: 256)")
    print(f"exported {path}; generated from the export:")
    print(sample_onnx(path, "import ", args.sample_tokens, args.block_size, seed=args.seed))
    return 0 if np.mean(losses[-10:]) < np.mean(losses[:10]) else 1


if __name__ == "__main__":
    sys.exit(main())
