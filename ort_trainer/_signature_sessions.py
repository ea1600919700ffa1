"""The sessions of one shape signature: its gradient and eval sessions, bound to the engine's buffers.

Below the engine (``engine.py``), which holds one ``SessionSet`` per signature and hands itself to
it: the sets bind its weights, gradient buffers and scratch buffers to each session they make.
"""

from __future__ import annotations

from typing import Any, Callable

import onnx
import onnxruntime as ort

from ._run_errors import ONNXRUNTIME_ERRORS
from ._step_io import RANDOM_OPS, CapturedIO, FreshIO, capture_problems
from .dropout_masks import HostDropoutMasks
from .graph.names import ACCUMULATED_FLAG_SUFFIX, ACCUMULATOR_SUFFIX, GRAD_SUFFIX, RESET_INPUT
from .graph.passes.tied_embedding import host_table_rows


def _draws_random_numbers(graph: onnx.GraphProto) -> bool:
    """Whether a node of ``graph`` (or of a subgraph) draws from ONNX Runtime's random generator."""
    for node in graph.node:
        if node.op_type in RANDOM_OPS:
            return True
        for attr in node.attribute:
            subgraphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
            if any(_draws_random_numbers(g) for g in subgraphs):
                return True
    return False


class SessionSet:
    """Gradient and eval sessions of one shape signature, with their per-parity bindings: each made
    when a step first needs it (a signature only evaluated never makes its gradient session)."""

    def __init__(self, engine: Any, gradient: Callable[[], onnx.ModelProto],
                 eval_model: Callable[[], onnx.ModelProto]):
        self._engine, self._gradient_model, self._eval_model = engine, gradient, eval_model
        self._eval: tuple | None = None
        self.training: _GradientSession | None = None

    def make_training(self) -> None:
        """Make the gradient session and its bindings, unless made already."""
        if self.training is None:
            self.training = _GradientSession(self._engine, self._gradient_model())

    def evaluation(self) -> tuple[ort.InferenceSession, list[FreshIO], set[str]]:
        """The eval session, its per-parity bindings (``FreshIO``: evaluations are not captured) and
        its input names, made on first use (the eval graph itself may be built only then)."""
        if self._eval is None:
            engine = self._engine
            model = self._eval_model()
            outputs = _described_outputs(engine, model)
            session = engine.sessions.make_session(model)
            io = engine.per_parity(lambda p: FreshIO(engine.placement, engine._bind_weights(session, p, outputs),
                                                     outputs))
            self._eval = session, io, {i.name for i in session.get_inputs()}
        return self._eval


def _refuse_capture(problems: list[str]) -> None:
    """Raise, before any run, when a training graph cannot be captured as a CUDA graph."""
    if problems:
        raise ValueError("device.cuda_graph: this model's training step cannot be captured as a CUDA graph and "
                         "replayed:\n  " + "\n  ".join(problems) + "\nTurn device.cuda_graph off to train it.")


def _described_outputs(engine: Any, model: onnx.ModelProto) -> list[str]:
    """The description's outputs ``model`` returns, in description order (a graph built for fewer
    fetches returns fewer)."""
    produced = {o.name for o in model.graph.output}
    return [n for n in engine.output_names if n in produced]


class _GradientSession:
    """The gradient session of one shape signature, with its per-parity bindings to the engine's
    weights, gradient buffers and scratch buffers."""

    def __init__(self, engine: Any, gradient: onnx.ModelProto):
        self.output_names = _described_outputs(engine, gradient)
        capture, device = engine.graph_capture, engine.placement
        if capture:
            _refuse_capture(capture_problems(gradient))
        try:
            self.gradient = engine.sessions.make_session(gradient, capture=capture)
        except ONNXRUNTIME_ERRORS as exc:  # ONNX Runtime's own refusal (a node placed on the host)
            if not capture:
                raise
            raise ValueError(f"device.cuda_graph: ONNX Runtime cannot capture this model's training step ({exc}); "
                             "turn device.cuda_graph off to train it") from exc
        self.gradient_inputs = {i.name for i in self.gradient.get_inputs()}
        # an accumulating graph (``GradientSource.accumulation_io``) reads each gradient buffer as an
        # input and adds into it: with an operator, reset by an input, or through its output bound to
        # the same buffer (the engine zeroes the buffers at a window's start)
        self.accumulates = any(w + ACCUMULATOR_SUFFIX in self.gradient_inputs for w in engine.grads)
        self.resets_in_graph = RESET_INPUT in self.gradient_inputs
        if capture:
            elsewhere = sorted(device.inputs_copied_at_binding(self.gradient))
            _refuse_capture(
                ([f"ONNX Runtime reads {', '.join(elsewhere)} on another device than {device} (their consumers "
                  "have no kernel there)"] if elsewhere else [])
                + (["the graph adds into the gradient buffers, which its warm-up runs would do more than once "
                    "(accumulate on the host)"] if self.accumulates else []))
        # tied embeddings (the tied_embedding_gradient pass): {weight: (row index, rows)}, the lookup's
        # rows that forward_backward adds into the weight's gradient after the run
        self.table_rows = {name[:-len(GRAD_SUFFIX)]: pair for name, pair in host_table_rows(gradient).items()}
        self.gradient_outputs = self.output_names + [name for pair in self.table_rows.values() for name in pair]
        # get_outputs() lists outputs in first-binding order: the description's outputs go first
        # ONNX Runtime's training BatchNorm kernel writes the running statistics it reads in
        # place: the gradient graph reads a per-step copy, so an uncommitted step leaves them be.
        self.grad_bindings = engine.per_parity(
            lambda p: engine._bind_weights(self.gradient, p, self.gradient_outputs, engine.buffer_inputs))
        io: dict[int, FreshIO | CapturedIO] = {}  # by id(binding): one binding at both parities, one io
        for parity, binding in enumerate(self.grad_bindings):
            if id(binding) not in io:
                io[id(binding)] = (CapturedIO(device, binding, self.gradient_outputs, set(self.output_names),
                                              graph_id=1 + parity) if capture
                                   else FreshIO(device, binding, self.gradient_outputs))
        self.grad_io = [io[id(binding)] for binding in self.grad_bindings]
        self.draws_random_numbers = _draws_random_numbers(gradient.graph)
        self.dropout_masks = HostDropoutMasks(gradient)  # masks the host draws, the seed of those seeded_dropout draws
        for binding in {id(b): b for b in self.grad_bindings}.values():
            for w, buffer in engine.grads.items():
                if self.accumulates:
                    engine.sessions.bind_buffer(self.gradient, binding, w + ACCUMULATOR_SUFFIX, buffer)
                if self.resets_in_graph:  # the operator adds into the buffer in place and returns a flag
                    device.bind_fresh_output(binding, w + ACCUMULATED_FLAG_SUFFIX)
                else:  # the graph writes the gradient (or the sum) straight into the buffer
                    device.bind_output(binding, w + GRAD_SUFFIX, buffer)
            # Forward-updated buffers (BatchNorm statistics) land in scratch buffers; the trainer
            # commits them once the whole step has succeeded (``Engine.commit_buffers``).
            for buffer_name, output in engine.buffer_updates.items():
                device.bind_output(binding, output, engine.buffer_scratch[buffer_name])


__all__ = ["SessionSet"]
