"""ONNX Runtime sessions with the engine's options, and buffers bound to them in place.

Below both the engine (``engine.py``), which makes the gradient and eval sessions, and the optimizer
update (``update.py``), which makes the optimizer graph's: one ``Sessions`` per engine holds the
session options, the execution providers of the engine's device and what ONNX Runtime copies at
binding time.
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import torch

from . import kernels
from .kernels import torch_ops
from ._logging import logger
from ._optimized_graphs import OptimizedGraphs
from ._run_errors import ONNXRUNTIME_ERRORS, explain, node_modules
from .devices import Device


class Sessions:
    """Makes sessions and binds buffers for one engine.

    Args:
        placement: the engine's device (``devices.Device``).
        options: the session options every session gets (but those below).
        providers: the execution providers and their options.
        disabled_optimizers: ONNX Runtime graph optimizers turned off.
        optimized: where sessions find the optimized graphs earlier processes saved, and save theirs
            (``_optimized_graphs.py``); None: every session optimizes its graph.
        torch_kernel_options: the session options of graphs with nodes of torch's kernels
            (``Device.torch_kernels_spin``: without spinning threads); None: ``options`` for them too.
    """

    def __init__(self, placement: Device, options: ort.SessionOptions, providers: list,
                 disabled_optimizers: list[str], optimized: OptimizedGraphs | None = None,
                 torch_kernel_options: ort.SessionOptions | None = None):
        self.placement = placement
        self._optimized = optimized
        self.options = options
        self._torch_kernel_options = torch_kernel_options
        self._providers = providers
        self._disabled_optimizers = disabled_optimizers
        self._copied_inputs: dict[int, set[str]] = {}  # by id(session): see bind_buffer
        self._rebinds: dict[int, list[tuple[str, torch.Tensor]]] = {}  # by id(binding)
        self._phase: tuple[bool | None, int] = (None, 0)  # (training, runs) of the engine's current phase
        # by id(session): its graph, weights apart (GPT-2 small's training graph: 1.6 MB; the pipeline keeps most of
        # them anyway), read for its nodes' modules only when a run fails (``explain``: 24 ms for that graph)
        self._models: dict[int, onnx.ModelProto] = {}
        #: op type -> how many nodes computing floating-point values ONNX Runtime placed on another provider than
        #: the device's, over every session made (``check_placement``)
        self.placed_elsewhere: dict[str, int] = {}
        #: whether a session with nodes of torch's kernels was made: they run on torch's threads, so a training step
        #: leaves torch's thread count as it is for the run (``devices.host_threads``)
        self.runs_torch_kernels = False

    def make_session(self, model: onnx.ModelProto, capture: bool = False) -> ort.InferenceSession:
        """A session of ``model`` with these session options and execution providers, once the
        device has found nothing in the graph it cannot run (``Device.check_graph``); ``capture``:
        its runs are captured as a graph and replayed where the device can (``Device.capture_providers``)."""
        self.placement.check_graph(model)
        options = self.options
        if torch_ops.uses_torch_ops(model):  # torch's kernels (fused_attention, torch_products, fused_lstm, CTC)
            options = self._torch_kernel_options or self.options
            self.runs_torch_kernels = True
            torch_ops.register(options, cuda=self.placement.kind == "cuda")
        if kernels.uses_kernels(model):  # nodes of ort_trainer's own kernel library
            kernels.register(options, cuda=self.placement.kind == "cuda")
        data = model.SerializeToString()
        providers = self.placement.capture_providers(self._providers) if capture else self._providers
        if self._optimized is not None:
            session = self._optimized.session(data, options, providers, self._disabled_optimizers)
        else:
            session = ort.InferenceSession(data, options, providers=providers,
                                           disabled_optimizers=self._disabled_optimizers)
        self._models[id(session)] = model
        self.check_placement(session, model)
        return session

    def check_placement(self, session: ort.InferenceSession, model: onnx.ModelProto) -> None:
        """Warn about what ONNX Runtime placed off the device's provider (``Device.provider``) in ``session``, and
        count it by op type in ``placed_elsewhere``: the nodes of ``model`` that compute floating-point values on
        another provider (no kernel for their types there), and the copies between the device and the host it put
        inside the graph (``MemcpyToHost`` / ``MemcpyFromHost``, around any node on the host that a device node
        reads or that reads one). Each copy waits for the device within the run, and a session with them cannot be
        captured (``device.cuda_graph``). The shape computations ONNX Runtime keeps on the host on purpose, with no
        copy, are logged at DEBUG only. Nothing where the runtime does not record the placement."""
        assignment = getattr(session, "get_provider_graph_assignment_info", None)
        try:
            placed = [(sub.ep_name, node) for sub in assignment() for node in sub.get_nodes()] if assignment else []
        except (RuntimeError,) + ONNXRUNTIME_ERRORS:  # (a session whose options do not record it)
            return
        elsewhere = [(provider, node.op_type, node.name) for provider, node in placed
                     if provider != self.placement.provider]
        copies = [(provider, node.op_type, node.name) for provider, node in placed
                  if node.op_type in ("MemcpyToHost", "MemcpyFromHost")]
        if not elsewhere and not copies:
            return
        logger.debug("nodes placed off %s: %s", self.placement.provider, _listed(elsewhere, len(elsewhere)))
        floats = _float_valued_nodes(model, {name for _, _, name in elsewhere})
        moved = [(provider, op, name) for provider, op, name in elsewhere if name in floats]
        for _, op, _ in moved + copies:
            self.placed_elsewhere[op] = self.placed_elsewhere.get(op, 0) + 1
        if moved:
            logger.warning(
                "%d node(s) of this graph compute on another provider than %s, their inputs and outputs copied "
                "between %s and the host every run (ONNX Runtime has no %s kernel for their types): %s",
                len(moved), self.placement.provider, self.placement.torch_device, self.placement.provider,
                _listed(moved))
        if copies:
            logger.warning(
                "ONNX Runtime copies %d tensor(s) between %s and the host inside each run of this graph (%s), around "
                "the nodes it runs on the host: %s. Each copy waits for the device, and device.cuda_graph cannot "
                "capture such a graph", len(copies), self.placement.torch_device, _listed(copies),
                _listed(elsewhere) or "none")

    def run(self, session: ort.InferenceSession, binding: ort.IOBinding, what: str, feeds: dict,
            training: bool, run_options: ort.RunOptions | None = None) -> None:
        """Run ``binding`` on ``session``. ONNX Runtime's error is raised as a ``StepError`` that says
        ``what`` failed, names the shapes of ``feeds`` (the step's inputs) and the module of the
        failing node (``_run_errors.explain``; ``training``: accumulation is advice that fits)."""
        try:
            session.run_with_iobinding(binding, run_options)
        except (RuntimeError, MemoryError) + ONNXRUNTIME_ERRORS as exc:
            model = self._models.get(id(session))
            raise explain(exc, what, feeds, node_modules(model) if model is not None else {}, training,
                          gpu=self.placement.torch_device.type == "cuda") from exc

    def bind_buffer(self, session: ort.InferenceSession, binding: ort.IOBinding, name: str,
                    tensor: torch.Tensor) -> None:
        """Bind a buffer that ``session`` reads in place. One that ONNX Runtime copies when it is
        bound instead (its consumers run on another device) is bound again before every run, or
        the session would keep reading the value it had at binding time."""
        copied = self._copied_inputs.get(id(session))
        if copied is None:
            copied = self._copied_inputs[id(session)] = self.placement.inputs_copied_at_binding(session)
            if copied:
                logger.warning("ONNX Runtime reads %s from another device than %s (their consumers have no kernel "
                               "there); they are copied before every run", ", ".join(sorted(copied)),
                               self.placement.torch_device)
        self.placement.bind_input(binding, name, tensor)
        if name in copied:
            self._rebinds.setdefault(id(binding), []).append((name, tensor))

    def begin_run(self, training: bool) -> None:
        """Note that the engine is about to run its gradient graph (``training``) or an eval graph.

        Where it goes from one to the other after two runs or more of the first, the memory the
        arena holds idle goes back to the system before (``Device.release_idle_memory``). The shared
        arena grows by regions of exactly the sizes asked for and never joins two, so graphs whose
        tensors have other sizes keep regions of their own: BERT-base at B4×S512, whose training graph
        computes the logits of the labelled rows only, peaked at 4083 MB evaluating every output
        (the 250 MB logits and their log-probabilities) after training, against 3572 MB for training
        alone, and at 3592 MB with the release, through train and eval phases in turn. The next run
        takes its memory anew: the first evaluation and the first step after a change took
        ~0.3-0.4 s more there (GPT-2 small at B4×S128: ~0.1-0.2 s). A phase of a single run (a loop
        that evaluates after every step) keeps the regions, as a release per step would cost 5-10%.
        """
        phase, runs = self._phase
        if training != phase:
            if runs >= 2:
                self.placement.release_idle_memory()
            phase, runs = training, 0
        self._phase = (phase, runs + 1)

    def before_run(self, binding: ort.IOBinding) -> None:
        """Order a run of ``binding`` after torch's work and rebind what ONNX Runtime copies at binding."""
        self.placement.synchronize()  # first: the copies below read buffers torch may still be writing
        for name, tensor in self._rebinds.get(id(binding), ()):
            self.placement.bind_input(binding, name, tensor)


__all__ = ["Sessions"]


def _listed(nodes: list[tuple[str, str, str]], most: int = 10) -> str:
    """``op 'name' (provider)`` of the first ``most`` of ``nodes``, and how many more."""
    shown = ", ".join(f"{op} {name!r} ({provider})" for provider, op, name in nodes[:most])
    return shown + (f" and {len(nodes) - most} more" if len(nodes) > most else "")


_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def _float_valued_nodes(model: onnx.ModelProto, names: set[str]) -> set[str]:
    """Those of the nodes ``names`` of ``model`` with a floating-point output (by its value infos, else by ONNX's
    type inference; a name that is not a node of ``model``, one ONNX Runtime's optimizers made, counts as
    floating-point)."""
    graph = model.graph
    nodes = [node for node in graph.node if node.name in names]
    types = {info.name: info.type.tensor_type.elem_type for info in [*graph.value_info, *graph.output]}
    if any(name not in types for node in nodes for name in node.output if name):
        inferred = onnx.shape_inference.infer_shapes(model).graph.value_info
        types.update({info.name: info.type.tensor_type.elem_type for info in inferred if info.name not in types})
    known = {node.name for node in graph.node}
    return ({node.name for node in nodes if any(types.get(name) in _FLOATS for name in node.output)}
            | {name for name in names if name not in known})
