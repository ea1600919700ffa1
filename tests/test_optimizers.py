"""Optimizer semantics of api.md sections 3-4, checked step for step against torch.optim and
numpy references written from the formulas, on an MLP and on the small transformer."""

import math

import numpy as np
import pytest
import torch

from models import (ENCODER_DESC, MLP, MLP_DESC, TinyEncoder, clone, mlm_batch, mlm_loss, mlp_batch,
                    torch_step)
from ort_trainer import ORTTrainer
from tolerances import FLOAT32, FLOAT64, check, steps_bound
from ort_trainer.optim import AdamConfig, DecayMode, LambConfig, SGDConfig
from ort_trainer.optim.lr_scheduler import LinearWarmupLRScheduler

CE = torch.nn.functional.cross_entropy
STEPS = 30
# ONNX Runtime against torch.optim (or a float64 update on torch's float32 gradients) for STEPS
# steps: the forward and backward sums of each step may add in another order on each side (≤ 64
# terms: u·64 per step, Higham's bound), carried through the weights at most once per step:
# STEPS · 64 · u = 1.1e-4 (tolerances.steps_bound). Observed at 1 and 2 threads: ≤ 3.9e-6 (30x under).
RTOL = steps_bound(STEPS)
# One LAMB step on a zero bias (test_lamb_trust_ratio_is_one_when_a_norm_is_zero): ONNX Runtime's
# float32 update against float64 arithmetic on torch's float32 gradient. The gradients differ by at
# most one step's sums in another order (steps_bound(1) = 64·u), and d = 0.1·g / (√(0.001·g²) + ε)
# passes at most all of a gradient's relative difference on (its sensitivity ε / (√0.001·|g| + ε)
# is ≤ 1); the update itself rounds about 10 times in float32 ((1−β)·g, g², √, + ε, /, ·lr, ...):
# (64 + 10)·u = 4.4e-6. Observed at 1 and 2 threads: 1.3e-7 (2u), 35x under.
FIRST_STEP_RTOL = steps_bound(1) + 10 * FLOAT32
# Learning rates read back from the scheduler against 0.2 · get_lr_at(step, 1.0): both float64, each
# side at most 3 rounded operations (lr · s, / W; or (T − s) / (T − W), · lr; and the test's 0.2 ·),
# so at most 6·u64 apart (u64 = 2^-53; bound 8·u64); zeros are exact on both sides (abs=0).
# Observed at 1 and 2 threads: 0 (the same value).
LR_RTOL = 8 * FLOAT64
# The loss of each of 10 SGD steps (test_scheduler_learning_rate_reaches_the_graph_each_step), ONNX
# Runtime against torch: the loss of step k carries k − 1 updates apart and its own forward, each at
# most 64·u (RTOL's argument): steps_bound(10) = 3.8e-5. The test holds the tighter 1e-5, below that
# worst case (which has every rounding add the same way). Observed at 1 and 2 threads: 8.0e-8, 125x under.
LOSS_RTOL = 1e-5

# name -> (model factory, description, loss, batch factory)
SETUPS = {
    "mlp": (MLP, MLP_DESC, CE, mlp_batch),
    "transformer": (TinyEncoder, ENCODER_DESC, mlm_loss, mlm_batch),
}


def _batches(setup, seed, n=STEPS):
    gen = torch.Generator().manual_seed(seed)
    return [SETUPS[setup][3](gen) for _ in range(n)]


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _assert_close(got: dict, expected: dict, rtol=RTOL):
    errors = {k: _rel(got[k], expected[k]) for k in expected}
    worst = max(errors, key=errors.get)
    check(errors[worst], rtol, f"{worst}: relative error")


def _numpy_reference(setup, model, batches, update, clip=None):
    """Train with torch autograd gradients and a float64 numpy update; returns the final weights."""
    loss_fn = SETUPS[setup][2]
    weights = {k: v.detach().numpy().astype(np.float64) for k, v in model.named_parameters()}
    state = {}
    for t, (x, y) in enumerate(batches, start=1):
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(torch.from_numpy(weights[k].astype(np.float32)))
        model.zero_grad()
        loss_fn(model(x), y).backward()
        grads = {k: p.grad.numpy().astype(np.float64) for k, p in model.named_parameters()}
        if clip is not None:
            norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
            grads = {k: g * min(1.0, clip / (norm + 1e-6)) for k, g in grads.items()}
        weights = {k: update(k, weights[k], grads[k], t, state) for k in weights}
    return weights


def _ort_weights(setup, config, batches, model, **options):
    _, desc, loss_fn, _ = SETUPS[setup]
    trainer = ORTTrainer(model, desc, config, loss_fn=loss_fn, options=options or None)
    for x, y in batches:
        trainer.train_step(x, y)
    return trainer.state_dict()["model"]["full_precision"]


