"""The engine keeps weights, gradients and optimizer state in ONNX Runtime buffers across steps."""

import torch

from models import MLP, MLP_DESC, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.optim import AdamConfig


def test_buffers_live_across_steps_and_outputs_are_not_overwritten():
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy)
    gen = torch.Generator().manual_seed(0)
    first_loss, first_logits = trainer.train_step(*mlp_batch(gen))
    kept_logits = first_logits.clone()
    engine = trainer._engine
    pointers = {(p, name): value.data_ptr() for p in (0, 1) for name, value in engine.buffers[p].items()}
    grad_pointers = {name: value.data_ptr() for name, value in engine.grads.items()}
    assert set(name for _, name in pointers) == {
        f"{w}{suffix}" for w in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        for suffix in ("", ".Moment_1", ".Moment_2")
    }
    for _ in range(4):
        trainer.train_step(*mlp_batch(gen))
    assert {(p, n): v.data_ptr() for p in (0, 1) for n, v in engine.buffers[p].items()} == pointers
    assert {n: v.data_ptr() for n, v in engine.grads.items()} == grad_pointers
    torch.testing.assert_close(first_logits, kept_logits, rtol=0, atol=0)
    assert engine.parity == 1  # five updates: the double buffers swapped five times
