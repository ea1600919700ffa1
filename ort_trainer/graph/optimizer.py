"""Stage 4: the optimizer graph — clipping, the all-finite gate and the SGD/Adam/Lamb update.

The update is plain ONNX arithmetic, so every hyper-parameter can differ per parameter group and
the formulas are exactly those of api.md section 4.

The graph works on *segments*: 1-D views into the engine's flat buffers, where the trained
weights are laid out group by group (``layout_order``). With SGD and Adam a segment is a whole
run of same-group weights, so a model with a few hundred tensors is updated by a few dozen
elementwise nodes; Lamb needs per-tensor norms, so each of its segments is one tensor. Inputs:
``gradients`` (the whole flat gradient buffer, for the global norm), per segment ``<seg>``,
``<seg>_grad`` and its states ``<seg>.Moment_1``/``<seg>.Moment_2``; one learning rate per
group (``lr.group<i>``), ``step`` (the 1-based update count ``t``) and ``grad_scale`` (turns the
buffered gradients into the averaged, unscaled gradient: ``1 / (loss_scale · accumulation_steps ·
ranks)``). Outputs: ``<input>.out`` for each segment and state, ``all_finite`` and
``global_gradient_norm`` (of the averaged gradient), and ``weights_finite`` (every updated weight
is finite: false when, say, an overflowing learning rate made the update itself non-finite).

The graph always computes the update; the engine keeps it only when ``all_finite`` and
``weights_finite`` are true (it writes into the second set of buffers and simply does not swap to
them otherwise), so skipping a non-finite step costs nothing inside the graph. This graph is one of
the two implementations of the update (``ort_trainer/update.py``: ``GraphUpdate``); the other runs
torch's fused kernels in place where their formula is this one, and reuses ``CLIP_EPS`` and
``resolved_groups`` from here so both read the same definitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..optim.config import AdamConfig, DecayMode, LambConfig, SGDConfig, _OptimizerConfig
from .names import GRAD_SUFFIX

OUT_SUFFIX = ".out"
STEP_INPUT = "step"
GRADIENTS_INPUT = "gradients"
GRAD_SCALE_INPUT = "grad_scale"
ALL_FINITE = "all_finite"
WEIGHTS_FINITE = "weights_finite"
GRAD_NORM = "global_gradient_norm"
# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing
CLIP_EPS = 1e-6


def lr_input(group: int) -> str:
    """Name of the learning-rate input of parameter group ``group``."""
    return f"lr.group{group}"


def state_names(config: _OptimizerConfig) -> list[str]:
    """Per-weight optimizer state names of a config (SGD: its momentum buffer where it has one, else none)."""
    if isinstance(config, SGDConfig):
        return ["Momentum"] if config.has_momentum else []
    return ["Moment_1", "Moment_2"]


def resolved_groups(config: _OptimizerConfig) -> list[dict]:
    """The hyper-parameters of every parameter group, group 0 being the config's defaults."""
    return [config.group_hyperparameters(None)] + [config.group_hyperparameters(i) for i in range(len(config.params))]


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
    for index, group in enumerate(config.params):
        for name in group["params"]:
            if name not in known:
                problems.append(f"{type(config).__name__}.params[{index}]: {name!r} is not a weight of the model")
            elif name in group_of:
                group_of[name] = index + 1
    groups = resolved_groups(config)
    if problems:
        hint = "known weights: " + ", ".join(sorted(known)[:20]) + (" ..." if len(known) > 20 else "")
        raise ValueError("invalid weight names:\n  " + "\n  ".join(problems) + "\n  " + hint)
    return OptimizerPlan(list(weights), group_of, groups)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0
        self._renames: dict[str, str] = {}

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        """Add a node; returns its (unique) output name."""
        self._count += 1
        out = f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value: float, dtype=np.float32) -> str:
        """Add a constant initializer; returns its name."""
        self._count += 1
        name = f"const_{self._count}"
        self.initializers.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def output(self, source: str, name: str) -> None:
        """Make ``source`` a graph output called ``name`` (applied by ``finish``)."""
        self._renames[source] = name

    def finish(self) -> list[onnx.NodeProto]:
        """The nodes, with each output-producing node writing its graph output directly (no copy)."""
        for source, name in self._renames.items():
            producer = next((n for n in self.nodes if source in n.output), None)
            if producer is None:  # a graph input: copy it
                self.nodes.append(helper.make_node("Identity", [source], [name], name=f"{name}_identity"))
                continue
            producer.output[list(producer.output).index(source)] = name
            for node in self.nodes:
                for i, value in enumerate(node.input):
                    if value == source:
                        node.input[i] = name
        return self.nodes


@dataclass(frozen=True)
class Segment:
    """A contiguous range ``[start, stop)`` of the flat weight layout, updated with one group's settings."""

    name: str
    group: int
    start: int
    stop: int


def layout_order(trained: list[str], group_of: dict[str, int]) -> list[str]:
    """The flat layout of the trained weights: group by group, in model order within a group."""
    return sorted(trained, key=lambda w: group_of[w])


