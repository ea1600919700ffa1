"""BERT masked-LM pretraining with ORTTrainer, after ONNX Runtime's classic nvidia-bert example.

A Hugging Face ``BertForMaskedLM`` from a small config (random weights: nothing is downloaded)
learns to fill in masked bytes of the Python standard library's source (``ort_trainer.text``),
with Lamb, a no-decay group, a polynomial warmup schedule and gradient accumulation. Runs under
``mpirun -n N`` too (each rank its own batches; rank 0 reports and exports).

    python examples/bert_pretraining.py --max-steps 100
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import BertConfig, BertForMaskedLM

sys.path.insert(0, str(Path(__file__).parent))
from ort_supplement import create_ort_trainer, run_ort_training_step, setup_onnxruntime_with_mpi  # noqa: E402

from ort_trainer.text import ByteTokenizer, token_splits  # noqa: E402

MASK_ID = 0  # byte 0 never occurs in the corpus: it serves as [MASK]


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line arguments (sizes, steps, learning rate, output)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch size per rank")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--warmup-proportion", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/bert_pretraining"))
    return parser.parse_args(argv)


def masked_batch(ids: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> tuple:
    """Random windows with 15% of the positions masked; labels are -100 elsewhere."""
    starts = rng.integers(0, len(ids) - length, size=batch)
    tokens = np.stack([ids[s:s + length] for s in starts])
    chosen = rng.random(tokens.shape) < 0.15
    return np.where(chosen, MASK_ID, tokens), np.ones_like(tokens), np.where(chosen, tokens, -100)


def main(argv=None) -> int:
    """Pretrain, evaluate the masked-LM loss on held-out text, export ONNX."""
    args = parse_args(argv)
    ctx = setup_onnxruntime_with_mpi(args)
    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=4, intermediate_size=4 * args.hidden,
                        max_position_embeddings=args.seq_length, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    model = BertForMaskedLM(config)
    model_desc = {"inputs": [("input_ids", ["batch", args.seq_length]), ("attention_mask", ["batch", args.seq_length]),
                             ("labels", ["batch", args.seq_length])],
                  "outputs": [("loss", [], True), ("logits", ["batch", args.seq_length, config.vocab_size])]}
    trainer = create_ort_trainer(args, ctx, model, model_desc)
    train_ids, val_ids = token_splits(1_000_000)
    rng = np.random.default_rng([args.seed, args.world_rank])
    started, losses = time.perf_counter(), []
    for _ in range(args.max_steps * args.gradient_accumulation_steps):
        losses.append(run_ort_training_step(args, trainer, masked_batch(train_ids, rng, args.batch_size, args.seq_length)))
    if args.world_rank != 0:
        return 0
    eval_rng = np.random.default_rng(1234)
    eval_loss = float(np.mean([float(trainer.eval_step(*masked_batch(val_ids, eval_rng, 16, args.seq_length)))
                               for _ in range(4)]))  # the trainer fetches the loss only
    args.output_dir.mkdir(parents=True, exist_ok=True)
    trainer.save_as_onnx(args.output_dir / "bert.onnx")
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"{trainer._train_step_info.optimization_step} optimizer steps in {time.perf_counter() - started:.1f} s "
          f"on {args.world_size} rank(s)")
    print(f"masked-LM loss: first 10 micro-batches {first:.3f}, last 10 {last:.3f}; held-out {eval_loss:.3f} "
          f"(uniform guess: {math.log(config.vocab_size):.3f})")
    print(f"exported {args.output_dir / 'bert.onnx'}")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
