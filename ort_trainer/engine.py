"""The engine: ONNX Runtime sessions over buffers the trainer owns.

Weights, gradients and optimizer states are ``OrtValue`` buffers that live across steps; a step
binds them once (IOBinding) and copies nothing but its inputs. Trained weights and their states
are double-buffered: the optimizer session reads buffer set ``p`` and writes set ``1 - p``, then
the sets swap, so no node can read a weight after it was overwritten in the same run.

Graphs that depend on input shapes (gradient and eval) are held per *shape signature*: the
trainer asks ``select(signature)`` before each step and the engine builds the sessions for a new
signature on demand from ``graph_provider``. The optimizer graph is shape-independent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ._logging import ort_severity
from .graph.gradient import ACCUMULATED_FLAG_SUFFIX, ACCUMULATOR_SUFFIX, GRAD_SUFFIX, LOSS_SCALE_INPUT, RESET_INPUT
from .graph.optimizer import ALL_FINITE, GRAD_NORM, GRAD_SCALE_INPUT, OUT_SUFFIX, STEP_INPUT, lr_input

GraphProvider = Callable[[Hashable], "tuple[onnx.ModelProto, onnx.ModelProto]"]


@dataclass
class StepResult:
    """What one optimizer run reports."""

    all_finite: bool
    global_gradient_norm: float


class _SessionSet:
    """Gradient and eval sessions of one shape signature, with their per-parity bindings."""

    def __init__(self, engine: "Engine", gradient: onnx.ModelProto, eval_model: onnx.ModelProto):
        self.gradient = engine._session(gradient)
        self.eval = engine._session(eval_model)
        self.gradient_inputs = {i.name for i in self.gradient.get_inputs()}
        self.eval_inputs = {i.name for i in self.eval.get_inputs()}
        # get_outputs() lists outputs in first-binding order: the description's outputs go first
        self.grad_bindings = [engine._bind_weights(self.gradient, p, bind_outputs=True) for p in (0, 1)]
        self.accumulates = RESET_INPUT in self.gradient_inputs
        for binding in self.grad_bindings:
            for w, buffer in engine.grads.items():
                if self.accumulates:  # the graph adds into the buffer in place
                    binding.bind_ortvalue_input(w + ACCUMULATOR_SUFFIX, buffer)
                    binding.bind_output(w + ACCUMULATED_FLAG_SUFFIX, "cpu")
                else:  # the graph writes the gradient straight into the buffer
                    binding.bind_ortvalue_output(w + GRAD_SUFFIX, buffer)
            # Forward-updated buffers (BatchNorm statistics) are written over themselves: every
            # reader of the old value is upstream of the node that writes the new one.
            for buffer_name, output in engine.buffer_updates.items():
                binding.bind_ortvalue_output(output, engine.fixed[buffer_name])
        self.eval_bindings = [engine._bind_weights(self.eval, p, bind_outputs=True) for p in (0, 1)]


class Engine:
    """Runs forward/backward, the optimizer and eval over trainer-owned ONNX Runtime buffers.

    Args:
        optimizer_graph: the update step.
        graph_provider: ``signature -> (gradient_graph, eval_graph)``.
        weights: initial value of every weight input.
        trained: the weights the optimizer updates.
        state_names: per-weight optimizer state names (``Moment_1``, ...).
        output_names: the description's outputs, in order.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        session_options: base ``onnxruntime.SessionOptions`` (or None).
        provider_options: extra execution-provider options.
        mem_limit: GPU arena limit in bytes (0: none).
        deterministic: ask for deterministic kernels.
        pieces: ZeRO pieces this process updates (None: every trained weight).
        host_accumulation: sum micro-batch gradients on the host (after their all-reduce).
        intra_op_threads: threads per session when no session_options are given (0: default).
        buffer_updates: ``{buffer: gradient-graph output}`` written back into the buffer each step.
    """

    def __init__(
        self,
        optimizer_graph: onnx.ModelProto,
        graph_provider: GraphProvider,
        weights: dict[str, np.ndarray],
        trained: list[str],
        state_names: list[str],
        output_names: list[str],
        device: str = "cpu",
        session_options: ort.SessionOptions | None = None,
        provider_options: dict | None = None,
        mem_limit: int = 0,
        deterministic: bool = False,
        pieces: list | None = None,
        host_accumulation: bool = False,
        intra_op_threads: int = 0,
        buffer_updates: dict[str, str] | None = None,
    ):
        kind, _, index = device.partition(":")
        self.device_type = "cuda" if kind == "cuda" else "cpu"
        self.device_id = int(index) if index else 0
        self._session_options = session_options or ort.SessionOptions()
        self._session_options.log_severity_level = ort_severity()
        if session_options is None and intra_op_threads:
            self._session_options.intra_op_num_threads = intra_op_threads
        if deterministic:
            self._session_options.use_deterministic_compute = True
        if self.device_type == "cuda":
            cuda_options = {"device_id": self.device_id, **({"gpu_mem_limit": mem_limit} if mem_limit else {})}
            self._providers = [("CUDAExecutionProvider", {**cuda_options, **(provider_options or {})}),
                               "CPUExecutionProvider"]
        else:
            self._providers = [("CPUExecutionProvider", dict(provider_options or {}))]
        self.trained = list(trained)
        # what this process's optimizer updates: whole weights, or ZeRO pieces of them
        self.pieces = pieces
        self.updated = [p.name for p in pieces] if pieces is not None else list(trained)
        self.state_names = list(state_names)
        self.output_names = list(output_names)
        self.host_accumulation = host_accumulation
        self.buffer_updates = dict(buffer_updates or {})
        shapes = {w: np.shape(weights[w]) for w in trained}
        not_float32 = [w for w in trained if np.asarray(weights[w]).dtype != np.float32]
        if not_float32:
            raise TypeError(f"trained weights must be float32; these are not: {not_float32} "
                            "(convert the model with model.float(), or freeze them)")
        self._dtypes = {n: np.asarray(v).dtype for n, v in weights.items()}
        self._shapes = shapes
        self.parity = 0
        trained_set = set(trained)
        # fixed: weights nobody updates (frozen, buffers); trained weights and states double-buffered
        self.fixed_arrays = {n: np.array(v, copy=True) for n, v in weights.items() if n not in trained_set}
        self.fixed = {n: self._ortvalue(v) for n, v in self.fixed_arrays.items()}
        self.buffers: list[dict[str, ort.OrtValue]] = [{}, {}]
        # Trained weights (and gradients) live in one flat float32 array per role, laid out in
        # ``trained`` order, so collectives (broadcast, all-reduce, ZeRO all-gather) are one call.
        self.weights_flat: list[np.ndarray | None] = [None, None]
        piece_shapes = {**shapes, **{p.name: p.shape for p in pieces or []}}
        for p in (0, 1):
            self.weights_flat[p], views = self._allocate(self.trained, shapes)
            self.buffers[p].update(views)
            self.buffers[p].update(self._piece_views(self.weights_flat[p], ""))
            for state in state_names:
                _, views = self._allocate(self.updated, piece_shapes)
                self.buffers[p].update({f"{w}.{state}": v for w, v in views.items()})
        self.load_weights({w: weights[w] for w in trained})
        self.grads_flat, self.grads = self._allocate(self.trained, shapes)
        self.accumulated_flat, self.accumulated = (
            self._allocate(self.trained, shapes) if host_accumulation else (self.grads_flat, self.grads)
        )
        # optimizer gradient inputs: every trained weight's (for the global norm) and each split piece's
        self._optimizer_grads = {w + GRAD_SUFFIX: v for w, v in self.accumulated.items()}
        self._optimizer_grads.update(self._piece_views(self.accumulated_flat, GRAD_SUFFIX))
        self._graph_provider = graph_provider
        self._session_sets: dict[Hashable, _SessionSet] = {}
        self._current: _SessionSet | None = None
        self.optimizer = self._session(optimizer_graph)
        self._opt_bindings = [self._optimizer_binding(p) for p in (0, 1)]

    # ---- set-up helpers -------------------------------------------------------------------
    def _session(self, model: onnx.ModelProto) -> ort.InferenceSession:
        return ort.InferenceSession(model.SerializeToString(), self._session_options, providers=self._providers)

    def _ortvalue(self, value: np.ndarray) -> ort.OrtValue:
        """An OrtValue holding ``value``; on the CPU it shares ``value``'s memory."""
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), self.device_type, self.device_id)

    def _allocate(self, names: list[str], shapes: dict[str, tuple]) -> tuple[np.ndarray | None, dict[str, ort.OrtValue]]:
        """Zeroed float32 buffers for ``names``: on the CPU views into one flat array (returned too)."""
        if self.device_type != "cpu":
            return None, {n: self._ortvalue(np.zeros(shapes[n], np.float32)) for n in names}
        flat = np.zeros(sum(int(np.prod(shapes[n])) for n in names), dtype=np.float32)
        views, offset = {}, 0
        for n in names:
            size = int(np.prod(shapes[n]))
            views[n] = self._ortvalue(flat[offset:offset + size].reshape(shapes[n]))
            offset += size
        return flat, views

    def _piece_views(self, flat: np.ndarray | None, suffix: str) -> dict[str, ort.OrtValue]:
        """1-D views of ``flat`` for the split ZeRO pieces, keyed ``piece.name + suffix``."""
        if not self.pieces:
            return {}
        offsets = np.concatenate([[0], np.cumsum([int(np.prod(self._shapes[w])) for w in self.trained])])
        where = dict(zip(self.trained, offsets.astype(int)))
        return {p.name + suffix: self._ortvalue(flat[where[p.weight] + p.start:where[p.weight] + p.stop])
                for p in self.pieces if p.name != p.weight}

    def accumulate_on_host(self, reset: bool) -> None:
        """Add this micro-batch's (all-reduced) gradients into the accumulation buffers."""
        if reset:
            np.copyto(self.accumulated_flat, self.grads_flat)
        else:
            np.add(self.accumulated_flat, self.grads_flat, out=self.accumulated_flat)

    def _bind_weights(self, session: ort.InferenceSession, parity: int, bind_outputs: bool = False) -> ort.IOBinding:
        binding = session.io_binding()
        if bind_outputs:
            for name in self.output_names:
                binding.bind_output(name, self.device_type, self.device_id)
        names = {i.name for i in session.get_inputs()}
        for name, value in [*self.fixed.items(), *self.buffers[parity].items()]:
            if name in names:
                binding.bind_ortvalue_input(name, value)
        return binding

    def _optimizer_binding(self, parity: int) -> ort.IOBinding:
        binding = self._bind_weights(self.optimizer, parity)
        binding.bind_output(ALL_FINITE, "cpu")  # first: get_outputs() keeps first-binding order
        binding.bind_output(GRAD_NORM, "cpu")
        inputs = {i.name for i in self.optimizer.get_inputs()}
        for name, grad in self._optimizer_grads.items():
            if name in inputs:
                binding.bind_ortvalue_input(name, grad)
        outputs = {o.name for o in self.optimizer.get_outputs()}
        for name, value in self.buffers[1 - parity].items():
            if name + OUT_SUFFIX in outputs:  # under ZeRO only this rank's shard is written
                binding.bind_ortvalue_output(name + OUT_SUFFIX, value)
        return binding

    # ---- steps ------------------------------------------------------------------------------
    def select(self, signature: Hashable) -> None:
        """Use the graphs of shape signature ``signature``, building their sessions if new."""
        sessions = self._session_sets.get(signature)
        if sessions is None:
            gradient, eval_model = self._graph_provider(signature)
            sessions = self._session_sets[signature] = _SessionSet(self, gradient, eval_model)
        self._current = sessions

    def forward_backward(self, feeds: dict[str, np.ndarray], loss_scale: float = 1.0,
                         reset: bool = True) -> list[torch.Tensor]:
        """Run forward + backward; returns the outputs.

        Gradients of ``loss * loss_scale`` land in ``self.grads``: written over them, or with an
        accumulating graph added to them unless ``reset`` (first micro-batch of a window).
        """
        sessions = self._require_sessions()
        binding = sessions.grad_bindings[self.parity]
        extra = {LOSS_SCALE_INPUT: np.array(loss_scale, dtype=np.float32)}
        if sessions.accumulates:
            extra[RESET_INPUT] = np.array([reset], dtype=np.bool_)
        return self._run(sessions.gradient, binding, sessions.gradient_inputs, {**feeds, **extra})

    def evaluate(self, feeds: dict[str, np.ndarray]) -> list[torch.Tensor]:
        """Run the eval graph with the current weights. Returns the outputs."""
        sessions = self._require_sessions()
        binding = sessions.eval_bindings[self.parity]
        return self._run(sessions.eval, binding, sessions.eval_inputs, feeds)

    def optimizer_step(self, learning_rates: list[float], step: int, grad_scale: float = 1.0) -> StepResult:
        """Apply the update (skipped in-graph when a gradient is not finite) and swap buffers.

        Args:
            learning_rates: one per parameter group.
            step: the 1-based update count ``t`` of this update.
            grad_scale: multiplies the gradient buffers into the averaged, unscaled gradient.
        """
        binding = self._opt_bindings[self.parity]
        keep_alive = [np.array(step, dtype=np.float32), np.array(grad_scale, dtype=np.float32)]
        binding.bind_cpu_input(STEP_INPUT, keep_alive[0])
        binding.bind_cpu_input(GRAD_SCALE_INPUT, keep_alive[1])
        for group, lr in enumerate(learning_rates):
            keep_alive.append(np.array(lr, dtype=np.float32))
            binding.bind_cpu_input(lr_input(group), keep_alive[-1])
        binding.bind_output(ALL_FINITE, "cpu")
        binding.bind_output(GRAD_NORM, "cpu")
        self.optimizer.run_with_iobinding(binding)
        all_finite, norm = binding.get_outputs()[:2]
        self.parity = 1 - self.parity
        return StepResult(bool(all_finite.numpy()), float(norm.numpy()))

    def _require_sessions(self) -> _SessionSet:
        if self._current is None:
            raise RuntimeError("Engine.select(signature) must be called before running a step")
        return self._current

    def _run(self, session: ort.InferenceSession, binding: ort.IOBinding, accepted: set[str],
             feeds: dict[str, np.ndarray]) -> list[torch.Tensor]:
        for name, value in feeds.items():
            if name in accepted:
                binding.bind_cpu_input(name, value)
        for name in self.output_names:  # fresh buffers: returned tensors must not be overwritten
            binding.bind_output(name, self.device_type, self.device_id)
        session.run_with_iobinding(binding)
        values = binding.get_outputs()[: len(self.output_names)]
        return [torch.utils.dlpack.from_dlpack(v._ortvalue.to_dlpack()) for v in values]

    # ---- state access -----------------------------------------------------------------------
    def weights(self) -> dict[str, np.ndarray]:
        """Copies of the current value of every weight (trained and fixed)."""
        current = self.buffers[self.parity]
        out = {n: v.numpy().copy() for n, v in self.fixed.items()}
        out.update({n: current[n].numpy().copy() for n in self.trained})
        return out

    def optimizer_states(self) -> dict[str, dict[str, np.ndarray]]:
        """``{weight: {state: value}}`` copies of the current optimizer states of the updated weights."""
        current = self.buffers[self.parity]
        return {w: {s: current[f"{w}.{s}"].numpy().copy() for s in self.state_names} for w in self.updated}

    def load_optimizer_states(self, states: dict[str, dict[str, np.ndarray]]) -> None:
        """Overwrite optimizer states from whole-weight values (sliced for ZeRO pieces)."""
        current = self.buffers[self.parity]
        for piece in self.pieces or [None]:
            for weight in ([piece.weight] if piece else self.trained):
                if weight not in states:
                    continue
                for state, value in states[weight].items():
                    value = np.asarray(value, dtype=np.float32)
                    if piece is not None:
                        value = value.ravel()[piece.start:piece.stop].reshape(piece.shape)
                    current[f"{piece.name if piece else weight}.{state}"].update_inplace(np.ascontiguousarray(value))

    def accumulated_values(self) -> dict[str, np.ndarray]:
        """Copies of the gradients accumulated so far in the current window."""
        return {w: v.numpy().copy() for w, v in self.accumulated.items()}

    def load_accumulated(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite the accumulated gradients (resuming inside an accumulation window)."""
        for name, value in values.items():
            self.accumulated[name].update_inplace(np.ascontiguousarray(value, dtype=np.float32))

    def load_weights(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite weights in place (names must exist; shapes must match)."""
        for name, value in values.items():
            target = self.buffers[self.parity].get(name) if name in self.trained else self.fixed[name]
            target.update_inplace(np.ascontiguousarray(value, dtype=self._dtypes[name]))
