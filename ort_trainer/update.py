"""The optimizer update over the engine's flat buffers: one seam, two implementations.

At an accumulation boundary the trainer asks the engine's update for ``step(learning_rates, t,
grad_scale)``: the global gradient norm, whether every gradient is finite and whether every updated
weight would be. It then ``commit()``s the update or drops it (a non-finite step, or another rank
refused it); nothing becomes current before ``commit``, so a dropped step changes nothing.

- ``GraphUpdate`` runs the ONNX optimizer graph (``graph/optimizer.py``) in a session of its own.
  ONNX Runtime orders nodes by data edges only, so a node writing a weight in place could run
  before another one read it: the graph reads buffer set ``p`` and writes set ``1 - p``, and
  ``commit`` swaps the sets. Weights and optimizer states are held twice.
- ``FusedUpdate`` runs torch's fused kernels in place, one pass per parameter segment, on views of
  the same flat buffers (zero-copy, on the CPU and on CUDA alike): the update is memory-bound, and
  one pass in place reads and writes each buffer once. ``step`` decides, ``commit`` runs the pass.
  Weights and optimizer states are held once.

``update_class`` picks one from the ``graph.optimizer`` option and the optimizer config: the fused
kernels only where their formula is api.md's (SGD, with torch's momentum, dampening, Nesterov momentum
and weight decay; Adam in mode BEFORE_WEIGHT_UPDATE with bias correction, which is torch's AdamW), the
graph for everything else (Lamb, Adam mode AFTER, Adam without bias correction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import onnx
import torch

from ._logging import logger
from .devices import Device
from .graph.names import GRAD_SUFFIX
from .graph.optimizer import (ALL_FINITE, CLIP_EPS, GRADIENTS_INPUT, GRAD_NORM, GRAD_SCALE_INPUT, OUT_SUFFIX,
                              STEP_INPUT, WEIGHTS_FINITE, lr_input, resolved_groups)
from .optim.config import DecayMode, LambConfig, SGDConfig, _OptimizerConfig
from .sessions import Sessions

IMPLEMENTATIONS = ("fused", "graph")

# The fast path runs in place only when its bound keeps every new weight, and the sum of them that
# the finiteness check takes, below this: a factor 4 under float32's largest value leaves room for
# the rounding of the kernel and of the sum.
_SAFE_MAGNITUDE = float(np.finfo(np.float32).max) / 4
_SLACK = 1 + 1e-5  # relative rounding of float32 arithmetic, generously


class EngineBuffers(Protocol):
    """What an update reads of the engine (``engine.Engine``): its flat buffers, their layout and
    its ``Sessions``. The update runs on them in place; it never makes or owns buffers."""

    placement: Device
    device: torch.device
    sessions: Sessions
    weights_flat: list[torch.Tensor]  # per parity
    states_flat: list[dict[str, torch.Tensor]]  # per parity: {state name: flat tensor}
    accumulated_flat: torch.Tensor
    segments: list
    state_names: list[str]
    begin: int
    parity: int


@dataclass
class StepResult:
    """What one optimizer step reports.

    Attributes:
        all_finite: every gradient is finite.
        global_gradient_norm: L2 norm of the averaged, unscaled gradient.
        weights_finite: every updated weight is finite (false when the update itself overflowed,
            e.g. from an enormous learning rate).
    """

    all_finite: bool
    global_gradient_norm: float
    weights_finite: bool = True


class OptimizerUpdate:
    """The optimizer step over the engine's flat buffers (one class per implementation).

    Attributes:
        name: ``"graph"`` or ``"fused"``, the ``graph.optimizer`` value it implements.
        double_buffered: weights and optimizer states are held in two sets that swap on commit.
    """

    name = ""
    double_buffered = False

    def step(self, learning_rates: list[float], step: int, grad_scale: float) -> StepResult:
        """Compute the update's verdict (and, for the graph, the update itself) without applying it.

        Args:
            learning_rates: one per parameter group.
            step: the 1-based update count ``t`` of this update.
            grad_scale: multiplies the gradient buffers into the averaged, unscaled gradient.
        """
        raise NotImplementedError

    def commit(self) -> None:
        """Make the update of the last ``step`` current. Not calling it drops the update.

        Raises:
            RuntimeError: when the last ``step`` found a non-finite gradient (nothing to commit).
        """
        raise NotImplementedError

    def values_loaded(self) -> None:
        """Weights or optimizer states were overwritten from outside (a loaded state)."""


def fused_problem(config: _OptimizerConfig) -> str | None:
    """Why torch's fused kernels cannot compute ``config``'s update exactly (None: they can)."""
    if isinstance(config, SGDConfig):
        return None
    if isinstance(config, LambConfig):
        return "Lamb's trust ratio needs per-tensor norms of the update; torch has no fused Lamb kernel"
    for index, hp in enumerate(resolved_groups(config)):
        where = "the defaults" if index == 0 else f"params[{index - 1}]"
        if hp["weight_decay_mode"] != DecayMode.BEFORE_WEIGHT_UPDATE:
            return (f"AdamConfig weight_decay_mode=AFTER_WEIGHT_UPDATE ({where}) is Hugging Face's former AdamW, "
                    "not torch's AdamW")
        if not hp["do_bias_correction"]:
            return f"AdamConfig do_bias_correction=False ({where}): torch's fused AdamW always corrects the bias"
    return None


def _plain_sgd(config: _OptimizerConfig) -> bool:
    """Whether ``config`` is SGD without momentum and weight decay in every group."""
    return isinstance(config, SGDConfig) and not any(hp["momentum"] or hp["weight_decay"]
                                                     for hp in resolved_groups(config))


def update_class(implementation: str, config: _OptimizerConfig) -> type[OptimizerUpdate]:
    """The update implementing ``graph.optimizer = implementation`` for ``config``.

    Raises:
        ValueError: for an implementation other than ``"fused"`` or ``"graph"``.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"graph.optimizer: must be one of {list(IMPLEMENTATIONS)}, got {implementation!r}")
    if implementation == "graph":
        logger.debug("optimizer update: the ONNX optimizer graph (graph.optimizer='graph')")
        return GraphUpdate
    problem = fused_problem(config)
    if problem is not None:
        logger.debug("optimizer update: the ONNX optimizer graph, because %s", problem)
        return GraphUpdate
    logger.debug("optimizer update: torch's fused %s kernel in place, one pass per parameter segment "
                 "(graph.optimizer='fused', and the kernel's formula is this config's)",
                 ("SGD (add_)" if _plain_sgd(config) else "SGD (_fused_sgd_)") if isinstance(config, SGDConfig)
                 else "AdamW")
    return FusedUpdate


