"""Gradient source ``"torch"``: PyTorch's autograd, exported with the forward as one ONNX graph.

``torch.export`` traces the model with its loss; autograd gives the joint forward/backward
program, which becomes one graph of standard ONNX operators (``autograd.py``), so the
gradients are PyTorch's by construction and any current ONNX Runtime runs them. An ONNX model
with its loss inside is first turned into an equivalent module (``onnx_to_torch.py``).

With gradient accumulation each gradient output returns an accumulator input plus the
micro-batch's gradient (``onnx_graph.sum_into_inputs``): the engine binds the two to one buffer,
so the run adds into it, and no second set of gradient buffers exists (BERT-base: 418 MB).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator, Sequence

import numpy as np
import onnx

from ..._logging import logger
from ..._temporaries import save_model
from .. import passes
from ..export import op_record
from ..export.input_checks import find_input_constraints
from ..export.program_checks import find_program_constraints
from ..export.torchscript import ExportError
from ..job import Built, GradientSource, GraphJob, OpRecord, Prepared, Traced
from ..names import ACCUMULATOR_SUFFIX, GRAD_SUFFIX, LOSS_SCALE_INPUT
from ..onnx_graph import compacted, drop_outputs, drop_unread_inputs, specialize, sum_into_inputs
from . import autograd, kernel_ops, loss_pieces, sparse_labels, torch_export



class TorchGradientSource(GradientSource):
    """PyTorch's autograd, exported to standard ONNX."""

    name = "torch"
    accumulates_in_graph = True
    builds_eval_apart = True

    def accumulation_io(self, trained: list[str]) -> tuple[set[str], str]:
        """Each weight's ``ACCUMULATOR_SUFFIX`` input, and its ``GRAD_SUFFIX`` output returning that
        input plus the micro-batch's gradient (``onnx_graph.sum_into_inputs``). The engine binds both
        to the weight's gradient buffer, so the run adds into it, and zeroes the buffer before an
        accumulation window's first micro-batch."""
        return {w + ACCUMULATOR_SUFFIX for w in trained}, GRAD_SUFFIX

    def trace(self, job: GraphJob, sample_inputs: Sequence[np.ndarray], dims: dict[str, int] | None) -> Traced:
        """``torch.export`` of the model (an ONNX model converted first) with its loss: of exactly
        the sample's shapes when ``dims`` are given (a static graph builds several times faster
        than a symbolic one), else with the description's symbolic dimensions dynamic."""
        if job.extra_postprocess is not None:
            raise ValueError(
                "_internal_use.extra_postprocess edits the forward ONNX graph that ONNX Runtime's gradient builder "
                "differentiates; the 'torch' gradient source differentiates in PyTorch and has no such graph: set "
                "graph.gradient_source='onnxruntime' (needs pip install \"ort_trainer[training]\") or drop the hook")
        model, renamed = job.model, None
        if isinstance(model, onnx.ModelProto):
            from .onnx_to_torch import onnx_to_module

            model, renamed = onnx_to_module(model, job.desc)
        try:
            traced = autograd.trace(model, job.loss_fn, job.desc, sample_inputs, job.frozen_weights,
                                    dynamic=dims is None, unknown_frozen="ignore", autocast=job.autocast,
                                    fused_lstm=_fused_lstm(job))
        except ExportError as exc:
            if dims is None:
                _raise_for_recurrent_layers(model, exc)
            if dims is None or "value per channel" not in str(exc):
                raise
            # A batch PyTorch refuses (one value per training-mode BatchNorm channel) fails a trace of
            # its exact shapes; a symbolic trace does not, and its input checks then refuse the batch
            # with the module named.
            logger.debug("static trace refused the sample (%s); tracing symbolically", exc)
            traced = autograd.trace(model, job.loss_fn, job.desc, sample_inputs, job.frozen_weights,
                                    dynamic=True, unknown_frozen="ignore", autocast=job.autocast,
                                    fused_lstm=_fused_lstm(job))
            dims = None
        _key_pieces(traced, traced.program, job)
        return Traced(traced.fingerprint, traced.torch_keys, traced.trainable, {},
                      program={"traced": traced, "built": None, "renamed": renamed}, dims=dims or None)

    def trace_eval(self, job: GraphJob, sample_inputs: Sequence[np.ndarray],
                   dims: dict[str, int] | None = None) -> Traced:
        """The eval-mode ``torch.export`` alone, of the sample's sizes where ``dims`` fixes them, else
        symbolic: ``build_eval`` takes it (``save_as_onnx`` of GPT-2 small: one export of ~6 s
        instead of two)."""
        if isinstance(job.model, onnx.ModelProto) or job.extra_postprocess is not None:
            return self.trace(job, sample_inputs, dims)
        try:
            traced = autograd.trace(job.model, job.loss_fn, job.desc, sample_inputs, job.frozen_weights,
                                    dynamic=dims is None, unknown_frozen="ignore", autocast=job.autocast,
                                    eval_only=True, fused_lstm=_fused_lstm(job))
        except ExportError as exc:
            if dims is None:
                _raise_for_recurrent_layers(job.model, exc)
            raise
        _key_pieces(traced, traced._job["eval_program"], job)
        return Traced(traced.fingerprint, traced.torch_keys, traced.trainable, {},
                      program={"traced": traced, "built": None, "renamed": None}, dims=dims or None)

    def eval_fingerprint(self, traced: Traced) -> str:
        """The eval-mode program's fingerprint; the training trace leaves eval mode out, so it is
        exported here, on the first evaluation (GPT-2 small: ~1.2 s kept out of the first step)."""
        return autograd.eval_fingerprint(traced.program["traced"])

    def record(self, job: GraphJob, sample_inputs: Sequence[np.ndarray]) -> OpRecord | None:
        """The operators one eager forward per mode runs, with the flags ``torch.export`` sets
        (``op_record.record``) and, with mixed precision, under the trace's autocast (a model
        may branch on ``torch.is_autocast_enabled()``); None for an ONNX model."""
        if isinstance(job.model, onnx.ModelProto) or job.extra_postprocess is not None:
            return None

        @contextlib.contextmanager
        def tracing() -> Iterator[None]:
            with op_record.exporting_flags(), torch_export.autocast_context(job.autocast):
                yield

        return op_record.record(job.model, job.loss_fn, job.desc, sample_inputs, tracing)

    def prepare(self, job: GraphJob, traced: Traced, dims: dict[str, int] | None, outputs: tuple | None,
                input_dtypes: dict[str, str]) -> Prepared:
        """The graphs return the loss and ``outputs`` (every description output when ``outputs`` is
        None). The program is traced for those outputs only where the ``sparse_labels`` pass then
        applies; otherwise it is traced for all of them and the graphs drop the rest
        (``drop_outputs``): an output left in would keep its own buffer, written every step.

        Writes ``model_after_graph_transforms_path`` on a cache hit as on a miss: this source has no
        separate forward graph, so the dump is the forward as ONNX (the eval-mode graph of the
        trace, specialised like the graphs, with the eval passes), exported only when the dump is
        asked for.
        """
        desc = job.desc
        returned = list(desc.output_names)
        wanted = job.returned_outputs(outputs)
        # an eval-only trace (``trace_eval``) has no training program to ask: its eval graph is
        # translated with every output, and the unfetched ones dropped
        training_program = traced.program["traced"].program is not None
        sparse, limit = bool((job.passes or {}).get("sparse_labels")), _pieces_limit(job)
        if outputs is not None and (sparse or limit) and training_program:
            # asked once per trace, before any build (building edits the traced program)
            answers = traced.program.setdefault("outputs_dropped", {})  # {wanted: a pass then applies}
            if tuple(wanted) not in answers:
                program = traced.program["traced"].program
                dropped = sparse_labels.unreturned(program, desc.output_names, wanted)
                answers[tuple(wanted)] = (sparse and sparse_labels.applies(program, dropped)) or (
                    bool(limit) and loss_pieces.applies(program, sparse_labels.live_uses(program, dropped), limit))
            if answers[tuple(wanted)]:
                returned = wanted
        path = job.save_paths.get("model_after_graph_transforms_path")
        if path:  # written here so that a cache hit writes it too
            save_model(_passed_eval_graph(job, traced, returned, wanted, dims), path)
        # the graphs return ``wanted``: outputs traced but not fetched are dropped from them (drop_outputs)
        expected = {"outputs": wanted, "inputs": {n: input_dtypes[n] for n in desc.input_names}}
        readable = {name: None for name in [*traced.torch_keys, *desc.input_names, LOSS_SCALE_INPUT]}
        return Prepared(expected, readable, None, {"dims": dims, "outputs": returned, "wanted": wanted})

    def input_constraints(self, job: GraphJob, traced: Traced) -> dict:
        """Read off the ``torch.export`` program once per trace, before a build rewrites it (an ONNX
        model's own graph tells more than its conversion: its loss is one operator there)."""
        program = traced.program
        if "constraints" not in program:
            if isinstance(job.model, onnx.ModelProto):
                program["constraints"] = find_input_constraints(job.model, job.desc.input_names)
            else:
                program["constraints"] = find_program_constraints(
                    program["traced"].program, job.desc.input_names, program["traced"]._job["weight_of"],
                    {io.name: list(io.shape) for io in job.desc.inputs}, traced.dims)
        return program["constraints"]

    def build(self, job: GraphJob, traced: Traced, prepared: Prepared) -> Built:
        """The joint graphs, built once per trace and set of returned outputs (a shape specialisation
        fixes their input dims); a second set of outputs traces the model again."""
        program, returned = traced.program, prepared.state["outputs"]
        built = program["built"] = program["built"] or {}
        self.input_constraints(job, traced)  # before the build consumes the trace
        if tuple(returned) not in built:
            traced_model = program["traced"]
            if built:  # building consumed the trace
                traced_model = _retrace(traced_model, job.frozen_weights)
            dropped = len(returned) < len(job.desc.output_names)
            passes_on = job.passes or {}
            built[tuple(returned)] = autograd.build(
                traced_model, outputs=returned, with_eval=False,
                sparse_labels=dropped and bool(passes_on.get("sparse_labels")),
                loss_pieces=_pieces_limit(job) if dropped else 0,
                gelu=bool(passes_on.get("gelu")), half_gelu=bool(passes_on.get("half_precision_gelu")),
                kernels={switch for switch in (*kernel_ops.SWITCHES, "torch_convolutions", "torch_batch_norm")
                         if passes_on.get(switch)},
                half_attention=bool(passes_on.get("half_precision_attention")),
                eval_is_training=traced.eval_is_training)
        joint = built[tuple(returned)]
        # a copy: the joint graph stays as built for later specialisations
        gradient = specialize(joint.gradient, prepared.state["dims"] or {})
        drop_outputs(gradient, set(returned) - set(prepared.state["wanted"]))
        logger.debug("joint graph rewrites: %s", passes.apply_joint_passes(gradient, job.passes or {}))
        meta = joint.meta
        if job.accumulate:  # the run adds each gradient into its buffer (``accumulation_io``)
            folded = sum_into_inputs(gradient, {w + GRAD_SUFFIX: w + ACCUMULATOR_SUFFIX for w in meta["trained"]})
            logger.debug("accumulation: %d of %d gradients added by their Gemm, the others by an Add", folded,
                         len(meta["trained"]))
        return Built(compacted(gradient), None, list(meta["trained"]), dict(meta["buffer_updates"]),
                     weights=dict(meta["weights"]), torch_keys=dict(meta["torch_keys"]))

    def build_eval(self, job: GraphJob, traced: Traced, prepared: Prepared) -> onnx.ModelProto:
        """The eval-mode trace translated (~1.5 s for the BERT-like model, so only once an
        ``eval_step`` or ``save_as_onnx`` needs it), with ``sparse_labels`` where the gradient
        graph has it."""
        state = prepared.state
        return _passed_eval_graph(job, traced, state["outputs"], state["wanted"], state["dims"])


