"""The ``half_precision_gelu`` switch of the ``gelu`` pass (``graph/gradient/gelu.py``): under mixed
precision, a float16 or bfloat16 GELU's forward and backward computed together in its own dtype instead
of its backward in float32 after casts (which recomputes the forward there in float32).

Checked against float64 PyTorch: one float16 step of a tiny GPT-2 (tanh GELU) and of TinyEncoder
(``F.gelu``, erf), loss and every gradient, the switch on and off; the derivative itself element by
element on a grid of inputs from -600 to 600 (the tanh form's float16 saturation and overflow
thresholds included); the graph (no float32 GELU left); bfloat16 for types only (the CPU has no
bfloat16 kernels); float32 training untouched.
"""

import copy
import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.amp.kernels import MissingKernelError
from ort_trainer.optim import SGDConfig

from models import assert_float32_untouched
from test_half_loss import _encoder_case, _float64, _gpt2_case, _relative
from tolerances import FLOAT16, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# float16 training against float64 PyTorch, relative to each tensor's norm: the tiny models' longest chain
# of float16 roundings, ~40 (tests/test_half_loss.py's HALF_BOUND, derived there): 40·u16 = 2.0e-2. The
# switch computes the GELU's forward in 6 float16 operations instead of torch's 9 (tanh) or the same 5
# (erf), and its derivative in 7 float16 ones instead of float32 arithmetic rounded once: ~8·u16 more on
# the GELU's input gradient, inside that bound. On against off: those ~8 roundings, carried through the
# rest of the backward (~30 more): 40·u16 again.
HALF_BOUND = 40 * FLOAT16
ON_OFF_BOUND = 40 * FLOAT16
# The derivative alone, element by element, from x in float16 (each operation rounded to float16 once, as
# ONNX Runtime's CUDA kernels and ONNX's reference evaluator in NumPy float16 do; its CPU kernels widen some to
# float32): each of the ≤ 10 operations between x and the result rounds once, so the error is at most ~10·u16
# times the magnitudes of the terms summed — s and the spread term (tanh), 1, erf and the exponential term
# (erf, Φ = (1 + erf)/2: its cancellation for negative x) — plus, for tanh, the rounding of s near 1 (up to
# one ulp, 2^-11, where a float16 sigmoid rounds 1 + exp(-u) first) multiplied by y·(B + 3t), and an absolute
# 2^-14 (float16 subnormals; exp(a²) overflows from |x| = 4.71 on, where a·exp(-a²)/√π < 2.9e-5 becomes 0).
# Bound: 16·u16 · magnitude + 2·|y|·(B + 3t)·min(1 - s, 2^-11) + 2^-14.
DERIVATIVE_BOUND = 16 * FLOAT16
SUBNORMAL = 2.0 ** -14
# the tanh form in float16 stays finite while B + 3·A·x² does: |x| < 553 (eager's GELU written out in
# Python overflows pow(x, 3) from 40 and its gradient from 256)
TANH_FINITE = 553.0


def _options(on: bool, dtype: str = "float16") -> dict:
    # a fixed loss scale of 1: the gradients compared are the unscaled ones, and no step is skipped
    scaler = DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6) if dtype == "float16" else None
    return {"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
            "mixed_precision": {"enabled": True, "dtype": dtype, "loss_scaler": scaler},
            "graph_optimizations": {"half_precision_gelu": on}}


def _step(model, desc, batch, on: bool, loss_fn=None):
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), loss_fn=loss_fn, options=_options(on))
    outputs = trainer.train_step(*batch)
    loss = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    return trainer, float(loss), {w: g.numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}


