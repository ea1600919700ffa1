"""Stage 4: the optimizer graph — clipping, the all-finite gate and the SGD/Adam/Lamb update.

The update is plain ONNX arithmetic, so every hyper-parameter can differ per parameter group and
the formulas are exactly those of api.md section 4. Inputs per trained weight ``w``: ``w``,
``w_grad`` and its optimizer states (``w.Moment_1``, ``w.Moment_2``); shared inputs: one
learning rate per group (``lr.group<i>``), ``step``, the 1-based update count ``t``, and
``grad_scale``, the factor that turns the buffered gradients into the averaged, unscaled
gradient (``1 / (loss_scale · accumulation_steps · ranks)``). Outputs: ``<input>.out`` for the
weight and each state, ``all_finite`` and ``global_gradient_norm`` (of the averaged gradient).

When any gradient is not finite, every output equals its input: the update is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..optim.config import AdamConfig, DecayMode, LambConfig, SGDConfig, _OptimizerConfig
from .gradient import GRAD_SUFFIX

OUT_SUFFIX = ".out"
STEP_INPUT = "step"
GRAD_SCALE_INPUT = "grad_scale"
ALL_FINITE = "all_finite"
GRAD_NORM = "global_gradient_norm"
# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing
_CLIP_EPS = 1e-6


def lr_input(group: int) -> str:
    """Name of the learning-rate input of parameter group ``group``."""
    return f"lr.group{group}"


def state_names(config: _OptimizerConfig) -> list[str]:
    """Per-weight optimizer state names of a config (``[]`` for SGD)."""
    return [] if isinstance(config, SGDConfig) else ["Moment_1", "Moment_2"]


@dataclass
class OptimizerPlan:
    """Which weights the optimizer updates, in which group, with which hyper-parameters."""

    weights: list[str]
    group_of: dict[str, int]
    groups: list[dict] = field(default_factory=list)  # resolved hyper-parameters, group 0 = defaults


def plan(config: _OptimizerConfig, weights: list[str], frozen: list[str], all_weights: list[str]) -> OptimizerPlan:
    """Assign each trained weight to its group; group 0 holds the config defaults.

    Raises:
        ValueError: when a group or ``frozen_weights`` names a weight the model does not have.
    """
    known = set(all_weights)
    problems = [f"utils.frozen_weights: {name!r} is not a weight of the model" for name in frozen if name not in known]
    group_of = {w: 0 for w in weights}
    groups = [config.group_hyperparameters(None)]
    for index, group in enumerate(config.params):
        for name in group["params"]:
            if name not in known:
                problems.append(f"{type(config).__name__}.params[{index}]: {name!r} is not a weight of the model")
            elif name in group_of:
                group_of[name] = index + 1
        groups.append(config.group_hyperparameters(index))
    if problems:
        hint = "known weights: " + ", ".join(sorted(known)[:20]) + (" ..." if len(known) > 20 else "")
        raise ValueError("invalid weight names:\n  " + "\n  ".join(problems) + "\n  " + hint)
    return OptimizerPlan(list(weights), group_of, groups)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self._count += 1
        out = f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value: float, dtype=np.float32) -> str:
        self._count += 1
        name = f"const_{self._count}"
        self.initializers.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def output(self, source: str, name: str) -> None:
        self.nodes.append(helper.make_node("Identity", [source], [name], name=f"{name}_identity"))


def build_optimizer_graph(
    config: _OptimizerConfig, opt_plan: OptimizerPlan, shapes: dict[str, list], clip: bool,
    norm_weights: list[str] | None = None,
) -> onnx.ModelProto:
    """Build the optimizer step for ``opt_plan.weights`` (all float32) as an ONNX model.

    Args:
        config: the optimizer configuration.
        opt_plan: the weights this graph updates, and their groups. Under ZeRO these may be
            pieces of weights (``"w[0:320]"``, 1-D), each with its own shape in ``shapes``.
        shapes: weight (or piece) name -> shape (symbolic-free).
        clip: clip the global gradient norm to ``config.max_norm_clip`` (ignored for SGD).
        norm_weights: weights whose gradients make up the global norm and the all-finite check
            (default: ``opt_plan.weights``). Under ZeRO a rank updates a shard of the weights but
            still reads every gradient, so clipping and skipping agree on all ranks.
    """
    norm_weights = list(opt_plan.weights if norm_weights is None else norm_weights)
    b = _Builder()
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(STEP_INPUT, f32, []), helper.make_tensor_value_info(GRAD_SCALE_INPUT, f32, [])]
    inputs += [helper.make_tensor_value_info(lr_input(g), f32, []) for g in range(len(opt_plan.groups))]
    outputs = []
    states = state_names(config)
    declared: set[str] = set()

    def declare(name: str, shape: list) -> None:
        if name not in declared:
            declared.add(name)
            inputs.append(helper.make_tensor_value_info(name, f32, shape))

    for w in norm_weights:
        declare(w + GRAD_SUFFIX, shapes[w])
    for w in opt_plan.weights:
        for name in [w, w + GRAD_SUFFIX, *(f"{w}.{s}" for s in states)]:
            declare(name, shapes[w])
    # Global norm and finiteness, from the raw buffers: grad_scale is folded into the norm and
    # into the one multiplier each gradient gets, so the scaling costs no extra pass.
    squares = [b.op("ReduceSumSquare", w + GRAD_SUFFIX, keepdims=0) for w in norm_weights]
    total = b.op("Sum", *squares) if len(squares) > 1 else squares[0]
    norm = b.op("Mul", b.op("Sqrt", total), GRAD_SCALE_INPUT)
    # NaN or inf in any gradient makes the sum of squares NaN or inf
    all_finite = b.op("Not", b.op("Or", b.op("IsNaN", norm), b.op("IsInf", norm)))
    b.output(norm, GRAD_NORM)
    b.output(all_finite, ALL_FINITE)
    outputs += [helper.make_tensor_value_info(GRAD_NORM, f32, []), helper.make_tensor_value_info(ALL_FINITE, TensorProto.BOOL, [])]

    scale = GRAD_SCALE_INPUT
    if clip and not isinstance(config, SGDConfig):
        ratio = b.op("Div", b.const(config.max_norm_clip), b.op("Add", norm, b.const(_CLIP_EPS)))
        scale = b.op("Mul", b.op("Min", ratio, b.const(1.0)), GRAD_SCALE_INPUT)

    group_scalars = [_group_scalars(b, config, hp, g) for g, hp in enumerate(opt_plan.groups)]
    for w in opt_plan.weights:
        g_index = opt_plan.group_of[w]
        grad = b.op("Mul", w + GRAD_SUFFIX, scale)
        new_values = _update(b, config, opt_plan.groups[g_index], group_scalars[g_index], w, grad)
        for name, new in zip([w, *(f"{w}.{s}" for s in states)], new_values):
            gated = b.op("Where", all_finite, new, name)
            b.output(gated, name + OUT_SUFFIX)
            outputs.append(helper.make_tensor_value_info(name + OUT_SUFFIX, f32, shapes[w]))

    graph = helper.make_graph(b.nodes, "ort_trainer_optimizer", inputs, outputs, b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="ort_trainer")
    model.ir_version = 8
    return model


def _group_scalars(b: _Builder, config: _OptimizerConfig, hp: dict, group: int) -> dict[str, str]:
    """Scalars shared by a group's weights: lr and the bias corrections."""
    scalars = {"lr": lr_input(group)}
    if isinstance(config, SGDConfig):
        return scalars
    if hp["do_bias_correction"]:
        scalars["c1"] = b.op("Sub", b.const(1.0), b.op("Pow", b.const(hp["alpha"]), STEP_INPUT))
        scalars["c2"] = b.op("Sub", b.const(1.0), b.op("Pow", b.const(hp["beta"]), STEP_INPUT))
    return scalars


