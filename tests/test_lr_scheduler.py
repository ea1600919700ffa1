"""Each warmup scheduler against its api.md formula at the interesting points."""

import math

import pytest

from ort_trainer.optim.lr_scheduler import (ConstantWarmupLRScheduler, CosineWarmupLRScheduler, LinearWarmupLRScheduler,
                                            PolyWarmupLRScheduler)
from tolerances import FLOAT64

LR, T, WARMUP = 0.5, 100, 0.2
W = WARMUP * T  # 20 warmup steps
POINTS = [0, 10, 20, 60, 150]  # start, mid-warmup, end of warmup, mid-way, past total_steps
# The schedulers against the formulas below, and against the spot values: float64 on both sides.
# Each side rounds at most 10 times (u64 = 2^-53 each: the progress p, 2π·cycles·p, 1 + cos, · 0.5,
# · LR, the power, + lr_end, ...), and math.cos passes on the absolute rounding of its angle (at
# most 2π·2·1.625 = 20.4 here, ≤ 4 roundings: ≤ 82·u64) into 1 + cos, which is about 1 or more at
# these points: at most 2·(10 + 82)·u64 < 2^8·u64 = 2.8e-14 relative. Where a value is 0 it is 0
# on both sides (0·x, max(0, ·)), so no absolute tolerance. Observed at 1 and 2 threads: 0 (the
# same float64 expression in the same order; the spot values are exact binary fractions).
LR_RTOL = 2 ** 8 * FLOAT64


def _warmup(s):
    return LR * s / max(1, W)


def constant(s):
    return _warmup(s) if s < W else LR


def cosine(s, cycles=0.5):
    if s < W:
        return _warmup(s)
    p = (s - W) / max(1, T - W)
    return LR * max(0.0, 0.5 * (1 + math.cos(2 * math.pi * cycles * p)))


def linear(s):
    return _warmup(s) if s < W else LR * max(0.0, (T - s) / max(1, T - W))


def poly(s, lr_end=1e-4, power=2.0):
    if s < W:
        return _warmup(s)
    if s > T:
        return lr_end
    return (LR - lr_end) * (1 - (s - W) / max(1, T - W)) ** power + lr_end


@pytest.mark.parametrize("scheduler, formula", [
    (ConstantWarmupLRScheduler(T, WARMUP), constant),
    (CosineWarmupLRScheduler(T, 0.5, WARMUP), cosine),
    (CosineWarmupLRScheduler(T, 2.0, WARMUP), lambda s: cosine(s, cycles=2.0)),
    (LinearWarmupLRScheduler(T, WARMUP), linear),
    (PolyWarmupLRScheduler(T, 1e-4, 2.0, WARMUP), poly),
], ids=["constant", "cosine", "cosine-2-cycles", "linear", "poly"])
@pytest.mark.parametrize("step", POINTS)
def test_scheduler_matches_formula(scheduler, formula, step):
    assert scheduler._step(step, LR) == pytest.approx(formula(step), rel=LR_RTOL, abs=0)
    assert scheduler.get_last_lr() == [pytest.approx(formula(step), rel=LR_RTOL, abs=0)]


def test_values_at_the_points():
    """Spot values, written out, so a formula slip in both places is still caught."""
    assert [LinearWarmupLRScheduler(T, WARMUP).get_lr_at(s, LR) for s in POINTS] == pytest.approx(
        [0.0, 0.25, 0.5, 0.25, 0.0], rel=LR_RTOL, abs=0)
    assert CosineWarmupLRScheduler(T, warmup=WARMUP).get_lr_at(60, LR) == pytest.approx(0.25, rel=LR_RTOL, abs=0)
    assert PolyWarmupLRScheduler(T, lr_end=0.0, power=1.0, warmup=WARMUP).get_lr_at(60, LR) == pytest.approx(
        0.25, rel=LR_RTOL, abs=0)
    assert PolyWarmupLRScheduler(T, lr_end=1e-3, warmup=WARMUP).get_lr_at(101, LR) == 1e-3


def test_defaults_and_argument_order():
    cosine_default = CosineWarmupLRScheduler(1000)
    assert (cosine_default.cycles, cosine_default.warmup) == (0.5, 0.002)
    poly_default = PolyWarmupLRScheduler(1000)
    assert (poly_default.lr_end, poly_default.power, poly_default.warmup) == (1e-7, 1.0, 0.002)
    assert ConstantWarmupLRScheduler(1000).warmup == 0.002
    assert LinearWarmupLRScheduler(1000, 0.1).warmup == 0.1
    assert ConstantWarmupLRScheduler(10).get_last_lr() == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="LinearWarmupLRScheduler.total_steps: expected a positive int, got 0"):
        LinearWarmupLRScheduler(0)
    with pytest.raises(ValueError, match=r"CosineWarmupLRScheduler.warmup: expected a float in \[0, 1\], got 2"):
        CosineWarmupLRScheduler(10, warmup=2)