def _passed_eval_graph(job: GraphJob, traced: Traced, returned: list[str], wanted: list[str],
                       dims: dict[str, int] | None) -> onnx.ModelProto:
    """The eval graph returning ``wanted``, with the eval passes (``passes.apply_eval_passes``)."""
    model = _eval_graph(job, traced, returned, dims)
    drop_outputs(model, set(returned) - set(wanted))
    logger.debug("eval graph rewrites: %s", passes.apply_eval_passes(model, job.passes or {}))
    drop_unread_inputs(model, job.desc.input_names)
    return compacted(model)


def _eval_graph(job: GraphJob, traced: Traced, returned: list[str], dims: dict[str, int] | None) -> onnx.ModelProto:
    """The eval graph returning ``returned``, specialised to ``dims``: translated once per trace
    and set of outputs (the debug dump and the engine's eval graph share it)."""
    evals = traced.program.setdefault("eval_built", {})
    if tuple(returned) not in evals:
        dropped = len(returned) < len(job.desc.output_names)
        evals[tuple(returned)] = autograd.build_eval(
            traced.program["traced"], outputs=returned,
            sparse_labels=dropped and bool((job.passes or {}).get("sparse_labels")),
            loss_pieces=_pieces_limit(job) if dropped else 0,
            half_attention=bool((job.passes or {}).get("half_precision_attention")))
    return specialize(evals[tuple(returned)], dims or {})  # a copy: the translation serves every specialisation