def _moments(b: _Builder, hp: dict, w: str, grad: str) -> tuple[str, str]:
    m = b.op("Add", b.op("Mul", f"{w}.Moment_1", b.const(hp["alpha"])), b.op("Mul", grad, b.const(1.0 - hp["alpha"])))
    v = b.op(
        "Add",
        b.op("Mul", f"{w}.Moment_2", b.const(hp["beta"])),
        b.op("Mul", b.op("Mul", grad, grad), b.const(1.0 - hp["beta"])),
    )
    return m, v


def _update(b: _Builder, config: _OptimizerConfig, hp: dict, s: dict[str, str], w: str, grad: str) -> list[str]:
    lr = s["lr"]
    if isinstance(config, SGDConfig):
        return [b.op("Sub", w, b.op("Mul", grad, lr))]
    m, v = _moments(b, hp, w, grad)
    eps, decay = b.const(hp["epsilon"]), hp["lambda_coef"]
    if isinstance(config, AdamConfig):
        if hp["weight_decay_mode"] == DecayMode.BEFORE_WEIGHT_UPDATE:
            # torch.optim.AdamW's order of operations, for step-for-step parity
            sqrt_v = b.op("Sqrt", v)
            denom = b.op("Add", b.op("Div", sqrt_v, b.op("Sqrt", s["c2"])) if "c2" in s else sqrt_v, eps)
            step_size = b.op("Div", lr, s["c1"]) if "c1" in s else lr
            base = w
            if decay:
                base = b.op("Mul", w, b.op("Sub", b.const(1.0), b.op("Mul", lr, b.const(decay))))
            new_w = b.op("Sub", base, b.op("Mul", b.op("Div", m, denom), step_size))
        else:
            # Hugging Face's former AdamW: decay applied to the updated weight
            step_size = lr
            if "c1" in s:
                step_size = b.op("Div", b.op("Mul", lr, b.op("Sqrt", s["c2"])), s["c1"])
            moved = b.op("Sub", w, b.op("Mul", b.op("Div", m, b.op("Add", b.op("Sqrt", v), eps)), step_size))
            new_w = b.op("Sub", moved, b.op("Mul", moved, b.op("Mul", lr, b.const(decay)))) if decay else moved
        return [new_w, m, v]
    assert isinstance(config, LambConfig)
    m_hat = b.op("Div", m, s["c1"]) if "c1" in s else m
    v_hat = b.op("Div", v, s["c2"]) if "c2" in s else v
    direction = b.op("Div", m_hat, b.op("Add", b.op("Sqrt", v_hat), eps))
    if decay:
        direction = b.op("Add", direction, b.op("Mul", w, b.const(decay)))
    w_norm = b.op("Sqrt", b.op("ReduceSumSquare", w, keepdims=0))
    d_norm = b.op("Sqrt", b.op("ReduceSumSquare", direction, keepdims=0))
    zero = b.const(0.0)
    ratio = b.op("Div", w_norm, b.op("Max", d_norm, b.const(np.finfo(np.float32).tiny)))
    ratio = b.op("Min", b.op("Max", ratio, b.const(hp["ratio_min"])), b.const(hp["ratio_max"]))
    both_positive = b.op("And", b.op("Greater", w_norm, zero), b.op("Greater", d_norm, zero))
    ratio = b.op("Where", both_positive, ratio, b.const(1.0))
    new_w = b.op("Sub", w, b.op("Mul", direction, b.op("Mul", lr, ratio)))
    return [new_w, m, v]
