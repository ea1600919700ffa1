"""Main job: train a digits classifier with ORTTrainer, export it to ONNX, check the export.

Data: scikit-learn's bundled copy of the UCI optical-recognition digits (1,797 8x8 grey images,
shipped inside the scikit-learn package: no download). The script trains an MLP through ONNX
Runtime, reports test accuracy, writes ``<output-dir>/digits.onnx``, reloads it with a plain
``onnxruntime.InferenceSession`` and checks that its predictions equal the trainer's.

Run: ``python examples/digits_classifier.py [--epochs 30] [--output-dir outputs]``. Exits with
status 1 if the accuracy is below ``--min-accuracy`` or the exported model disagrees.

Data-parallel: ``torchrun --standalone --nproc_per_node 2 examples/digits_classifier.py`` or
``mpirun -n 2 python examples/digits_classifier.py`` runs the same job on two ranks, each training on its half of every batch (same global batch, same result up to float
rounding); rank 0 evaluates, exports and prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

from ort_trainer import ORTTrainer, ORTTrainerOptions
from ort_trainer.distributed import setup_distributed
from ort_trainer.optim import AdamConfig
from ort_trainer.optim.lr_scheduler import CosineWarmupLRScheduler


class DigitsMLP(torch.nn.Module):
    """64 pixels -> 128 -> 10 classes, with dropout."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(64, 128)
        self.dropout = torch.nn.Dropout(0.1)
        self.classifier = torch.nn.Linear(128, 10)

    def forward(self, pixels):
        return self.classifier(self.dropout(torch.relu(self.hidden(pixels))))


MODEL_DESC = {
    "inputs": [("pixels", ["batch", 64]), ("label", ["batch"])],
    "outputs": [("loss", [], True), ("logits", ["batch", 10])],
}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.95)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Train, evaluate, export and verify; returns the process exit status."""
    args = parse_args(argv)
    started = time.perf_counter()
    mpi = setup_distributed(seed=args.seed)  # rank 0 of 1 outside torchrun and mpirun
    torch.manual_seed(args.seed)  # the same initial model everywhere (rank 0's is broadcast anyway)
    digits = load_digits()
    pixels = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        pixels, digits.target.astype(np.int64), test_size=0.2, stratify=digits.target, random_state=args.seed
    )
    steps_per_epoch = len(x_train) // args.batch_size
    scheduler = CosineWarmupLRScheduler(total_steps=args.epochs * steps_per_epoch, warmup=0.05)
    trainer = ORTTrainer(
        DigitsMLP(), MODEL_DESC,
        AdamConfig(lr=args.lr, lambda_coef=1e-4, params=[{"params": ["hidden.bias", "classifier.bias"],
                                                            "lambda_coef": 0.0}]),
        loss_fn=torch.nn.functional.cross_entropy,
        options=ORTTrainerOptions(mpi.trainer_options(device={"id": "cpu"}, lr_scheduler=scheduler)),
    )
    if args.batch_size % mpi.world_size:
        raise SystemExit(f"--batch-size {args.batch_size} must divide by the {mpi.world_size} ranks")
    share = args.batch_size // mpi.world_size

    rng = np.random.default_rng(args.seed)
    progress = tqdm(range(args.epochs), desc="training", unit="epoch", disable=None if mpi.world_rank == 0 else True)
    usable = len(x_train) - len(x_train) % args.batch_size  # equal shards on every rank and step
    for _ in progress:
        order = rng.permutation(len(x_train))[:usable]
        for start in range(0, usable, args.batch_size):
            batch = order[start + mpi.world_rank * share:start + (mpi.world_rank + 1) * share]
            loss, _ = trainer.train_step(x_train[batch], y_train[batch])
        progress.set_postfix(loss=f"{loss.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")

    if mpi.world_rank != 0:
        return 0  # rank 0 evaluates, exports and reports
    _, logits = trainer.eval_step(x_test, y_test)
    predictions = logits.argmax(dim=1).numpy()
    accuracy = float((predictions == y_test).mean())

    args.output_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = args.output_dir / "digits.onnx"
    trainer.save_as_onnx(onnx_path)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (onnx_logits,) = session.run(["logits"], {"pixels": x_test})
    agree = float((onnx_logits.argmax(axis=1) == predictions).mean())
    max_diff = float(np.abs(onnx_logits - logits.numpy()).max())

    print(f"trained {trainer._train_step_info.optimization_step} steps on {len(x_train)} digits "
          f"in {time.perf_counter() - started:.1f} s on {mpi.world_size} rank(s)")
    print(f"test accuracy: {accuracy:.4f} on {len(x_test)} held-out digits")
    print(f"exported {onnx_path}; InferenceSession predictions agree on {agree:.2%} "
          f"(max |logit difference| {max_diff:.2e})")
    ok = accuracy >= args.min_accuracy and agree == 1.0
    if not ok:
        print(f"FAILED: need accuracy >= {args.min_accuracy} and full agreement", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