def _torch_weights(setup, model, optimizer_factory, batches, clip):
    loss_fn = SETUPS[setup][2]
    optimizer = optimizer_factory(model)
    for x, y in batches:
        torch_step(model, optimizer, loss_fn, (x,), y, clip=clip)
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("setup", SETUPS)
def test_sgd_matches_torch(setup):
    model, batches = SETUPS[setup][0](), _batches(setup, 21)
    expected = _torch_weights(setup, clone(model), lambda m: torch.optim.SGD(m.parameters(), lr=0.05), batches, None)
    _assert_close(_ort_weights(setup, SGDConfig(lr=0.05), batches, model), expected)


@pytest.mark.parametrize("setup", SETUPS)
def test_adam_before_weight_update_matches_torch_adamw(setup):
    model, batches = SETUPS[setup][0](), _batches(setup, 22)
    expected = _torch_weights(
        setup, clone(model), lambda m: torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01), batches, None)
    got = _ort_weights(setup, AdamConfig(lr=2e-3, lambda_coef=0.01), batches, model,
                       utils={"grad_norm_clip": False})
    _assert_close(got, expected)


@pytest.mark.parametrize("setup", SETUPS)
def test_adam_after_weight_update_matches_hugging_face_adamw(setup):
    lr, a, b, eps, decay = 2e-3, 0.9, 0.999, 1e-8, 0.05

    def update(key, w, g, t, state):
        m, v = state.get(key, (0.0, 0.0))
        m, v = a * m + (1 - a) * g, b * v + (1 - b) * g * g
        state[key] = (m, v)
        step = lr * math.sqrt(1 - b ** t) / (1 - a ** t)
        w = w - step * m / (np.sqrt(v) + eps)
        return w - lr * decay * w

    model, batches = SETUPS[setup][0](), _batches(setup, 23)
    expected = _numpy_reference(setup, clone(model), batches, update, clip=1.0)
    config = AdamConfig(lr=lr, lambda_coef=decay, weight_decay_mode=DecayMode.AFTER_WEIGHT_UPDATE)
    _assert_close(_ort_weights(setup, config, batches, model), expected)


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("bias_correction", [False, True])
def test_lamb_matches_the_formula(setup, bias_correction):
    lr, a, b, eps, decay, r_min, r_max = 2e-3, 0.9, 0.999, 1e-6, 0.01, 0.05, 5.0

    def update(key, w, g, t, state):
        m, v = state.get(key, (0.0, 0.0))
        m, v = a * m + (1 - a) * g, b * v + (1 - b) * g * g
        state[key] = (m, v)
        c1, c2 = (1 - a ** t, 1 - b ** t) if bias_correction else (1.0, 1.0)
        d = (m / c1) / (np.sqrt(v / c2) + eps) + decay * w
        wn, dn = np.linalg.norm(w), np.linalg.norm(d)
        r = min(max(wn / dn, r_min), r_max) if wn > 0 and dn > 0 else 1.0
        return w - lr * r * d

    model, batches = SETUPS[setup][0](), _batches(setup, 24)
    expected = _numpy_reference(setup, clone(model), batches, update, clip=1.0)
    config = LambConfig(lr=lr, lambda_coef=decay, ratio_min=r_min, ratio_max=r_max, do_bias_correction=bias_correction)
    _assert_close(_ort_weights(setup, config, batches, model), expected)


def test_lamb_trust_ratio_is_one_when_a_norm_is_zero():
    """A zero-initialised bias has ||w|| = 0 on the first step: r = 1, so w = -lr * d."""
    model = MLP()
    with torch.no_grad():
        model.fc2.bias.zero_()
    batch = _batches("mlp", 25, n=1)
    got = _ort_weights("mlp", LambConfig(lr=0.1, ratio_min=0.5, ratio_max=0.5), batch, model,
                       utils={"grad_norm_clip": False})
    reference = clone(model)
    CE(reference(batch[0][0]), batch[0][1]).backward()
    g = reference.fc2.bias.grad.numpy().astype(np.float64)
    d = (0.1 * g) / (np.sqrt(0.001 * g * g) + 1e-6)  # m = (1-a) g, v = (1-b) g^2, no bias correction
    np.testing.assert_allclose(got["fc2.bias"], -0.1 * d, rtol=FIRST_STEP_RTOL)


