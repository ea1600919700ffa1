"""Gradient accumulation, the all-finite gate and loss scaling (api.md sections 3 and 7)."""

import numpy as np
import pytest
import torch

from models import MLP, MLP_DESC, clone, mlp_batch
from ort_trainer import ORTTrainer
from ort_trainer.amp import DynamicLossScaler, LossScaler
from ort_trainer.optim import AdamConfig, LambConfig
from tolerances import FLOAT32, check, steps_bound

CE = torch.nn.functional.cross_entropy
# A micro-batch's loss from the trainer against torch's loss of the same float32 weights: one
# forward in another implementation, its sums (≤ 64 terms) in another order: at most 64·u apart
# (steps_bound(1) = 3.8e-6). Observed at 1 and 2 threads: 1.0e-7, 37x under.
FORWARD_RTOL = steps_bound(1)
# 10 steps of 4 accumulated micro-batches of 8 against 10 steps of one batch of 32: each weight
# gradient sums the same 32 rows, at once or as 4 sums of 8 added up (the 1/8 means and the
# 1/4 of the window, against 1/32, are exact powers of two), forwards of 8 rows against 32: at most
# 64·u apart per step, carried through the weights: steps_bound(10) = 3.8e-5 at worst. The test
# holds the tighter 1e-5. Observed at 1 and 2 threads: 5.9e-8, 169x under.
ACCUMULATION_BOUND = 1e-5
# Loss scale 2^8 in float32 against none: scaling by a power of two commutes with float32 rounding,
# so the scaled gradients are 2^8 times the plain ones bit for bit, and so are their sum of squares
# (2^16) and norm (2^8); the unscaling 1/2^8 is exact. They differ only where a gradient is
# subnormal (below 2^-126), which moves its weight by less than lr · 2^-126 / ε ≈ 1e-32 under Adam:
# the weights are equal to well within one unit roundoff u. Observed at 1 and 2 threads: 0 (equal).
LOSS_SCALE_BOUND = FLOAT32


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


@pytest.mark.parametrize("config", [AdamConfig(lr=1e-2, lambda_coef=0.01), LambConfig(lr=1e-2)],
                         ids=["adam", "lamb"])
def test_four_micro_batches_equal_one_big_batch(config):
    model = MLP()
    accumulating = ORTTrainer(model, MLP_DESC, config, loss_fn=CE,
                              options={"batch": {"gradient_accumulation_steps": 4}})
    big = ORTTrainer(clone(model), MLP_DESC, config, loss_fn=CE)
    gen = torch.Generator().manual_seed(40)
    for _ in range(10):
        x, y = mlp_batch(gen, batch=32)
        big.train_step(x, y)
        for part in range(4):
            xs, ys = x[8 * part:8 * part + 8], y[8 * part:8 * part + 8]
            expected_loss = CE(_eval(accumulating, xs), ys).item()
            loss = accumulating.train_step(xs, ys)[0]
            assert loss.item() == pytest.approx(expected_loss, rel=FORWARD_RTOL)  # the micro-batch's own loss
    info = accumulating._train_step_info
    assert (info.step, info.optimization_step) == (40, 10)
    got = accumulating.state_dict()["model"]["full_precision"]
    expected = big.state_dict()["model"]["full_precision"]
    for name in expected:
        check(_rel(got[name], expected[name]), ACCUMULATION_BOUND, name)


def _eval(trainer, x):
    """Logits of the trainer's current weights, via a torch copy of the model."""
    model = MLP()
    model.load_state_dict(trainer.state_dict(pytorch_format=True))
    with torch.no_grad():
        return model(x)


def test_no_update_between_boundaries():
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE,
                         options={"batch": {"gradient_accumulation_steps": 3}})
    gen = torch.Generator().manual_seed(41)
    initial = trainer.state_dict()["model"]["full_precision"]
    for _ in range(2):
        trainer.train_step(*mlp_batch(gen))
        now = trainer.state_dict()["model"]["full_precision"]
        for name, value in initial.items():
            np.testing.assert_array_equal(now[name], value)
    assert trainer._train_step_info.optimization_step == 0
    trainer.train_step(*mlp_batch(gen))
    assert trainer._train_step_info.optimization_step == 1
    assert not np.array_equal(trainer.state_dict()["model"]["full_precision"]["fc1.weight"], initial["fc1.weight"])


