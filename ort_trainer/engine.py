"""The engine: ONNX Runtime sessions over buffers the trainer owns.

Weights, gradients and optimizer states are torch tensors on the engine's device (``devices.py``:
the CPU or a GPU) that live across steps; each session binds them once (IOBinding) and reads and
writes them in place, so a step copies nothing but its inputs, and its outputs come back as torch
tensors on the device (DLPack). Nothing a step computes becomes
current until the trainer commits it (``update.commit``, ``commit_buffers``), so a step that
fails or is refused half-way changes no state.

The optimizer step is the engine's ``update`` (``update.py``): torch's fused kernels in place over
the flat buffers, which then hold weights and optimizer states once, or the ONNX optimizer graph,
for which they are double-buffered (it reads set ``p`` and writes set ``1 - p``, then the sets
swap, so no node can read a weight after it was overwritten in the same run). With one set,
``weights_flat``, ``states_flat`` and ``buffers`` hold the same object at both parities and
``parity`` stays 0.

Graphs that depend on input shapes (gradient and eval) are held per *shape signature*: the
trainer asks ``select(signature)`` before each step and the engine builds the sessions for a new
signature on demand from ``graph_provider``. The optimizer graph is shape-independent.
"""

from __future__ import annotations

from typing import Callable, Hashable

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ._logging import ort_severity
from ._optimized_graphs import OptimizedGraphs
from ._run_errors import StepError
from .devices import Device, make_device
from ._signature_sessions import SessionSet
from ._step_io import CapturedIO, FreshIO
from .graph.cache import cache_dir
from .graph.names import LOSS_SCALE_INPUT, RESET_INPUT
from .optim.config import _OptimizerConfig
from .sessions import Sessions
from .update import OptimizerUpdate, update_class

GraphProvider = Callable[[Hashable], "tuple[Callable[[], onnx.ModelProto], Callable[[], onnx.ModelProto]]"]


def _numpy(tensor: torch.Tensor, copy: bool = True) -> np.ndarray:
    """A NumPy copy of a buffer on any device (``copy=False``: a view of a CPU buffer)."""
    array = tensor.detach().cpu().numpy()
    return array.copy() if copy else array


def _fill(target: torch.Tensor, value, dtype: np.dtype, start: int = 0, stop: int | None = None) -> None:
    """Write ``value``'s flat elements ``[start, stop)`` (as ``dtype``) into ``target``, a contiguous buffer.

    ``value`` is an array or has ``read_into(out, start, stop)`` (a checkpoint's unread array): into
    a CPU buffer that reads straight from the file, with no copy of the value in memory at any time.
    """
    if target.device.type == "cpu" and target.is_contiguous() and hasattr(value, "read_into"):
        value.read_into(target.numpy().reshape(-1), start, stop)
        return
    flat = np.ascontiguousarray(value, dtype=dtype).reshape(-1)[start:stop]
    target.copy_(torch.from_numpy(flat).view(target.shape))