def _gelu_types(model: onnx.ModelProto) -> list[int]:
    """The element types of what the GELUs' transcendental nodes write (``Sigmoid``: the tanh form as the
    gelu pass writes it; ``Tanh``: torch's; ``Erf`` or the exporter's function around it)."""
    types = {v.name: v.type.tensor_type.elem_type
             for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    return [types.get(n.output[0]) for n in model.graph.node
            if n.op_type in ("Sigmoid", "Tanh", "Erf") or "erf" in n.op_type.lower()]


@pytest.mark.parametrize("case", ["gpt2", "encoder"])
def test_float16_gelu_within_float16_rounding_of_float64(case, record_property):
    """One float16 step, the switch on and off: the loss and every gradient within HALF_BOUND of float64
    PyTorch's, on against off within ON_OFF_BOUND. On, every GELU node is float16 (off, the backward's
    recomputation is float32)."""
    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    loss64, grads64 = _float64(model, batch, loss_fn)
    results, errors = {}, {}
    for on in (True, False):
        trainer, value, grads = _step(model, desc, batch, on, loss_fn)
        results[on] = (value, grads)
        errors[on] = {"loss": abs(value - loss64) / abs(loss64),
                      **{name: _relative(grads[name], grad) for name, grad in grads64.items()}}
        for name, error in errors[on].items():
            check(error, HALF_BOUND, (on, name))
        types = _gelu_types(trainer._graphs.gradient)
        assert types and TensorProto.FLOAT16 in types, types
        assert (TensorProto.FLOAT in types) != on, types
    on_off = {name: _relative(results[True][1][name], grad) for name, grad in results[False][1].items()}
    for name, error in on_off.items():
        check(error, ON_OFF_BOUND, ("on/off", name))
    record_property("errors", {**{on: max(e.values()) for on, e in errors.items()}, "on/off": max(on_off.values())})


class _Activation(torch.nn.Module):
    """``loss = sum(gelu(w · 1))``: the weight's gradient is the GELU's derivative at each of its values,
    in float16 under autocast (a float16 product, the GELU, a float32 sum)."""

    def __init__(self, points: torch.Tensor, approximate: str):
        super().__init__()
        self.linear = torch.nn.Linear(1, points.numel(), bias=False)
        self.approximate = approximate
        with torch.no_grad():
            self.linear.weight.copy_(points.reshape(-1, 1))

    def forward(self, x):
        return F.gelu(self.linear(x), approximate=self.approximate).float().sum()


def _derivative64(x: np.ndarray, approximate: str) -> tuple[np.ndarray, np.ndarray]:
    """(GELU's derivative at x, DERIVATIVE_BOUND's bound on its float16 error), in float64."""
    if approximate == "tanh":
        a, b = 2 * math.sqrt(2 / math.pi) * 0.044715, 2 * math.sqrt(2 / math.pi)
        s = 0.5 * (1 + np.tanh(0.5 * x * (b + a * x * x)))
        slope = b + 3 * a * x * x
        spread = x * s * (1 - s) * slope
        near_one = 2 * np.abs(x * s) * slope * np.minimum(1 - s, 2.0 ** -11)
        return s + spread, DERIVATIVE_BOUND * (np.abs(s) + np.abs(spread)) + near_one + SUBNORMAL
    erf = np.vectorize(math.erf)(x / math.sqrt(2))
    term = x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    return 0.5 * (1 + erf) + term, DERIVATIVE_BOUND * (1 + np.abs(erf) + np.abs(term)) + SUBNORMAL


def _reference(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    """The weight's gradient from ONNX's reference evaluator (its float16 overflows past 553 are expected)."""
    from onnx.reference import ReferenceEvaluator

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return ReferenceEvaluator(model).run(None, feeds)[1]


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_the_float16_derivative_against_float64_from_minus_600_to_600(approximate, record_property):
    """The derivative element by element at 2401 float16 points from -600 to 600 (dense near 0), from ONNX
    Runtime and from ONNX's reference evaluator on the same gradient graph (NumPy float16: every operation
    rounded to float16): within DERIVATIVE_BOUND of float64 where the float16 arithmetic is finite
    (everywhere for erf; |x| < 553 for tanh, where eager's Python GELU overflows from 256 on), and 1 or 0
    where the GELU has saturated."""
    grid = np.concatenate([np.linspace(-8, 8, 1601), np.linspace(-600, 600, 800)])
    points = torch.tensor(grid, dtype=torch.float32).half().float()  # what the float16 product gives
    model = _Activation(points, approximate)
    desc = {"inputs": [("x", [1, 1])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, SGDConfig(lr=0.0), options=_options(True))
    trainer.train_step(torch.ones(1, 1))
    gradient = trainer._graphs.gradient
    assert TensorProto.FLOAT not in _gelu_types(gradient)
    feeds = {"x": np.ones((1, 1), np.float32), "linear.weight": points.numpy().reshape(-1, 1),
             "__loss_scale": np.array(1.0, np.float32)}
    assert {i.name for i in gradient.graph.input} == set(feeds)
    results = {"onnxruntime": trainer._engine.grads["linear.weight"].numpy(),
               "reference": _reference(gradient, feeds)}
    x = points.numpy().astype(np.float64)
    exact, bound = _derivative64(x, approximate)
    finite = np.abs(x) < TANH_FINITE if approximate == "tanh" else np.ones_like(x, bool)
    saturated = finite & (np.abs(x) > 12)
    worst = {}
    for name, values in results.items():
        got = values.reshape(-1).astype(np.float64)
        assert np.isfinite(got[finite]).all(), (name, x[finite & ~np.isfinite(got)])
        error = np.abs(got - exact)
        bad = finite & (error > bound)
        assert not bad.any(), (name, list(zip(x[bad], got[bad], exact[bad])))
        assert (np.abs(got[saturated] - (x[saturated] > 0)) <= SUBNORMAL).all(), name
        worst[name] = float((error / bound)[finite].max())
    record_property("worst", worst)


def test_bfloat16_gelu_is_bfloat16():
    """bfloat16 (types only: the CPU has no bfloat16 kernels, the graph is built and the session refused):
    on, every GELU node is bfloat16; off, the backward's are float32."""
    model, desc, batch, _ = _gpt2_case()
    for on in (True, False):
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), options=_options(on, "bfloat16"))
        with pytest.raises(MissingKernelError):
            trainer.train_step(*batch)
        types = _gelu_types(trainer._graphs.gradient)
        assert TensorProto.BFLOAT16 in types and (TensorProto.FLOAT in types) != on, types
        assert TensorProto.FLOAT16 not in types


def test_the_switch_leaves_float32_training_bit_equal():
    model, desc, batch, loss_fn = _encoder_case()
    assert_float32_untouched(model, desc, batch, "half_precision_gelu", loss_fn)