def test_non_finite_batch_is_skipped_and_the_scaler_halves():
    scaler = DynamicLossScaler(loss_scale=2.0 ** 10)
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE,
                         options={"mixed_precision": {"loss_scaler": scaler}})
    gen = torch.Generator().manual_seed(42)
    trainer.train_step(*mlp_batch(gen))
    before = trainer.state_dict()
    x, y = mlp_batch(gen)
    x[3, 5] = float("inf")
    trainer.train_step(x, y)
    info = trainer._train_step_info
    assert info.all_finite is False and (info.step, info.optimization_step) == (2, 1)
    assert scaler.loss_scale == 2.0 ** 9
    after = trainer.state_dict()
    for name, value in before["model"]["full_precision"].items():
        np.testing.assert_array_equal(after["model"]["full_precision"][name], value)
        for moment in ("Moment_1", "Moment_2"):
            np.testing.assert_array_equal(after["optimizer"][name][moment], before["optimizer"][name][moment])
    losses = [trainer.train_step(*mlp_batch(gen))[0].item() for _ in range(20)]
    assert info.all_finite is True and info.optimization_step == 21
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < np.mean(losses[:5])


def test_nan_without_a_scaler_is_skipped_too():
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    gen = torch.Generator().manual_seed(43)
    trainer.train_step(*mlp_batch(gen))
    before = trainer.state_dict()["model"]["full_precision"]
    x, y = mlp_batch(gen)
    x[0, 0] = float("nan")
    trainer.train_step(x, y)
    assert trainer._train_step_info.all_finite is False
    for name, value in trainer.state_dict()["model"]["full_precision"].items():
        np.testing.assert_array_equal(value, before[name])


def test_fp32_loss_scaling_gives_the_same_weights_as_none():
    model = MLP()
    scaled = ORTTrainer(model, MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE,
                        options={"mixed_precision": {"loss_scaler": DynamicLossScaler(loss_scale=2.0 ** 8)}})
    plain = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=CE)
    gen = torch.Generator().manual_seed(44)
    for _ in range(10):
        batch = mlp_batch(gen)
        assert scaled.train_step(*batch)[0].item() == plain.train_step(*batch)[0].item()  # loss is unscaled
    got, expected = scaled.state_dict()["model"]["full_precision"], plain.state_dict()["model"]["full_precision"]
    for name in expected:
        check(_rel(got[name], expected[name]), LOSS_SCALE_BOUND, name)


def test_dynamic_loss_scaler_sequence():
    class Info:
        all_finite = True

    scaler = DynamicLossScaler(loss_scale=2.0 ** 20, up_scale_window=2000, min_loss_scale=4.0,
                               max_loss_scale=2.0 ** 21)
    info = Info()
    for _ in range(1999):
        assert scaler.update(info) == 2.0 ** 20
    assert scaler.update(info) == 2.0 ** 21  # 2000 finite updates double the scale
    for _ in range(2000):
        scaler.update(info)
    assert scaler.loss_scale == 2.0 ** 21  # capped at the max
    info.all_finite = False
    assert scaler.update(info) == 2.0 ** 20  # overflow halves
    for _ in range(30):
        scaler.update(info)
    assert scaler.loss_scale == 4.0  # floored at the min
    info.all_finite = True
    for _ in range(1999):
        scaler.update(info)
    assert scaler.loss_scale == 4.0  # the counter restarted at the overflow
    scaler.reset()
    assert scaler.loss_scale == 2.0 ** 20
    fixed = DynamicLossScaler(automatic_update=False, loss_scale=8.0)
    info.all_finite = False
    assert fixed.update(info) == 8.0


def test_custom_loss_scaler_subclass_is_used():
    class Halving(LossScaler):
        def update(self, train_step_info):
            self.loss_scale /= 2
            return self.loss_scale

    scaler = Halving(64.0)
    trainer = ORTTrainer(MLP(), MLP_DESC, AdamConfig(), loss_fn=CE,
                         options={"mixed_precision": {"loss_scaler": scaler}})
    gen = torch.Generator().manual_seed(45)
    for _ in range(3):
        trainer.train_step(*mlp_batch(gen))
    assert scaler.loss_scale == 8.0  # the trainer updates the user's object once per optimizer step


def test_train_step_info_defaults():
    from ort_trainer import TrainStepInfo

    config = AdamConfig()
    info = TrainStepInfo(config)
    assert (info.optimizer_config, info.all_finite, info.fetches, info.optimization_step, info.step) == (
        config, True, [], 0, 0)