class GraphUpdate(OptimizerUpdate):
    """The ONNX optimizer graph: reads buffer set ``p``, writes ``1 - p``; ``commit`` swaps them.

    Args:
        engine: the engine whose buffers it updates.
        graph: the optimizer graph (``graph.optimizer.build_optimizer_graph``) over the engine's segments.
        config, clip: unused (the graph holds them).
    """

    name = "graph"
    double_buffered = True

    def __init__(self, engine: EngineBuffers, graph: onnx.ModelProto, config: _OptimizerConfig, clip: bool):
        self._engine = engine
        self._session = engine.sessions.make_session(graph)
        self._bindings = [self._binding(p) for p in (0, 1)]
        self._committable = False

    def _binding(self, parity: int):
        """Read weights and states of set ``parity``, write set ``1 - parity``, segment by segment.

        The three scalars the trainer reads are bound to host memory (ONNX Runtime copies them
        there); every buffer is bound where it lives.
        """
        engine, session = self._engine, self._session
        device, binding = engine.placement, session.io_binding()
        binding.bind_output(ALL_FINITE, "cpu")  # first: get_outputs() keeps first-binding order
        binding.bind_output(GRAD_NORM, "cpu")
        binding.bind_output(WEIGHTS_FINITE, "cpu")
        engine.sessions.bind_buffer(session, binding, GRADIENTS_INPUT, engine.accumulated_flat)
        read, write = engine.weights_flat[parity], engine.weights_flat[1 - parity]
        for seg in engine.segments:
            a, b = seg.start, seg.stop
            engine.sessions.bind_buffer(session, binding, seg.name, read[a:b])
            engine.sessions.bind_buffer(session, binding, seg.name + GRAD_SUFFIX, engine.accumulated_flat[a:b])
            device.bind_output(binding, seg.name + OUT_SUFFIX, write[a:b])
            for state in engine.state_names:
                lo, hi = a - engine.begin, b - engine.begin
                engine.sessions.bind_buffer(session, binding, f"{seg.name}.{state}", engine.states_flat[parity][state][lo:hi])
                device.bind_output(binding, f"{seg.name}.{state}{OUT_SUFFIX}",
                                   engine.states_flat[1 - parity][state][lo:hi])
        return binding

    def step(self, learning_rates: list[float], step: int, grad_scale: float = 1.0) -> StepResult:
        engine = self._engine
        device, binding = engine.placement, self._bindings[engine.parity]
        keep_alive = [np.array(step, dtype=np.float32), np.array(grad_scale, dtype=np.float32)]
        device.bind_feed(binding, STEP_INPUT, keep_alive[0])
        device.bind_feed(binding, GRAD_SCALE_INPUT, keep_alive[1])
        for group, lr in enumerate(learning_rates):
            keep_alive.append(np.array(lr, dtype=np.float32))
            device.bind_feed(binding, lr_input(group), keep_alive[-1])
        binding.bind_output(ALL_FINITE, "cpu")
        binding.bind_output(GRAD_NORM, "cpu")
        binding.bind_output(WEIGHTS_FINITE, "cpu")
        engine.sessions.before_run(binding)
        engine.sessions.run(self._session, binding, "the optimizer update (the ONNX optimizer graph)", {},
                            training=False)
        produced = binding._iobinding.get_outputs()  # the raw list: no wrapper per bound output
        result = StepResult(bool(produced[0].numpy()), float(produced[1].numpy()), bool(produced[2].numpy()))
        self._committable = result.all_finite
        return result

    def commit(self) -> None:
        if not self._committable:
            raise RuntimeError("GraphUpdate.commit: the last step had non-finite gradients; there is nothing to commit")
        self._committable = False
        self._engine.parity = 1 - self._engine.parity