def test_parameter_groups_match_torch_param_groups():
    model, batches = MLP(), _batches("mlp", 26)
    reference = clone(model)
    config = AdamConfig(
        lr=1e-2, lambda_coef=0.1,
        params=[{"params": ["fc1.bias", "fc2.bias"], "lambda_coef": 0.0}, {"params": ["fc2.weight"], "lr": 3e-2}],
    )
    got = _ort_weights("mlp", config, batches, model)
    expected = _torch_weights("mlp", reference, lambda m: torch.optim.AdamW([
        {"params": [m.fc1.weight], "weight_decay": 0.1},
        {"params": [m.fc1.bias, m.fc2.bias], "weight_decay": 0.0},
        {"params": [m.fc2.weight], "weight_decay": 0.1, "lr": 3e-2},
    ], lr=1e-2), batches, clip=1.0)
    _assert_close(got, expected)


def test_transformer_no_decay_group_for_biases_and_layernorm():
    model, batches = TinyEncoder(), _batches("transformer", 27)
    reference = clone(model)  # first: on the CPU the trainer trains the module's own parameters
    no_decay = [n for n, _ in model.named_parameters() if n.endswith("bias") or "norm" in n]
    config = AdamConfig(lr=2e-3, lambda_coef=0.05, params=[{"params": no_decay, "lambda_coef": 0.0}])
    got = _ort_weights("transformer", config, batches, model, utils={"grad_norm_clip": False})

    def factory(m):
        named = dict(m.named_parameters())
        return torch.optim.AdamW([
            {"params": [p for n, p in named.items() if n not in no_decay], "weight_decay": 0.05},
            {"params": [named[n] for n in no_decay], "weight_decay": 0.0},
        ], lr=2e-3)

    _assert_close(got, _torch_weights("transformer", reference, factory, batches, clip=None))


def test_frozen_weights_never_change():
    model, batches = MLP(), _batches("mlp", 28)
    reference = clone(model)
    reference.fc1.weight.requires_grad_(False)
    initial = model.fc1.weight.detach().clone()
    got = _ort_weights("mlp", AdamConfig(lr=1e-2), batches, model, utils={"frozen_weights": ["fc1.weight"]})
    np.testing.assert_array_equal(got["fc1.weight"], initial.numpy())
    expected = _torch_weights("mlp", reference, lambda m: torch.optim.AdamW(
        [p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0), batches, clip=1.0)
    _assert_close(got, expected)


@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_gradient_clipping_uses_max_norm_clip(max_norm):
    model, batches = MLP(), _batches("mlp", 29)
    expected = _torch_weights("mlp", clone(model), lambda m: torch.optim.AdamW(
        m.parameters(), lr=1e-2, weight_decay=0.0), batches, clip=max_norm)
    _assert_close(_ort_weights("mlp", AdamConfig(lr=1e-2, max_norm_clip=max_norm), batches, model), expected)


def test_scheduler_learning_rate_reaches_the_graph_each_step():
    model, batches = MLP(), _batches("mlp", 30, n=10)
    reference = clone(model)
    scheduler = LinearWarmupLRScheduler(total_steps=10, warmup=0.3)
    trainer = ORTTrainer(model, MLP_DESC, SGDConfig(lr=0.2), loss_fn=CE, options={"lr_scheduler": scheduler})
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    torch_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: scheduler.get_lr_at(s, 1.0))
    for step, (x, y) in enumerate(batches):
        loss = trainer.train_step(x, y)[0].item()
        assert scheduler.get_last_lr() == [pytest.approx(0.2 * scheduler.get_lr_at(step, 1.0), rel=LR_RTOL, abs=0)]
        assert loss == pytest.approx(torch_step(reference, optimizer, CE, (x,), y, clip=None), rel=LOSS_RTOL)
        torch_scheduler.step()
    got = trainer.state_dict(pytorch_format=True)
    _assert_close({k: v.numpy() for k, v in got.items()}, {k: v.numpy() for k, v in reference.state_dict().items()})


def test_group_lr_is_scaled_by_the_scheduler():
    model, batches = MLP(), _batches("mlp", 31, n=6)
    reference = clone(model)
    scheduler = LinearWarmupLRScheduler(total_steps=6, warmup=0.5)
    config = SGDConfig(lr=0.1, params=[{"params": ["fc2.weight", "fc2.bias"], "lr": 0.3}])
    trainer = ORTTrainer(model, MLP_DESC, config, loss_fn=CE, options={"lr_scheduler": scheduler})
    optimizer = torch.optim.SGD([{"params": reference.fc1.parameters()},
                                 {"params": reference.fc2.parameters(), "lr": 0.3}], lr=0.1)
    torch_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: scheduler.get_lr_at(s, 1.0))
    for x, y in batches:
        trainer.train_step(x, y)
        torch_step(reference, optimizer, CE, (x,), y, clip=None)
        torch_scheduler.step()
    got = trainer.state_dict(pytorch_format=True)
    _assert_close({k: v.numpy() for k, v in got.items()}, {k: v.numpy() for k, v in reference.state_dict().items()})