class Engine:
    """Runs forward/backward, the optimizer and eval over trainer-owned ONNX Runtime buffers.

    Args:
        graph_provider: ``signature -> (gradient_graph_maker, eval_graph_maker)``; each graph is
            asked for on the first training step (``select(training=True)``) or the first
            evaluation of that signature.
        weights: initial value of every weight input.
        trained: the weights the optimizer updates.
        state_names: per-weight optimizer state names (``Moment_1``, ...).
        output_names: the description's outputs, in order.
        device: ``"cpu"`` or ``"cuda[:N]"``.
        session_options: base ``onnxruntime.SessionOptions`` (or None).
        provider_options: extra execution-provider options.
        mem_limit: GPU arena limit in bytes (0: none).
        torch_allocator: ONNX Runtime's GPU memory from torch's caching allocator (``device.torch_allocator``).
        deterministic: ask for deterministic kernels.
        optimizer_spec: the optimizer graph, flat layout, segments and ZeRO range (``pipeline.OptimizerSpec``).
        optimizer_config: the optimizer config the update implements.
        grad_norm_clip: clip the global gradient norm (Adam and Lamb).
        optimizer_implementation: ``graph.optimizer``: ``"fused"`` (torch's fused kernels in place
            where their formula is the config's, else the graph) or ``"graph"``.
        host_accumulation: sum micro-batch gradients on the host (after their all-reduce).
        intra_op_threads: threads per session when no session_options are given (0: default).
        buffer_updates: ``{buffer: gradient-graph output}``: the buffer's new value each step
            (committed by ``commit_buffers``).
        unfused_skip_layer_norm: ``graph_optimizations.unfused_skip_layer_norm`` (the device
            decides which ONNX Runtime optimizers that turns off: ``Device.disabled_optimizers``).
        graph_capture: capture each training step's run as a CUDA graph and replay it
            (``device.cuda_graph``): every input and output of the gradient session at a fixed address
            (``_step_io.CapturedIO``); on a device without capture, the fixed buffers alone.
        release_weights: called with ``live_buffers()`` as soon as they hold the weights, before the
            gradients and optimizer states are allocated; ``weights`` is emptied first (its arrays
            may be views of the caller's memory). The trainer points the module's tensors at the
            buffers there, so the module's own copy is freed before the engine's other buffers
            exist: a 656 M-weight model's peak is then not raised by a second 2.6 GB of weights.

    Attributes:
        update: the optimizer step (``update.OptimizerUpdate``): ``step`` then ``commit``.

    Raises:
        RuntimeError: when ``device`` cannot be used here (``devices.device_problem`` says why).
        ValueError: when ``provider_options`` name another GPU than ``device``, or for an unknown
            ``optimizer_implementation``.
        TypeError: for a trained weight that is not float32.
    """

    def __init__(
        self,
        graph_provider: GraphProvider,
        weights: dict[str, np.ndarray],
        trained: list[str],
        state_names: list[str],
        output_names: list[str],
        optimizer_spec,
        optimizer_config: _OptimizerConfig,
        device: str = "cpu",
        session_options: ort.SessionOptions | None = None,
        provider_options: dict | None = None,
        mem_limit: int = 0,
        torch_allocator: bool = False,
        deterministic: bool = False,
        host_accumulation: bool = False,
        intra_op_threads: int = 0,
        buffer_updates: dict[str, str] | None = None,
        grad_norm_clip: bool = True,
        optimizer_implementation: str = "fused",
        unfused_skip_layer_norm: bool = True,
        release_weights: Callable[[dict[str, torch.Tensor]], None] | None = None,
        graph_capture: bool = False,
    ):
        update = update_class(optimizer_implementation, optimizer_config)
        self.placement: Device = make_device(device)
        self.device = self.placement.torch_device
        self._providers = self.placement.providers(provider_options, mem_limit, deterministic, torch_allocator)

        def engine_options(spinning: bool = True) -> ort.SessionOptions:
            options = ort.SessionOptions()  # the user's own session options are used as given
            options.log_severity_level = ort_severity()
            self.placement.configure_session(options)
            if not spinning:
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            if intra_op_threads:
                options.intra_op_num_threads = intra_op_threads
            options.use_deterministic_compute = deterministic
            return options

        if session_options is not None:
            session_options.log_severity_level = ort_severity()
            if deterministic:
                session_options.use_deterministic_compute = True
        self._session_options = session_options or engine_options()
        # ONNX Runtime's optimized graphs reused across processes: with the engine's own session options only
        optimized_root = cache_dir() if session_options is None and self.placement.reuses_optimized_graphs else None
        self.sessions = Sessions(self.placement, self._session_options, self._providers,
                                 self.placement.disabled_optimizers(unfused_skip_layer_norm),
                                 OptimizedGraphs(optimized_root / ".optimized") if optimized_root else None,
                                 None if session_options is not None or self.placement.torch_kernels_spin
                                 else engine_options(spinning=False))
        self.trained = list(trained)
        self.state_names = list(state_names)
        self.output_names = list(output_names)
        self.host_accumulation = host_accumulation
        self.graph_capture = graph_capture
        self.buffer_updates = dict(buffer_updates or {})
        not_float32 = [w for w in trained if np.asarray(weights[w]).dtype != np.float32]
        if not_float32:
            raise TypeError(f"trained weights must be float32; these are not: {not_float32} "
                            "(convert the model with model.float(), or freeze them)")
        self._dtypes = {n: np.asarray(v).dtype for n, v in weights.items()}
        self.parity = 0
        # fixed: weights nobody updates (frozen weights, buffers)
        trained_set = set(trained)
        self.fixed_tensors = {n: self._tensor(v) for n, v in weights.items() if n not in trained_set}
        self.buffer_scratch = {n: torch.empty_like(self.fixed_tensors[n]) for n in self.buffer_updates}
        self.buffer_inputs = {n: torch.empty_like(self.fixed_tensors[n]) for n in self.buffer_updates}

        # Trained weights, gradients and optimizer states live in flat float32 tensors laid out as
        # ``optimizer_spec.layout`` (group by group); each weight is a view into them. Weights and
        # states are double-buffered (parity 0/1) for the graph update only. Collectives are one
        # call on a flat tensor.
        self.layout = list(optimizer_spec.layout)
        self.shapes = {w: tuple(np.shape(weights[w])) for w in self.layout}
        sizes = [int(np.prod(self.shapes[w])) for w in self.layout]
        self.offsets = dict(zip(self.layout, np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()))
        total = int(sum(sizes))
        self.begin, self.end = optimizer_spec.begin, optimizer_spec.end
        self.segments = list(optimizer_spec.segments)
        zeros = lambda size: torch.zeros(size, dtype=torch.float32, device=self.device)  # noqa: E731
        self._double_buffered = update.double_buffered
        # the live weights are all written by _copy_weights below: no zeroing pass first (a 656 M-weight
        # model's 2.6 GB zeroed then copied took 2-4 s on the 2-core machine, left uninitialised 1-2 s)
        written = set(self.layout) <= trained_set
        self.weights_flat = self.per_parity(lambda p: torch.empty(total, dtype=torch.float32, device=self.device)
                                            if p == self.parity and written else zeros(total))
        self.buffers: list[dict[str, torch.Tensor]] = self.per_parity(
            lambda p: self._weight_views(self.weights_flat[p]))
        self._copy_weights({w: weights[w] for w in trained})
        if release_weights is not None:
            # before anything else is allocated: the caller's copy of the weights can go first
            weights.clear()  # its arrays may be views of that copy
            release_weights(self.live_buffers())
        self.states_flat = self.per_parity(lambda p: {s: zeros(self.end - self.begin) for s in state_names})
        self.grads_flat = zeros(total)
        self.grads = self._weight_views(self.grads_flat)
        if host_accumulation:
            self.accumulated_flat = zeros(total)
            self.accumulated = self._weight_views(self.accumulated_flat)
        else:
            self.accumulated_flat, self.accumulated = self.grads_flat, self.grads
        self._graph_provider = graph_provider
        self._session_sets: dict[Hashable, SessionSet] = {}
        self._current: SessionSet | None = None
        self.update: OptimizerUpdate = update(self, optimizer_spec.graph, optimizer_config, grad_norm_clip)

    # ---- set-up helpers -------------------------------------------------------------------
    def per_parity(self, make: Callable[[int], object]) -> list:
        """``[make(0), make(1)]`` with double buffering, else ``[x, x]`` with ``x = make(0)``: one object."""
        first = make(0)
        return [first, make(1) if self._double_buffered else first]

    def _tensor(self, value: np.ndarray) -> torch.Tensor:
        """A contiguous tensor on the engine's device holding a copy of ``value``."""
        return torch.from_numpy(np.array(value, order="C")).to(self.device)  # np.array keeps a 0-d shape

    def _weight_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """One view per trained weight: its part of ``flat``, in its shape."""
        return {w: self._view(flat, w) for w in self.offsets}

    def _view(self, flat: torch.Tensor, weight: str) -> torch.Tensor:
        """``weight``'s part of a whole-layout flat tensor, in its shape (a view)."""
        o = self.offsets[weight]
        return flat[o:o + int(np.prod(self.shapes[weight]))].view(self.shapes[weight])

    def accumulate_on_host(self, reset: bool) -> None:
        """Add this micro-batch's (all-reduced) gradients into the accumulation buffers."""
        if reset:
            self.accumulated_flat.copy_(self.grads_flat)
        else:
            self.accumulated_flat.add_(self.grads_flat)

    def _bind_weights(self, session: ort.InferenceSession, parity: int, outputs: list[str] = (),
                      replaced: dict[str, torch.Tensor] | None = None) -> ort.IOBinding:
        binding = session.io_binding()
        for name in outputs:  # first: get_outputs() lists outputs in first-binding order
            self.placement.bind_fresh_output(binding, name)
        names = {i.name for i in session.get_inputs()}
        for name, tensor in [*{**self.fixed_tensors, **(replaced or {})}.items(), *self.buffers[parity].items()]:
            if name in names:
                self.sessions.bind_buffer(session, binding, name, tensor)
        return binding

    # ---- steps ------------------------------------------------------------------------------
    def select(self, signature: Hashable, training: bool = True) -> None:
        """Use the graphs of shape signature ``signature``, making their gradient session if new
        and ``training`` (an evaluation makes the eval session alone, on its first run)."""
        sessions = self._session_sets.get(signature)
        if sessions is None:
            gradient, eval_model = self._graph_provider(signature)
            sessions = self._session_sets[signature] = SessionSet(self, gradient, eval_model)
        if training:
            sessions.make_training()
        self._current = sessions

    def forward_backward(self, feeds: dict[str, np.ndarray], loss_scale: float = 1.0,
                         reset: bool = True, seed: int | Callable[[], int] | None = None) -> dict[str, torch.Tensor]:
        """Run forward + backward; returns the outputs.

        Gradients of ``loss * loss_scale`` land in ``self.grads``: written over them, or with an
        accumulating graph added to them unless ``reset`` (first micro-batch of a window). New
        values of forward-updated buffers land in scratch buffers until ``commit_buffers``.

        Args:
            seed: reseeds ONNX Runtime's default random generator first. Dropout nodes draw
                their masks from it (each run takes the next seeds in node order), so masks are a
                function of ``seed`` alone: a resumed run draws the same masks as an uninterrupted one.
                Masks the host draws (``dropout_masks``) come from ``seed`` too. A callable is asked
                for the seed only when the graph draws random numbers.
        """
        sessions = self._require_sessions().training
        if sessions is None:
            raise RuntimeError("Engine.select(signature, training=True) must be called before a training step")
        self.sessions.begin_run(training=True)
        draws = sessions.draws_random_numbers or bool(sessions.dropout_masks)
        value = (seed() if callable(seed) else seed) if seed is not None and draws else None
        if value is not None and sessions.draws_random_numbers:
            ort.set_seed(value)
        masks = {}
        if sessions.dropout_masks:  # the host_dropout_masks pass: the same seed, NumPy's generator
            masks = sessions.dropout_masks.draw(value if value is not None else np.random.SeedSequence().entropy)
        for name, tensor in self.buffer_inputs.items():
            tensor.copy_(self.fixed_tensors[name])
        io = sessions.grad_io[self.parity]
        extra = {LOSS_SCALE_INPUT: np.array(loss_scale, dtype=np.float32)}
        if sessions.resets_in_graph:
            extra[RESET_INPUT] = np.array([reset], dtype=np.bool_)
        elif sessions.accumulates and reset:
            self.grads_flat.zero_()
        try:
            outputs = self._run(sessions.gradient, io, {**feeds, **extra, **masks}, sessions.gradient_inputs,
                                data=feeds)
        except StepError as exc:
            if sessions.accumulates and not reset:  # the run adds into the window's sums as it goes
                exc.args = (f"{exc} The gradients this accumulation window summed so far may hold part of this "
                            "micro-batch: resume from the last checkpoint.",)
            raise
        for weight, (index, rows) in sessions.table_rows.items():  # in place, as PyTorch's AccumulateGrad
            gradient = self.grads[weight]
            gradient.index_add_(0, outputs.pop(index), outputs.pop(rows).to(gradient.dtype))
        return outputs

    def evaluate(self, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Run the eval graph with the current weights. Returns the outputs by name."""
        self.sessions.begin_run(training=False)  # first: the eval session may be made now
        session, io, inputs = self._require_sessions().evaluation()
        return self._run(session, io[self.parity], feeds, inputs, data=feeds)

    def commit_buffers(self) -> list[str]:
        """Write the last step's new buffer values (BatchNorm statistics) into the buffers.

        Returns the buffers left unchanged because their new value was not finite (a NaN or inf
        batch would otherwise poison running statistics for good).
        """
        rejected = []
        for name, scratch in self.buffer_scratch.items():
            if scratch.is_floating_point() and not bool(torch.isfinite(scratch).all()):
                rejected.append(name)
            else:
                self.fixed_tensors[name].copy_(scratch)
        return rejected

    def _require_sessions(self) -> SessionSet:
        if self._current is None:
            raise RuntimeError("Engine.select(signature) must be called before running a step")
        return self._current

    def _run(self, session: ort.InferenceSession, io: FreshIO | CapturedIO, feeds: dict[str, np.ndarray],
             inputs: set[str], data: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Run ``io``'s binding with the ``feeds`` that are among ``inputs``; returns its outputs by
        name. An ONNX Runtime error is raised as a ``StepError`` naming the shapes of the step's
        ``data`` inputs and the failing node's module."""
        for name, value in feeds.items():
            if name in inputs:
                io.feed(name, value)
        self.sessions.before_run(io.binding)
        training = session is getattr(self._current.training, "gradient", None)
        return io.run(self.sessions, session, "the training step (forward and backward)" if training else
                      "the evaluation", data, training)

    # ---- state access -----------------------------------------------------------------------
    def weights(self, copy: bool = True) -> dict[str, np.ndarray]:
        """Copies of the current value of every weight (trained and fixed); ``copy=False``: views
        of the buffers where they are in host memory, valid until the next step (a checkpoint
        writes them one at a time instead of copying them all first)."""
        return {n: _numpy(v, copy) for n, v in self.current_tensors().items()}

    def live_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers that hold each weight's current value from step to step, by weight name:
        a view of the flat weights for a trained weight, the fixed tensor for a frozen weight or a
        buffer. Empty when the weights are double-buffered (the current set changes every step).

        A module whose parameters are these tensors (``ORTTrainer`` does this on the CPU) holds
        no second copy of the weights and sees every committed update.
        """
        return {} if self._double_buffered else self.current_tensors()

    def current_tensors(self) -> dict[str, torch.Tensor]:
        """The buffers holding every weight's current value (trained and fixed), by name: no
        copies, valid until the next step."""
        return {**self.fixed_tensors, **self.buffers[self.parity]}

    def state_arrays(self, copy: bool = True) -> dict[str, np.ndarray]:
        """The current optimizer states as flat arrays over ``[begin, end)`` of the layout (copies,
        or views as in ``weights``)."""
        return {s: _numpy(t, copy) for s, t in self.states_flat[self.parity].items()}

    def optimizer_states(self, full: dict[str, np.ndarray] | None = None,
                         copy: bool = True) -> dict[str, dict[str, np.ndarray]]:
        """``{weight: {state: value}}`` copies (or views, as in ``weights``), from ``full``
        (whole-layout arrays) or this process's range.

        Without ``full`` only the weights inside ``[begin, end)`` are returned (all of them without ZeRO).
        """
        source, base = (full, 0) if full is not None else (self.state_arrays(copy), self.begin)
        out = {}
        for w, o in self.offsets.items():
            size = int(np.prod(self.shapes[w]))
            if full is None and not (self.begin <= o and o + size <= self.end):
                continue
            views = {s: source[s][o - base:o - base + size].reshape(self.shapes[w]) for s in self.state_names}
            out[w] = {s: v.copy() for s, v in views.items()} if copy else views
        return out

    def load_optimizer_states(self, states: dict[str, dict[str, np.ndarray]]) -> None:
        """Overwrite optimizer states from whole-weight values (the part inside ``[begin, end)``)."""
        self.update.values_loaded()
        current = self.states_flat[self.parity]
        for w, values in states.items():
            o = self.offsets[w]
            lo, hi = max(o, self.begin), min(o + int(np.prod(self.shapes[w])), self.end)
            if lo >= hi:
                continue
            for state, value in values.items():  # a read copy (if any) lives only inside _fill
                _fill(current[state][lo - self.begin:hi - self.begin], value, np.float32, lo - o, hi - o)

    def accumulated_values(self) -> dict[str, np.ndarray]:
        """Copies of the gradients accumulated so far in the current window."""
        return {w: _numpy(self._view(self.accumulated_flat, w)) for w in self.offsets}

    def load_accumulated(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite the accumulated gradients (resuming inside an accumulation window)."""
        for name, value in values.items():
            _fill(self._view(self.accumulated_flat, name), value, np.float32)

    def load_weights(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite weights in place (names must exist; shapes must match)."""
        self.update.values_loaded()
        self._copy_weights(values)

    def _copy_weights(self, values: dict[str, np.ndarray]) -> None:
        for name, value in values.items():
            if name in self.offsets:
                _fill(self._view(self.weights_flat[self.parity], name), value, np.float32)
            else:
                _fill(self.fixed_tensors[name], value, self._dtypes[name])