def make_segments(layout: list[str], sizes: dict[str, int], group_of: dict[str, int], whole_tensors: bool,
                  begin: int = 0, end: int | None = None) -> list[Segment]:
    """Segments covering ``[begin, end)`` of the layout: one per tensor, or per same-group run."""
    end = sum(sizes[w] for w in layout) if end is None else end
    runs: list[list] = []  # [group, start, stop, name]
    offset = 0
    for w in layout:
        start, stop = offset, offset + sizes[w]
        offset = stop
        if whole_tensors or not runs or runs[-1][0] != group_of[w]:
            runs.append([group_of[w], start, stop, w])
        else:
            runs[-1][2] = stop
    segments = []
    for group, start, stop, first in runs:
        start, stop = max(start, begin), min(stop, end)
        if start < stop:
            name = first if whole_tensors else f"group{group}[{start}:{stop}]"
            segments.append(Segment(name, group, start, stop))
    return segments


def build_optimizer_graph(
    config: _OptimizerConfig, groups: list[dict], segments: list[Segment], total: int, clip: bool,
) -> onnx.ModelProto:
    """Build the optimizer step over ``segments`` of a flat float32 layout of ``total`` elements.

    Args:
        config: the optimizer configuration.
        groups: resolved hyper-parameters per group (group 0: the config's defaults).
        segments: what this graph updates (under ZeRO, the rank's share of the layout).
        total: size of the whole flat layout; the global norm and the all-finite check read all
            of it, so clipping and skipping agree on every rank.
        clip: clip the global gradient norm to ``config.max_norm_clip`` (ignored for SGD).
    """
    b = _Builder()
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(name, f32, []) for name in (STEP_INPUT, GRAD_SCALE_INPUT)]
    inputs += [helper.make_tensor_value_info(lr_input(g), f32, []) for g in range(len(groups))]
    inputs.append(helper.make_tensor_value_info(GRADIENTS_INPUT, f32, [total]))
    outputs = []
    states = state_names(config)
    for seg in segments:
        for name in [seg.name, seg.name + GRAD_SUFFIX, *(f"{seg.name}.{s}" for s in states)]:
            inputs.append(helper.make_tensor_value_info(name, f32, [seg.stop - seg.start]))
    # Global norm and finiteness from the raw buffer: grad_scale is folded into the norm and
    # into the one multiplier each gradient gets, so the scaling costs no extra pass.
    norm = b.op("Mul", b.op("Sqrt", b.op("ReduceSumSquare", GRADIENTS_INPUT, keepdims=0)), GRAD_SCALE_INPUT)
    # NaN or inf in any gradient makes the sum of squares NaN or inf
    all_finite = b.op("Not", b.op("Or", b.op("IsNaN", norm), b.op("IsInf", norm)))
    b.output(norm, GRAD_NORM)
    b.output(all_finite, ALL_FINITE)
    outputs += [helper.make_tensor_value_info(GRAD_NORM, f32, []),
                helper.make_tensor_value_info(ALL_FINITE, TensorProto.BOOL, [])]

    scale = GRAD_SCALE_INPUT
    if clip and not isinstance(config, SGDConfig):
        ratio = b.op("Div", b.const(config.max_norm_clip), b.op("Add", norm, b.const(CLIP_EPS)))
        scale = b.op("Mul", b.op("Min", ratio, b.const(1.0)), GRAD_SCALE_INPUT)

    used_groups = sorted({seg.group for seg in segments})
    group_scalars = {g: _group_scalars(b, config, groups[g], g, scale) for g in used_groups}
    sums = []
    for seg in segments:
        # the raw buffer: its scale is folded into the per-group scalar factors
        new_values = _update(b, config, groups[seg.group], group_scalars[seg.group], seg.name, seg.name + GRAD_SUFFIX)
        for name, new in zip([seg.name, *(f"{seg.name}.{s}" for s in states)], new_values):
            b.output(new, name + OUT_SUFFIX)
            outputs.append(helper.make_tensor_value_info(name + OUT_SUFFIX, f32, [seg.stop - seg.start]))
        sums.append(b.op("ReduceSum", new_values[0], keepdims=0))
    # A NaN or inf in any new weight makes its sum NaN or inf; finite weights sum to inf only
    # past 3e38, which is an overflow worth refusing as well.
    total_sum = b.op("Sum", *sums) if sums else b.const(0.0)
    weights_finite = b.op("Not", b.op("Or", b.op("IsNaN", total_sum), b.op("IsInf", total_sum)))
    b.output(weights_finite, WEIGHTS_FINITE)
    outputs.append(helper.make_tensor_value_info(WEIGHTS_FINITE, TensorProto.BOOL, []))

    graph = helper.make_graph(b.finish(), "ort_trainer_optimizer", inputs, outputs, b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="ort_trainer")
    model.ir_version = 8
    return model