@dataclass
class _Segment:
    """Views of one parameter segment: its weights, gradients and optimizer states (none for SGD)."""

    group: int
    weights: torch.Tensor
    grads: torch.Tensor
    states: list[torch.Tensor]

    def copy(self) -> "_Segment":
        return _Segment(self.group, self.weights.clone(), self.grads.clone(), [s.clone() for s in self.states])


class FusedUpdate(OptimizerUpdate):
    """Torch's fused kernels in place over the engine's buffers, one pass per parameter segment.

    Plain SGD is ``w.add_(g, alpha=-lr·s)``; SGD with a momentum or weight decay is ``torch._fused_sgd_``,
    ``torch.optim.SGD``'s kernel (its first step, ``t = 1``, fills the momentum buffer undamped, as the graph);
    Adam is ``torch._fused_adamw_``, torch's AdamW kernel:
    ``w ← w·(1 − lr·λ) − lr/c1 · m/(√v/√c2 + ε)`` after ``m ← m + (1−α)(g − m)``,
    ``v ← β·v + (1−β)·g²``, the formula of api.md's mode BEFORE with bias correction. The
    gradient's scale ``s`` (averaging, loss-scale division, clipping) enters as the kernel's
    ``grad_scale`` divisor ``1/s``, with which the kernel also writes ``g·s`` back into the gradient
    buffer: that buffer is dead after an applied update (the next micro-batch overwrites it before
    anything reads it; a checkpoint stores it only inside a window, where no update has run).

    Global norm, clipping and the all-finite check are those of the graph, computed first; a
    non-finite step runs nothing. A weight the update would make non-finite cannot be rolled back
    in place, so ``step`` bounds the new weights first (``_bounds_after``) and, in the rare step
    where the bound cannot rule an overflow out, computes the update exactly on copies of the
    segments and keeps it only if finite (``exact_updates`` counts those steps).

    Args:
        engine: the engine whose (single) buffer set it updates.
        graph: unused (the graph implementation's).
        config: the optimizer config (SGD, or Adam as ``fused_problem`` accepts).
        clip: clip the global gradient norm to ``config.max_norm_clip`` (never for SGD).
    """

    name = "fused"
    double_buffered = False

    def __init__(self, engine: EngineBuffers, graph: onnx.ModelProto, config: _OptimizerConfig, clip: bool):
        self._engine = engine
        self._sgd = isinstance(config, SGDConfig)
        self._groups = resolved_groups(config)
        self._max_norm = None if self._sgd or not clip else np.float32(config.max_norm_clip)
        weights, states, grads = engine.weights_flat[0], engine.states_flat[0], engine.accumulated_flat
        self._segments = [
            _Segment(seg.group, weights[seg.start:seg.stop], grads[seg.start:seg.stop],
                     [states[s][seg.start - engine.begin:seg.stop - engine.begin] for s in engine.state_names])
            for seg in engine.segments]
        self._size = sum(seg.weights.numel() for seg in self._segments)
        scalar = lambda: torch.zeros((), dtype=torch.float32, device=engine.device)  # noqa: E731
        self._step_counts = [scalar() for _ in self._segments]  # the kernel reads t; it does not count
        self._divisor = scalar()
        self._bounds: tuple[float, float] | None = None  # bounds on max|w|, max|m|; None: measure them
        self._pending: Callable[[], None] | None = None
        self.exact_updates = 0

    def values_loaded(self) -> None:
        self._bounds = None

    def step(self, learning_rates: list[float], step: int, grad_scale: float = 1.0) -> StepResult:
        self._pending = None
        grads = self._engine.accumulated_flat
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            # the graph's norm: the float32 sum of squares (inf past float32's range), square root, scale
            square_sum = np.float32(torch.dot(grads, grads).item())
            norm = np.sqrt(square_sum) * np.float32(grad_scale)
            if not np.isfinite(norm):
                return StepResult(False, float(norm), True)
            scale = np.float32(grad_scale)
            if self._max_norm is not None:
                scale = np.minimum(self._max_norm / (norm + np.float32(CLIP_EPS)), np.float32(1.0)) * scale
        rates = [np.float32(lr) for lr in learning_rates]
        bounds = self._bounds_after(rates, float(scale) * math.sqrt(float(square_sum)), step)
        if bounds is not None:
            def apply() -> None:
                self._run(self._segments, rates, scale, step)
                self._bounds = bounds
            self._pending = apply
            return StepResult(True, float(norm), True)
        return self._exact_step(rates, scale, step, float(norm))

    def _exact_step(self, rates: list[np.float32], scale: np.float32, step: int, norm: float) -> StepResult:
        """The update on copies of the segments, kept (on commit) only if every new weight is finite."""
        self.exact_updates += 1
        copies = [seg.copy() for seg in self._segments]
        self._run(copies, rates, scale, step)
        # the graph's check: the float32 sum of the new weights is finite (NaN, inf, or an overflowing sum)
        total = torch.stack([c.weights.sum() for c in copies]).sum() if copies else torch.zeros(())
        finite = bool(torch.isfinite(total))
        logger.debug("fused update, step %d: the bound allowed an overflow; computed on copies: %s", step,
                     "finite, kept" if finite else "not finite, dropped")
        if finite:
            def apply() -> None:
                for seg, new in zip(self._segments, copies):
                    seg.weights.copy_(new.weights)
                    for state, value in zip(seg.states, new.states):
                        state.copy_(value)
                self._bounds = None  # measured again at the next step: tight after a huge update
            self._pending = apply
        return StepResult(True, norm, finite)

    def commit(self) -> None:
        if self._pending is None:
            raise RuntimeError("FusedUpdate.commit: the last step was not finite; there is nothing to commit")
        apply, self._pending = self._pending, None
        apply()

    def _run(self, segments: list[_Segment], rates: list[np.float32], scale: np.float32, step: int) -> None:
        """The kernels, in place on ``segments``."""
        divisor = None
        if scale != 1:
            with np.errstate(divide="ignore"):
                self._divisor.fill_(float(np.float32(1) / scale))
            divisor = self._divisor
        if self._sgd:
            for seg in segments:
                hp, lr = self._groups[seg.group], float(rates[seg.group])
                if not (hp["momentum"] or hp["weight_decay"]):  # the graph's w - g·(lr·s), lr·s rounded as there
                    seg.weights.add_(seg.grads, alpha=-float(rates[seg.group] * scale))
                    continue
                torch._fused_sgd_([seg.weights], [seg.grads], seg.states[:1] if hp["momentum"] else [],
                                  weight_decay=hp["weight_decay"], momentum=hp["momentum"], lr=lr,
                                  dampening=hp["dampening"], nesterov=hp["nesterov"], maximize=False,
                                  is_first_step=step == 1, grad_scale=divisor, found_inf=None)
            return
        for seg, count in zip(segments, self._step_counts):
            hp = self._groups[seg.group]
            count.fill_(step)
            torch._fused_adamw_([seg.weights], [seg.grads], [seg.states[0]], [seg.states[1]], [], [count],
                                lr=float(rates[seg.group]), beta1=hp["alpha"], beta2=hp["beta"],
                                weight_decay=hp["lambda_coef"], eps=hp["epsilon"], amsgrad=False, maximize=False,
                                grad_scale=divisor, found_inf=None)

    def _measure(self) -> tuple[float, float]:
        """max|w| and max|m| (Adam's first moment, SGD's momentum buffer) over this process's segments (one
        reduction over each, no temporaries).

        ``aminmax`` takes both ends in one pass, and the larger magnitude of the two is max|x| exactly;
        NaN when any value is NaN. ``vector_norm(x, inf)`` gives the same 13x slower on a CPU (80
        against 6 ms on 33.6 M weights): 0.5 s of GPT-2 small's first step.
        """
        def largest(tensors: list[torch.Tensor]) -> float:
            ends = [float(x) for t in tensors if t.numel() for x in torch.aminmax(t)]
            if any(math.isnan(x) for x in ends):  # max() would keep or drop a NaN by its position
                return math.nan
            return max((abs(x) for x in ends), default=0.0)
        return (largest([s.weights for s in self._segments]),
                largest([s.states[0] for s in self._segments if s.states]))

    def _bounds_after(self, rates: list[np.float32], gradient_bound: float, step: int) -> tuple[float, float] | None:
        """Bounds on max|w| and max|m| after this update, or None when they cannot rule out an overflow.

        ``gradient_bound`` is the scaled gradient's L2 norm, a bound on every |g·s|. The first
        moment is a convex combination, |m'| ≤ max(|m|, |g·s|). Adam moves a weight by
        ``lr/c1 · |m'|/(√v'/√c2 + ε) ≤ lr/c1 · max|m'|/ε`` after scaling it by ``1 − lr·λ``. SGD's
        direction ``d = g·s + λ·w`` has ``|d| ≤ |g·s| + λ·max|w|``, its buffer ``b' = μ·b + (1−τ)·d``
        (``d`` at the first step) ``|b'| ≤ μ·max|b| + max(1, |1−τ|)·|d|``, and it moves the weight by
        ``lr·|d|``, ``lr·|b'|`` or, Nesterov's, ``lr·(|d| + μ·|b'|)``. So ``max|w'| ≤ |1 − lr·λ|·max|w| +
        move`` (SGD: ``max|w| + move``), and the sum of the n
        new weights that the finiteness check adds up is at most ``n·max|w'|``. The bounds are
        carried from step to step (measured exactly once, and again after a load or an exact step),
        so deciding costs no pass over the buffers. Carried bounds only grow (by the rounding slack
        too), so when they cannot rule an overflow out they are measured again before the step
        is given up to the exact path: a long run never drifts onto it.
        """
        measured = self._bounds is None
        if measured:
            self._bounds = self._measure()
        found = self._bounds_from(self._bounds, rates, gradient_bound, step)
        if found is None and not measured:
            self._bounds = self._measure()
            found = self._bounds_from(self._bounds, rates, gradient_bound, step)
        return found

    def _bounds_from(self, bounds: tuple[float, float], rates: list[np.float32], gradient_bound: float,
                     step: int) -> tuple[float, float] | None:
        """``_bounds_after`` from the bounds ``(max|w|, max|m|)`` before the update."""
        w_max, m_max = bounds
        if not (math.isfinite(w_max) and math.isfinite(m_max)):  # a loaded state with NaN or inf in it
            return None
        groups = {seg.group for seg in self._segments}
        if self._sgd:
            m_new, w_new = m_max, w_max
            for g in groups:
                hp = self._groups[g]
                move = gradient_bound + hp["weight_decay"] * w_max
                if hp["momentum"]:
                    buffer = (hp["momentum"] * m_max + max(1.0, abs(1.0 - hp["dampening"])) * move) * _SLACK
                    m_new = max(m_new, buffer)
                    move = move + hp["momentum"] * buffer if hp["nesterov"] else buffer
                w_new = max(w_new, w_max + float(rates[g]) * move)
        else:
            m_new = max(m_max, gradient_bound) * _SLACK
            w_new = 0.0
            for g in groups:
                hp, lr = self._groups[g], float(rates[g])
                c1 = 1.0 - float(hp["alpha"]) ** step
                if c1 <= 0 or hp["epsilon"] <= 0:
                    return None
                w_new = max(w_new, abs(1.0 - lr * hp["lambda_coef"]) * w_max + lr / c1 * m_new / hp["epsilon"])
        w_new *= _SLACK
        if not math.isfinite(w_new) or max(self._size, 1) * w_new > _SAFE_MAGNITUDE:
            return None
        return w_new, m_new


__all__ = ["FusedUpdate", "GraphUpdate", "IMPLEMENTATIONS", "OptimizerUpdate", "StepResult", "fused_problem",
           "update_class"]