def _pieces_limit(job: GraphJob) -> int:
    """The ``loss_pieces`` pass's piece size (logits elements) where the pass is on, else 0."""
    passes_on = job.passes or {}
    return int(passes_on.get("loss_piece_elements") or 0) if passes_on.get("loss_pieces") else 0


def _key_pieces(traced: autograd.TracedModel, program: object, job: GraphJob) -> None:
    """Fold the pieces ``loss_pieces`` cuts the loss into into the trace's fingerprint: they come from
    the traced sample's sizes, which a symbolic program's code leaves out."""
    limit = _pieces_limit(job)
    count = loss_pieces.pieces(program, limit) if limit and program is not None else 1
    if count > 1:
        traced.fingerprint = hashlib.sha256(f"{traced.fingerprint}/loss_pieces={count}".encode()).hexdigest()


def _raise_for_recurrent_layers(model: object, exc: ExportError) -> None:
    """Re-raise a symbolic trace's specialisation error, naming the recurrent layers that cause it.

    Raises:
        ExportError: when ``model`` has ``nn.RNN``/``nn.LSTM``/``nn.GRU`` layers and ``exc`` says
            a symbolic dimension was fixed (``torch.export`` unrolls them over the sequence).
    """
    import torch

    if not isinstance(model, torch.nn.Module) or not ("specializ" in str(exc) or "Constraints violated" in str(exc)):
        return
    layers = [f"{name} ({type(module).__name__})" for name, module in model.named_modules()
              if isinstance(module, torch.nn.RNNBase)]
    if layers:
        raise ExportError(
            f"the model's recurrent layer(s) {', '.join(layers)} cannot be traced with a symbolic sequence length: "
            "torch.export unrolls them over the sequence, which fixes that dimension (all but an nn.LSTM that "
            "graph_optimizations.fused_lstm runs as one operator per layer: on the CPU, a float32 batch that is not "
            "packed, no proj_size, no mixed precision). The 'torch' gradient source "
            "trains them with graphs of each batch's exact shapes (graph_optimizations.shape_specialization, the "
            "default) but cannot build the symbolic graph that save_as_onnx or more than "
            "graph_optimizations.max_shape_graphs shapes need: declare the sequence length as an int in "
            "model_desc, or use graph.gradient_source='onnxruntime' (pip install \"ort_trainer[training]\"), whose "
            f"exporter keeps them as ONNX RNN operators. ({exc})") from exc


def _fused_lstm(job: GraphJob) -> bool:
    """Whether the trace computes ``torch.lstm`` as oneDNN's LSTM layers (``graph_optimizations.fused_lstm``)."""
    return bool((job.passes or {}).get("fused_lstm"))


def _retrace(traced: autograd.TracedModel, frozen_weights: Sequence[str]) -> autograd.TracedModel:
    """The same ``torch.export`` trace again (a build consumes its trace)."""
    job = traced._job
    return autograd.trace(job["model"], job["loss_fn"], job["desc"], [a.numpy() for a in job["args"][:-1]],
                          frozen_weights, dynamic=job["dynamic_shapes"] is not None, autocast=job.get("autocast"),
                          fused_lstm=job["fused_lstm"])


__all__ = ["TorchGradientSource"]