def _group_scalars(b: _Builder, config: _OptimizerConfig, hp: dict, group: int, scale: str) -> dict[str, str]:
    """Scalars shared by a group's weights: lr, the bias corrections, and the factors that apply
    the gradient's scale ``s`` (unscaling, averaging, clipping) inside the moment updates:
    ``(1-α)·s`` for the first moment, ``(1-β)·s²`` for the second, ``lr·s`` for SGD."""
    scalars = {"lr": lr_input(group)}
    if isinstance(config, SGDConfig):
        scalars["lr_scaled"] = b.op("Mul", lr_input(group), scale)
        scalars["scale"] = scale
        if hp["momentum"] and hp["dampening"]:  # torch's first step fills the buffer undamped
            first = b.op("Equal", STEP_INPUT, b.const(1.0))
            scalars["damped"] = b.op("Where", first, b.const(1.0), b.const(1.0 - hp["dampening"]))
        return scalars
    scalars["m_factor"] = b.op("Mul", b.const(1.0 - hp["alpha"]), scale)
    scalars["v_factor"] = b.op("Mul", b.const(1.0 - hp["beta"]), b.op("Mul", scale, scale))
    if hp["do_bias_correction"]:
        # In double, as torch.optim does: from a float32 β = 0.999, 1 - β^t is off by 1.3e-5.
        step = b.op("Cast", STEP_INPUT, to=TensorProto.DOUBLE)
        c1, c2 = (b.op("Sub", b.const(1.0, np.float64), b.op("Pow", b.const(hp[k], np.float64), step))
                  for k in ("alpha", "beta"))
        scalars["c1"] = b.op("Cast", c1, to=TensorProto.FLOAT)
        scalars["c2"] = b.op("Cast", c2, to=TensorProto.FLOAT)
        scalars["sqrt_c2"] = b.op("Cast", b.op("Sqrt", c2), to=TensorProto.FLOAT)
    return scalars


def _moments(b: _Builder, hp: dict, s: dict[str, str], w: str, grad: str) -> tuple[str, str]:
    """``m = α·m + (1-α)·g`` and ``v = β·v + (1-β)·g²`` for the scaled gradient ``g = s·grad``."""
    m = b.op("Add", b.op("Mul", f"{w}.Moment_1", b.const(hp["alpha"])), b.op("Mul", grad, s["m_factor"]))
    v = b.op("Add", b.op("Mul", f"{w}.Moment_2", b.const(hp["beta"])),
             b.op("Mul", b.op("Mul", grad, grad), s["v_factor"]))
    return m, v


def _sgd(b: _Builder, config: SGDConfig, hp: dict, s: dict[str, str], w: str, grad: str) -> list[str]:
    """SGD's new weight (and momentum buffer, where the config keeps them): ``torch.optim.SGD``'s order."""
    kept = [f"{w}.Momentum"] if config.has_momentum else []  # a group without momentum passes its buffer on
    if not hp["momentum"] and not hp["weight_decay"]:
        return [b.op("Sub", w, b.op("Mul", grad, s["lr_scaled"])), *kept]
    g = b.op("Mul", grad, s["scale"])
    if hp["weight_decay"]:
        g = b.op("Add", g, b.op("Mul", w, b.const(hp["weight_decay"])))
    if not hp["momentum"]:
        return [b.op("Sub", w, b.op("Mul", g, s["lr"])), *kept]
    momentum = b.const(hp["momentum"])
    buffer = b.op("Add", b.op("Mul", f"{w}.Momentum", momentum), b.op("Mul", g, s["damped"]) if "damped" in s else g)
    step = b.op("Add", g, b.op("Mul", buffer, momentum)) if hp["nesterov"] else buffer
    return [b.op("Sub", w, b.op("Mul", step, s["lr"])), buffer]


def _update(b: _Builder, config: _OptimizerConfig, hp: dict, s: dict[str, str], w: str, grad: str) -> list[str]:
    lr = s["lr"]
    if isinstance(config, SGDConfig):
        return _sgd(b, config, hp, s, w, grad)
    m, v = _moments(b, hp, s, w, grad)
    eps, decay = b.const(hp["epsilon"]), hp["lambda_coef"]
    if isinstance(config, AdamConfig):
        if hp["weight_decay_mode"] == DecayMode.BEFORE_WEIGHT_UPDATE:
            # torch.optim.AdamW's order of operations, for step-for-step parity
            sqrt_v = b.op("Sqrt", v)
            denom = b.op("Add", b.op("Div", sqrt_v, s["sqrt_c2"]) if "c2" in s else sqrt_v, eps)
            step_size = b.op("Div", lr, s["c1"]) if "c1" in s else lr
            base = w
            if decay:
                base = b.op("Mul", w, b.op("Sub", b.const(1.0), b.op("Mul", lr, b.const(decay))))
            new_w = b.op("Sub", base, b.op("Mul", b.op("Div", m, denom), step_size))
        else:
            # Hugging Face's former AdamW: decay applied to the updated weight
            step_size = lr
            if "c1" in s:
                step_size = b.op("Div", b.op("Mul", lr, s["sqrt_c2"]), s["c1"])
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
