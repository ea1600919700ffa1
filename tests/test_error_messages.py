"""Errors of the schedulers, loss scalers and the collective timeout: every problem, with the fix."""

import numpy as np
import pytest

from ort_trainer.amp import DynamicLossScaler
from ort_trainer.optim.lr_scheduler import CosineWarmupLRScheduler, LinearWarmupLRScheduler, PolyWarmupLRScheduler


def test_a_scheduler_lists_every_bad_argument():
    with pytest.raises(ValueError) as info:
        CosineWarmupLRScheduler(total_steps=0, cycles=-1, warmup=2)
    assert str(info.value).splitlines() == [
        "invalid CosineWarmupLRScheduler:",
        "  CosineWarmupLRScheduler.total_steps: expected a positive int, got 0",
        "  CosineWarmupLRScheduler.warmup: expected a float in [0, 1], got 2",
        "  CosineWarmupLRScheduler.cycles: expected a float >= 0, got -1",
    ]
    with pytest.raises(ValueError) as info:
        PolyWarmupLRScheduler(total_steps=10, lr_end=float("nan"), power="2")
    assert "PolyWarmupLRScheduler.lr_end: expected a float >= 0, got nan" in str(info.value)
    assert "PolyWarmupLRScheduler.power: expected a finite float, got '2'" in str(info.value)


def test_a_scheduler_refuses_a_state_that_is_not_its_own_and_keeps_its_state():
    scheduler = LinearWarmupLRScheduler(total_steps=10)
    scheduler.load_state_dict({"last_lr": np.array([0.25]), "base_lr": np.float64(0.5)})  # as a checkpoint holds it
    assert scheduler.state_dict() == {"last_lr": [0.25], "base_lr": 0.5}
    with pytest.raises(ValueError) as info:
        scheduler.load_state_dict({"last_lr": "0.1", "base_lr": [1], "step": 3})
    message = str(info.value)
    assert "LinearWarmupLRScheduler.load_state_dict: not a scheduler state" in message
    assert "'step': unknown key; expected 'last_lr' and 'base_lr'" in message
    assert "'last_lr': expected a list of finite numbers, got '0.1'" in message
    assert "'base_lr': expected a finite number or None, got [1]" in message
    with pytest.raises(ValueError, match="expected a dict with 'last_lr' and 'base_lr', got int"):
        scheduler.load_state_dict(3)
    assert scheduler.state_dict() == {"last_lr": [0.25], "base_lr": 0.5}


def test_a_loss_scaler_lists_every_bad_argument_and_refuses_a_bad_state():
    with pytest.raises(ValueError) as info:
        DynamicLossScaler(loss_scale=-1, up_scale_window=0, min_loss_scale=float("inf"), automatic_update="yes")
    assert str(info.value).splitlines()[1:] == [
        "  DynamicLossScaler.loss_scale: expected a positive number, got -1",
        "  DynamicLossScaler.up_scale_window: expected a positive int, got 0",
        "  DynamicLossScaler.min_loss_scale: expected a positive number, got inf",
        "  DynamicLossScaler.automatic_update: expected a bool, got 'yes'",
    ]
    scaler = DynamicLossScaler(loss_scale=8.0)
    with pytest.raises(ValueError) as info:
        scaler.load_state_dict({"loss_scale": float("nan"), "stable_steps": -2})
    assert "'loss_scale': expected a positive number, got nan" in str(info.value)
    assert "'stable_steps': expected an int >= 0, got -2" in str(info.value)
    assert scaler.state_dict() == {"loss_scale": 8.0, "stable_steps": 0}  # unchanged


def test_the_collective_timeout_comes_from_the_environment(monkeypatch):
    from ort_trainer.comm.base import collective_timeout

    monkeypatch.delenv("ORT_TRAINER_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout() == 600.0
    monkeypatch.setenv("ORT_TRAINER_COLLECTIVE_TIMEOUT", "12.5")
    assert collective_timeout() == 12.5
    for bad in ("0", "-3", "nan", "ten"):
        monkeypatch.setenv("ORT_TRAINER_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"ORT_TRAINER_COLLECTIVE_TIMEOUT='{bad}': expected a positive number"):
            collective_timeout()
