"""Optimizer semantics of api.md sections 3-4, checked against torch.optim and numpy references."""

import math

import numpy as np
import pytest
import torch

from models import MLP, MLP_DESC, clone, mlp_batch, torch_step
from ort_trainer import ORTTrainer
from ort_trainer.optim import AdamConfig, DecayMode, LambConfig, SGDConfig
from ort_trainer.optim.lr_scheduler import LinearWarmupLRScheduler

CE = torch.nn.functional.cross_entropy
STEPS = 15


def _batches(seed, n=STEPS):
    gen = torch.Generator().manual_seed(seed)
    return [mlp_batch(gen) for _ in range(n)]


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(np.asarray(b)), 1e-30))


def _numpy_reference(model, batches, update, clip=None):
    """Train with torch autograd gradients and a numpy update rule; returns the final weights."""
    weights = {k: v.detach().numpy().astype(np.float64) for k, v in model.named_parameters()}
    state = {}
    for t, (x, y) in enumerate(batches, start=1):
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(torch.from_numpy(weights[k].astype(np.float32)))
        model.zero_grad()
        CE(model(x), y).backward()
        grads = {k: p.grad.numpy().astype(np.float64) for k, p in model.named_parameters()}
        if clip is not None:
            norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
            grads = {k: g * min(1.0, clip / (norm + 1e-6)) for k, g in grads.items()}
        weights = {k: update(k, weights[k], grads[k], t, state) for k in weights}
    return weights


def _trained(config, batches, model, **options):
    trainer = ORTTrainer(model, MLP_DESC, config, loss_fn=CE, options=options or None)
    for x, y in batches:
        trainer.train_step(x, y)
    return trainer, trainer.state_dict()["model"]["full_precision"]


def test_adam_after_weight_update_matches_hugging_face_adamw():
    lr, a, b, eps, decay = 1e-2, 0.9, 0.999, 1e-8, 0.05

    def update(key, w, g, t, state):
        m, v = state.get(key, (0.0, 0.0))
        m, v = a * m + (1 - a) * g, b * v + (1 - b) * g * g
        state[key] = (m, v)
        step = lr * math.sqrt(1 - b ** t) / (1 - a ** t)
        w = w - step * m / (np.sqrt(v) + eps)
        return w - lr * decay * w

    model, batches = MLP(), _batches(11)
    expected = _numpy_reference(clone(model), batches, update, clip=1.0)
    config = AdamConfig(lr=lr, lambda_coef=decay, weight_decay_mode=DecayMode.AFTER_WEIGHT_UPDATE)
    _, got = _trained(config, batches, model)
    for key in expected:
        assert _rel(got[key], expected[key]) < 1e-5, key


def test_lamb_matches_the_formula():
    lr, a, b, eps, decay = 1e-2, 0.9, 0.999, 1e-6, 0.01

    def update(key, w, g, t, state):
        m, v = state.get(key, (0.0, 0.0))
        m, v = a * m + (1 - a) * g, b * v + (1 - b) * g * g
        state[key] = (m, v)
        d = m / (np.sqrt(v) + eps) + decay * w  # no bias correction by default
        wn, dn = np.linalg.norm(w), np.linalg.norm(d)
        r = min(max(wn / dn, 0.05), 5.0) if wn > 0 and dn > 0 else 1.0
        return w - lr * r * d

    model, batches = MLP(), _batches(12)
    expected = _numpy_reference(clone(model), batches, update, clip=1.0)
    _, got = _trained(LambConfig(lr=lr, lambda_coef=decay, ratio_min=0.05, ratio_max=5.0), batches, model)
    for key in expected:
        assert _rel(got[key], expected[key]) < 1e-5, key


def test_parameter_groups_match_torch_param_groups():
    model, batches = MLP(), _batches(13)
    reference = clone(model)
    config = AdamConfig(
        lr=1e-2, lambda_coef=0.1,
        params=[{"params": ["fc1.bias", "fc2.bias"], "lambda_coef": 0.0}, {"params": ["fc2.weight"], "lr": 3e-2}],
    )
    trainer, got = _trained(config, batches, model)
    optimizer = torch.optim.AdamW([
        {"params": [reference.fc1.weight], "weight_decay": 0.1},
        {"params": [reference.fc1.bias, reference.fc2.bias], "weight_decay": 0.0},
        {"params": [reference.fc2.weight], "weight_decay": 0.1, "lr": 3e-2},
    ], lr=1e-2)
    for x, y in batches:
        torch_step(reference, optimizer, CE, (x,), y, clip=1.0)
    for key, value in reference.state_dict().items():
        assert _rel(got[key], value.numpy()) < 1e-5, key


def test_frozen_weights_never_change_and_clipping_can_be_turned_off():
    model, batches = MLP(), _batches(14)
    reference = clone(model)
    reference.fc1.weight.requires_grad_(False)
    initial = model.fc1.weight.detach().clone()
    _, got = _trained(AdamConfig(lr=1e-2), batches, model,
                      utils={"frozen_weights": ["fc1.weight"], "grad_norm_clip": False})
    np.testing.assert_array_equal(got["fc1.weight"], initial.numpy())
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    for x, y in batches:
        torch_step(reference, optimizer, CE, (x,), y, clip=None)
    for key, value in reference.state_dict().items():
        assert _rel(got[key], value.numpy()) < 1e-5, key


def test_scheduler_learning_rate_reaches_the_graph_each_step():
    model, batches = MLP(), _batches(15, n=10)
    reference = clone(model)
    scheduler = LinearWarmupLRScheduler(total_steps=10, warmup=0.3)
    trainer = ORTTrainer(model, MLP_DESC, SGDConfig(lr=0.2), loss_fn=CE, options={"lr_scheduler": scheduler})
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    torch_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: scheduler.get_lr_at(s, 1.0))
    for step, (x, y) in enumerate(batches):
        loss = trainer.train_step(x, y)[0].item()
        assert scheduler.get_last_lr() == [pytest.approx(0.2 * scheduler.get_lr_at(step, 1.0))]
        assert loss == pytest.approx(torch_step(reference, optimizer, CE, (x,), y, clip=None), rel=1e-5)
        torch_scheduler.step()
    got = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():
        assert _rel(got[key].numpy(), value.numpy()) < 1e-5, key


def test_non_finite_gradients_skip_the_update():
    model, batches = MLP(), _batches(16, n=3)
    trainer = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    trainer.train_step(*batches[0])
    before = trainer.state_dict()
    bad = batches[1][0].clone()
    bad[0, 0] = float("nan")
    trainer.train_step(bad, batches[1][1])
    info = trainer._train_step_info
    assert info.all_finite is False and info.step == 2 and info.optimization_step == 1
    after = trainer.state_dict()
    for name, value in before["model"]["full_precision"].items():
        np.testing.assert_array_equal(after["model"]["full_precision"][name], value)
        for moment in ("Moment_1", "Moment_2"):
            np.testing.assert_array_equal(after["optimizer"][name][moment], before["optimizer"][name][moment])
    trainer.train_step(*batches[2])
    assert info.all_finite is True and info.optimization_step == 2
