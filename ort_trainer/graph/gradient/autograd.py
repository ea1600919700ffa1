"""Gradient source without a training build: forward + loss + backward from PyTorch's autograd.

``torch.export`` traces the model with its loss (``trace``); autograd, run over that program
with core-ATen decompositions, gives the joint forward/backward program, which is translated to
one ONNX graph of standard operators (``build``; the ONNX side is ``joint_onnx.py``). The
gradients are PyTorch's by construction: Dropout masks drawn once in the forward (ONNX
``Dropout`` without a seed, so ONNX Runtime's default generator, which ``onnxruntime.set_seed``
reseeds, draws them) and reused by the backward; BatchNorm running statistics updated exactly as
torch updates them; the embedding ``padding_idx`` rule; frozen and tied weights. The graphs run
on ``onnxruntime`` 1.31 and on the 1.19.2 training build alike (opset 18, IR version 10).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import numpy as np
import onnx
import torch

from ..._logging import logger
from ...model_desc import ModelDescription
from ..export import program as _traced_program
from ..export.guard import _model_left_untouched
from ..export.torchscript import ExportError, MODEL_PREFIX, export_order
from ..names import GRAD_SUFFIX, LOSS_SCALE_INPUT, UPDATED_SUFFIX
from . import (attention as torch_attention, attention_ops, batch_norm_ops, before_autograd, conv_ops, eval_program,
               gelu as torch_gelu, joint_onnx, kernel_ops, loss_pieces as torch_loss_pieces,
               sparse_labels as torch_sparse_labels, torch_export)
from .torch_export import _first_line


@dataclass
class TracedModel:
    """The model traced by ``torch.export`` in training mode, before any gradient work.

    Attributes:
        fingerprint: SHA-256 of the traced program (graph code, signature, non-weight constants,
            weight names/shapes/dtypes/requires_grad) and of the trace settings; a cache key.
        torch_keys: ``{weight: [torch state_dict keys]}`` of every parameter and persistent
            buffer, named by its first key (tied weights once).
        trainable: weights that require grad and are not frozen, in model order.
        program: the ``torch.export`` program (consumed by ``build``).
        seconds: how long ``torch.export`` took.
    """

    fingerprint: str
    torch_keys: dict[str, list[str]]
    trainable: list[str]
    program: Any
    seconds: float
    _job: dict = field(default_factory=dict, repr=False)


@dataclass
class JointGraphs:
    """The gradient and eval graphs, and what the engine needs to run them.

    Attributes:
        gradient: inputs: the data inputs, the weights it reads, ``__loss_scale`` (float32
            scalar); outputs: the description's outputs in description order (the loss
            unscaled), ``<weight>_grad`` per trained weight (gradient of loss × ``__loss_scale``),
            ``<buffer>.updated`` per buffer the forward updates (BatchNorm running statistics).
        eval: forward in eval mode (Dropout off, BatchNorm on running statistics); inputs: data
            and the weights it reads; outputs: the description's outputs. None when built
            without it (``build(..., with_eval=False)``).
        meta: ``torch_keys`` ({weight: [state_dict keys]}), ``trained`` (weights with a gradient
            output, in model order), ``buffer_updates`` ({buffer: output name}), ``weights``
            ({weight: [shape, dtype]} of every weight either graph reads), ``inputs`` ({data
            input: dtype}), ``outputs`` (description outputs returned).
        fingerprint: ``TracedModel.fingerprint``.
        seconds: time per stage (``torch.export``, ``joint``, ``gradient onnx``, ``eval export``...).
    """

    gradient: onnx.ModelProto
    eval: onnx.ModelProto | None
    meta: dict
    fingerprint: str
    seconds: dict[str, float]


def export_joint(model: torch.nn.Module, loss_fn: Callable | None, desc: ModelDescription,
                 sample_inputs: Sequence[np.ndarray], frozen_weights: Sequence[str] = (), opset: int | None = None,
                 dynamic: bool = True, outputs: Sequence[str] | None = None, optimize: bool = False) -> JointGraphs:
    """Trace ``model`` (and ``loss_fn``) and build its gradient and eval graphs: ``build(trace(...))``.

    Args:
        model: the user's module; left exactly as it was (flags, mode, buffers, RNG state).
        loss_fn: ``loss_fn(prediction, *labels)``, or None when the model returns its loss.
        desc: the validated model description; its symbolic dimensions stay symbolic in the
            graphs (``torch.export.Dim.DYNAMIC``) unless ``dynamic`` is False.
        sample_inputs: one array per description input.
        frozen_weights: torch ``state_dict`` keys that get no gradient.
        opset: ONNX opset, 18 (None) to 21.
        dynamic: False traces the sample's exact shapes (a static graph, several times faster to build).
        outputs: description outputs to return besides the loss (None: all).
        optimize: onnxscript's whole optimizer (slower) instead of constant folding + CSE.

    Returns:
        The graphs (see ``JointGraphs``).

    Raises:
        ExportError: when the model cannot be traced or differentiated (the message says why).
        ValueError: for an unknown frozen weight or an unsupported opset.
    """
    return build(trace(model, loss_fn, desc, sample_inputs, frozen_weights, dynamic=dynamic), opset=opset,
                 outputs=outputs, optimize=optimize)


def trace(model: torch.nn.Module, loss_fn: Callable | None, desc: ModelDescription,
          sample_inputs: Sequence[np.ndarray], frozen_weights: Sequence[str] = (), dynamic: bool = True,
          unknown_frozen: str = "raise", autocast: str | None = None, eval_only: bool = False,
          fused_lstm: bool = False) -> TracedModel:
    """``torch.export`` of the model with its loss in training mode, and its fingerprint.

    The traced module returns ``(loss × __loss_scale, *description outputs)`` with the outputs
    detached: autograd then differentiates the scaled loss only. An ``ExportGuard`` watches the
    trace: what the program would silently get wrong (custom autograd Functions, hooks,
    data-dependent Python values, state changed by the forward...) is refused, every problem at
    once, naming the construct, the source line and the module (docs/export_limits.md).

    Args: as ``export_joint``, and
        unknown_frozen: ``"raise"`` for a ``frozen_weights`` name that is no weight of the model,
            ``"ignore"`` when the caller reports it (the trainer, with the optimizer's groups).
        autocast: ``"float16"`` or ``"bfloat16"``: mixed precision, the model and loss traced under
            ``torch.autocast`` (``autocast_context``), the loss returned in float32; None: as written.
        eval_only: trace in eval mode only (``build_eval`` can take the result, ``build`` cannot):
            half the time, for an export of the eval graph alone. Its fingerprint is not the
            two-mode trace's.
        fused_lstm: ``torch.lstm`` as oneDNN's LSTM layers, where it applies (``export/fused_lstm.py``), in
            both modes' traces.

    Returns:
        The traced program; ``build`` turns it into graphs, ``fingerprint`` keys a cache.

    Raises:
        ExportError: when the guard finds constructs the graphs cannot honour, when
            ``torch.export`` fails (its message, first line), or when the outputs do not match the
            description.
        ValueError: for a frozen weight that is not a weight of the model (``unknown_frozen="raise"``).
    """
    count = len(desc.inputs) - (1 if loss_fn is not None else 0)
    order = export_order(desc, loss_fn is not None)
    wrapper = torch_export.Scaled.of_desc(model, loss_fn, desc, order, autocast=autocast, fused_lstm=fused_lstm)
    tensors, keys = torch_export.tensors_by_name(wrapper)
    aliases: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        aliases.setdefault(id(tensor), []).append(name[len(MODEL_PREFIX):] if name.startswith(MODEL_PREFIX) else name)
    unknown = sorted(set(frozen_weights) - {k for ks in aliases.values() for k in ks})
    if unknown and unknown_frozen == "raise":
        raise ValueError(f"utils.frozen_weights names {unknown}, which are not weights of the model; use "
                         "torch state_dict keys")
    frozen_ids = {tid for tid, ks in aliases.items() if set(ks) & set(frozen_weights)}
    # tensors of a loss module are no weights of the model: constants of the graph, never trained
    frozen_ids |= {id(t) for fqn, t in tensors.items() if not fqn.startswith(MODEL_PREFIX)}
    keys = {fqn for fqn in keys if fqn.startswith(MODEL_PREFIX)}
    args, dynamic_shapes = _traced_program.trace_inputs(desc, sample_inputs, dynamic)
    started = time.perf_counter()
    with _model_left_untouched(wrapper):
        for parameter in wrapper.parameters():
            if id(parameter) in frozen_ids:
                parameter.requires_grad_(False)
        program = None if eval_only else torch_export.export_train(wrapper, args, dynamic_shapes)
    seconds = time.perf_counter() - started
    weight_of = {fqn: aliases[id(t)][0] for fqn, t in tensors.items() if fqn in keys}
    trainable = [aliases[id(p)][0] for p in dict.fromkeys(model.parameters())
                 if id(p) not in frozen_ids and p.requires_grad]
    torch_keys = {aliases[id(t)][0]: aliases[id(t)] for fqn, t in tensors.items() if fqn in keys}
    # The eval graph comes from a trace of its own, in eval mode, taken by the first evaluation
    # (``eval_fingerprint``, which keys the eval graph: code that only eval mode runs, an ``if
    # self.training`` branch, keys it) or here for an eval-only trace.
    job = {"model": model, "loss_fn": loss_fn, "desc": desc, "args": args, "dynamic_shapes": dynamic_shapes,
           "count": count, "order": order, "autocast": autocast, "fused_lstm": fused_lstm}
    eval_program = _export_eval(job) if eval_only else None
    settings = [desc.fingerprint(), sorted(frozen_weights), dynamic, loss_fn is not None, torch.__version__]
    mixed = [autocast] if autocast else []
    if eval_only:
        fingerprint = _traced_program.fingerprint(eval_program, [*settings, *mixed, "eval only"])
    else:
        fingerprint = _traced_program.fingerprint(program, [*settings, *mixed])
    logger.debug("torch.export of the model with its loss: %.2f s", seconds)
    return TracedModel(fingerprint, torch_keys, trainable, program, seconds,
                       {"model": model, "loss_fn": loss_fn, "desc": desc, "args": args, "frozen_ids": frozen_ids,
                        "dynamic_shapes": dynamic_shapes, "weight_of": weight_of, "count": count,
                        "tensors": tensors, "order": order, "eval_program": eval_program, "autocast": autocast,
                        "fused_lstm": fused_lstm})


def build(traced: TracedModel, opset: int | None = None, outputs: Sequence[str] | None = None,
          optimize: bool = False, with_eval: bool = True, sparse_labels: bool = False,
          gelu: bool = False, half_gelu: bool = False, half_attention: bool = False,
          eval_is_training: bool = False, loss_pieces: int = 0, kernels: Collection[str] = ()) -> JointGraphs:
    """The gradient graph (joint forward/backward of ``traced``) and the eval graph.

    Args:
        traced: from ``trace``; its program is consumed (call ``trace`` again to build again).
        opset, outputs, optimize: as ``export_joint``.
        with_eval: False leaves ``JointGraphs.eval`` None (``build_eval`` makes it later).
        sparse_labels: run the ``sparse_labels`` pass (``gradient/sparse_labels.py``) before autograd;
            it applies only where ``outputs`` leaves the projection's output (the logits) out.
        gelu: run the ``gelu`` pass (``gradient/gelu.py``): GELUs written out as arithmetic become
            ``aten.gelu`` before autograd, and each GELU's forward and backward are computed
            together in the gradient graph (the eval graph is left as traced).
        half_gelu: with ``gelu``, a float16 or bfloat16 GELU too is computed as one in its own dtype
            (``half_precision_gelu``).
        kernels: the switches that are on of ``kernel_ops.SWITCHES`` (ort_trainer's kernel library):
            ``fused_gelu_gradient`` (with ``gelu``: ``gelu.rewrite_joint``'s ``kernel``), ``fused_cross_entropy``
            (before autograd, after ``loss_pieces`` and ``sparse_labels``), the joint program's (``kept`` and
            ``rewrite_joint``), and ``torch_convolutions``, ``torch_batch_norm`` (``conv_ops``, ``batch_norm_ops``).
        half_attention: run the ``half_precision_attention`` pass (``gradient/attention.py``) before
            autograd: a mixed-precision model's ``scaled_dot_product_attention`` in the half dtype.
        loss_pieces: run the ``loss_pieces`` pass (``gradient/loss_pieces.py``) before autograd, pieces
            of at most this many logits elements (0: off); like ``sparse_labels``, it applies only where
            ``outputs`` leaves the logits out, and before it (with it, each piece projects its labelled rows).
        eval_is_training: the operator record found that eval mode runs the operators training mode
            runs, Dropouts aside (``OpRecord.eval_is_training``). Where ``sparse_labels`` or ``loss_pieces`` edit the
            program (the gradient graph then lacks outputs the eval graph returns), a copy of it with
            its Dropouts off (``eval_program.training_in_eval_mode``) is kept for ``build_eval``,
            which then needs no eval-mode trace.

    Returns:
        The graphs (see ``JointGraphs``).

    Raises:
        ExportError: when autograd cannot differentiate the program (the message says why).
        ValueError: for an unsupported opset.
    """
    opset = _check_opset(opset)
    job, seconds = traced._job, {"torch.export": traced.seconds}
    desc = job["desc"]
    returned = [n for n in desc.output_names if outputs is None or n in outputs or n == desc.loss_name]
    started = time.perf_counter()
    program = traced.program
    dropped = len(returned) < len(desc.output_names)
    sparse_labels, loss_pieces = sparse_labels and dropped, loss_pieces if dropped else 0
    if eval_is_training and (sparse_labels or loss_pieces) and job.get("eval_program") is None:
        try:
            job["eval_program"] = eval_program.training_in_eval_mode(program)
        except Exception as exc:  # noqa: BLE001  (a copy torch refuses: the eval graph is traced, as always)
            logger.debug("no copy of the training program for the eval graph (%s): eval mode is traced", exc)
            job["eval_program"] = None
        job["eval_from_training"] = job["eval_program"] is not None
    _traced_program.mark_untrained(program)
    if sparse_labels or loss_pieces:
        # outputs nobody reads go before the passes, which need the logits to feed the loss alone
        unread = torch_sparse_labels.unreturned(program, desc.output_names, returned)
        torch_sparse_labels.drop_outputs(program, unread)
    if loss_pieces:  # first: a piece projects its labelled rows where sparse_labels is on
        torch_loss_pieces.loss_pieces(program, loss_pieces, sparse=sparse_labels)
    if sparse_labels:
        torch_sparse_labels.sparse_labels(program)
    if "fused_cross_entropy" in kernels:
        kernel_ops.fused_cross_entropy(program)
    if gelu:
        torch_gelu.rewrite_formulas(program)
    if "fused_attention" in kernels:  # first: the calls it takes are not computed in half by the math attention
        attention_ops.fused_attention(program)
    if half_attention:
        torch_attention.half_precision(program)
    keep = sum((ops.kept(program, kernels) for ops in (kernel_ops, conv_ops, batch_norm_ops)), torch_gelu.kept(gelu))
    before_autograd.decompose(program)  # operators whose backward the exporter cannot translate
    try:
        joint = joint_onnx.joint_program(program, loss_index=0, keep=keep)
    except Exception as exc:  # torch raises many types; the message is what helps
        missing = re.search(r"derivative for '?([\w.]+)", str(exc))
        modules = _traced_program.modules_using(program, missing.group(1)) if missing else []
        where = f" (in module {', '.join(modules)})" if modules else ""
        fix = ("; PyTorch cannot train through that operator either: rewrite that part of the model, or freeze "
               "the weights before it (utils.frozen_weights)") if missing else ""
        linalg = sorted({str(n.target) for n in program.graph.nodes if "linalg" in str(n.target)
                         and "vector_norm" not in str(n.target)})  # norms (weight norm's) differentiate
        if linalg and not missing:  # (torch's joint trace fails on them before any translation is looked up)
            fix = ". The model uses torch.linalg operators, which the export cannot differentiate or translate: "
            fix += "; ".join(f"{op} (in module {', '.join(_traced_program.modules_using(program, op))})"
                             for op in linalg)
        raise ExportError(f"autograd could not differentiate the traced model{where}: "
                          f"{_first_line(exc).rstrip('.')}{fix}") from exc
    if gelu:
        torch_gelu.rewrite_joint(joint, half=half_gelu, kernel="fused_gelu_gradient" in kernels)
    for ops in (kernel_ops, conv_ops, batch_norm_ops):
        ops.rewrite_joint(joint)
    if job["dynamic_shapes"] is not None:
        _traced_program.check_symbolic(joint, desc, "differentiating the model")
    seconds["joint"] = time.perf_counter() - started

    started = time.perf_counter()
    try:
        gradient, trained, buffer_updates = _gradient_graph(joint, job, returned, optimize)
    except joint_onnx.UnsupportedOperatorError as exc:
        op = re.search(r"no translation for ([\w.]+)", str(exc))
        # the traced forward's modules, else the joint program's (a backward operator, a decomposition's)
        modules = (_traced_program.modules_using(program, op.group(1))
                   or _traced_program.modules_using(joint, op.group(1))) if op else []
        complex_modules = _traced_program.modules_computing_complex(program)
        if not modules and not complex_modules:
            raise
        where = f" (in module {', '.join(modules)})" if modules else ""
        why = (f"; the model computes with complex tensors (in module {', '.join(complex_modules)}), which torch's "
               "ONNX exporter translates only in part in a training graph: write that part with real tensors (a "
               "rotary embedding as Hugging Face's rotate_half does, say)") if complex_modules else ""
        raise joint_onnx.UnsupportedOperatorError(f"{exc}{where}{why}") from exc
    seconds["gradient onnx"] = time.perf_counter() - started

    eval_model = None
    if with_eval:
        started = time.perf_counter()
        eval_model = build_eval(traced, opset, outputs, optimize, sparse_labels=sparse_labels,
                                half_attention=half_attention, loss_pieces=loss_pieces)
        seconds["eval export"] = time.perf_counter() - started
    if opset != joint_onnx.ONNX_OPSET:
        gradient = _convert_opset(gradient, opset)

    weights = {}
    for graph in (gradient, eval_model) if eval_model is not None else (gradient,):
        weights.update({i.name: _shape_dtype(i) for i in graph.graph.input if i.name in traced.torch_keys})
    new_values = {o.name: o for o in gradient.graph.output}
    for buffer, output in buffer_updates.items():  # a buffer the forward overwrites before reading it (spectral
        weights.setdefault(buffer, _shape_dtype(new_values[output]))  # norm's u) is state, though no input
    meta = {
        "torch_keys": {w: traced.torch_keys[w] for w in weights},
        "trained": trained,
        "buffer_updates": buffer_updates,
        "weights": weights,
        "inputs": {n: str(a.numpy().dtype) for n, a in zip(desc.input_names, job["args"])},
        "outputs": returned,
    }
    logger.debug("torch-autograd graphs built: %s", {k: round(v, 2) for k, v in seconds.items()})
    return JointGraphs(gradient, eval_model, meta, traced.fingerprint, seconds)


def build_eval(traced: TracedModel, opset: int | None = None, outputs: Sequence[str] | None = None,
               optimize: bool = False, sparse_labels: bool = False, half_attention: bool = False,
               loss_pieces: int = 0) -> onnx.ModelProto:
    """The eval graph: a second ``torch.export`` of the model, in eval mode (Dropout off,
    BatchNorm on running statistics), with the weights as inputs.

    Args:
        traced: from ``trace`` (before or after ``build``).
        opset, outputs, optimize: as ``export_joint``.
        sparse_labels, half_attention, loss_pieces: as ``build``.

    Returns:
        Inputs: the data inputs and the weights it reads; outputs: the description's outputs.

    Raises:
        ExportError: when the eval-mode model cannot be traced.
        ValueError: for an unsupported opset.
    """
    opset = _check_opset(opset)
    desc = traced._job["desc"]
    returned = [n for n in desc.output_names if outputs is None or n in outputs or n == desc.loss_name]
    model = _eval_graph(traced._job, returned, optimize, sparse_labels, half_attention, loss_pieces)
    return model if opset == joint_onnx.ONNX_OPSET else _convert_opset(model, opset)


def _check_opset(opset: int | None) -> int:
    opset = joint_onnx.ONNX_OPSET if opset is None else opset
    if not joint_onnx.ONNX_OPSET <= opset <= 21:
        raise ValueError(f"opset {opset} is not supported by the torch-autograd gradient source: torch's ONNX "
                         f"exporter writes opset {joint_onnx.ONNX_OPSET}, convertible up to 21 (the newest "
                         "onnxruntime 1.19.2 reads); pass 18 to 21")
    return opset


def _gradient_graph(joint: Any, job: dict, returned: list[str],
                    optimize: bool) -> tuple[onnx.ModelProto, list[str], dict[str, str]]:
    """Translate the joint program: outputs in description order, gradients, buffer updates."""
    from torch.export.graph_signature import InputKind, OutputKind

    signature = joint.graph_signature
    weight_of, desc = job["weight_of"], job["desc"]
    user_outputs = [s.arg.name for s in signature.output_specs
                    if s.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)]
    by_desc = dict(zip(desc.output_names, user_outputs[1:]))
    outputs = [(by_desc[n], n) for n in returned]
    grads, updates = {}, {}
    for spec in signature.output_specs:
        target = spec.target[len(MODEL_PREFIX):] if spec.target else None
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER:
            grads[weight_of[spec.target]] = spec.arg.name
        elif spec.kind == OutputKind.BUFFER_MUTATION and spec.target in weight_of \
                and not target.endswith("num_batches_tracked"):
            updates[weight_of[spec.target]] = spec.arg.name
    trained = [w for w in dict.fromkeys(weight_of.values()) if w in grads]
    outputs += [(grads[w], w + GRAD_SUFFIX) for w in trained]
    buffer_updates = {b: b + UPDATED_SUFFIX for b in updates}
    outputs += [(updates[b], b + UPDATED_SUFFIX) for b in updates]
    inputs, constants = _placeholders(joint, job, InputKind)
    model = joint_onnx.program_to_onnx(joint, inputs, constants, outputs, _input_dims(job), optimize)
    return model, trained, buffer_updates


def _placeholders(program: Any, job: dict, kinds: Any) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``{placeholder: ONNX input}`` (data, weights in model order, loss scale) and constants."""
    desc, weight_of = job["desc"], job["weight_of"]
    users = [s.arg.name for s in program.graph_signature.input_specs if s.kind == kinds.USER_INPUT]
    inputs = dict(zip(users, [*desc.input_names, LOSS_SCALE_INPUT]))
    weights, constants, seen = {}, {}, {}
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for spec in program.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind in (kinds.PARAMETER, kinds.BUFFER) and spec.target in weight_of:
            weight = weight_of[spec.target]
            node = nodes[name]
            if weight in seen and node.users and seen[weight]:
                raise ExportError(f"torch.export traced weight {weight!r} as two inputs; tied weights are not "
                                  "deduplicated by this torch version")
            seen[weight] = seen.get(weight, False) or bool(node.users)
            if node.users:
                weights[name] = weight
        elif spec.kind != kinds.USER_INPUT:  # non-persistent buffers, tensor constants, a loss module's tensors
            constants[name] = program.constants.get(spec.target, job["tensors"].get(spec.target))
    order = {w: i for i, w in enumerate(dict.fromkeys(weight_of.values()))}
    ordered = sorted(weights.items(), key=lambda item: order[item[1]])
    data = {p: n for p, n in inputs.items() if n != LOSS_SCALE_INPUT}
    scale = {p: n for p, n in inputs.items() if n == LOSS_SCALE_INPUT}
    return {**data, **dict(ordered), **scale}, constants


def eval_fingerprint(traced: TracedModel) -> str:
    """SHA-256 of ``traced``'s eval-mode program, which is exported now (once) unless the trace was
    eval-only or ``build`` kept the training program in eval mode: the eval graph's cache key,
    beside the training graph's."""
    job = traced._job
    if job.get("eval_program") is None:
        job["eval_program"] = _export_eval(job)
    return _traced_program.fingerprint(job["eval_program"], [])


def _export_eval(job: dict) -> Any:
    """The second ``torch.export``: the model in eval mode (Dropout off, BatchNorm on running
    statistics), returning the description's outputs."""
    model, desc, order = job["model"], job["desc"], job["order"]
    wrapper = torch_export.Scaled.of_desc(model, job["loss_fn"], desc, order, scaled=False,
                                          autocast=job.get("autocast"), fused_lstm=job.get("fused_lstm", False))
    shapes = None if job["dynamic_shapes"] is None else job["dynamic_shapes"][:-1]
    with _model_left_untouched(wrapper):
        model.eval()
        return torch_export.export_program(wrapper, job["args"][:-1], shapes)


def _eval_graph(job: dict, returned: list[str], optimize: bool, sparse_labels: bool = False,
                half_attention: bool = False, loss_pieces: int = 0) -> onnx.ModelProto:
    """The eval-mode program (``trace``'s, ``build``'s copy of the training program with its Dropouts
    off, or exported now), translated with weights as inputs; with ``sparse_labels`` and
    ``loss_pieces``, the passes run on it as on the training program."""
    from torch.export.graph_signature import InputKind, OutputKind

    desc = job["desc"]
    # the training program in eval mode (``build``'s copy) returns the scaled loss first
    first = 1 if job.pop("eval_from_training", False) else 0
    program = job.pop("eval_program", None) or _export_eval(job)
    if (sparse_labels or loss_pieces) and len(returned) < len(desc.output_names):
        torch_sparse_labels.drop_outputs(
            program, torch_sparse_labels.unreturned(program, desc.output_names, returned, first=first))
        if loss_pieces:
            torch_loss_pieces.loss_pieces(program, loss_pieces, sparse=sparse_labels)
        if sparse_labels:
            torch_sparse_labels.sparse_labels(program)
    if half_attention:
        torch_attention.half_precision(program)
    program = eval_program.forward_program(program)
    if job["dynamic_shapes"] is not None:
        _traced_program.check_symbolic(program, desc, "the eval-mode trace")
    user_outputs = [s.arg.name for s in program.graph_signature.output_specs
                    if s.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)]
    by_desc = dict(zip(desc.output_names, user_outputs[first:]))
    inputs, constants = _placeholders(program, job, InputKind)
    inputs = {name: onnx_name for name, onnx_name in inputs.items() if onnx_name != LOSS_SCALE_INPUT}
    return joint_onnx.program_to_onnx(program, inputs, constants, [(by_desc[n], n) for n in returned],
                                       _input_dims(job), optimize)


def _input_dims(job: dict) -> dict[str, list]:
    """``{data input: description shape}``, whose symbols name the graphs' symbolic dimensions."""
    return {} if job["dynamic_shapes"] is None else {io.name: list(io.shape) for io in job["desc"].inputs}


def _shape_dtype(info: onnx.ValueInfoProto) -> list:
    tensor_type = info.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor_type.shape.dim]
    return [shape, str(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))]


def _convert_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    import onnx_ir as ir
    from onnxscript import version_converter

    converted = ir.serde.deserialize_model(model)
    version_converter.convert_version(converted, opset, fallback=True)
    result = ir.serde.serialize_model(converted)
    result.ir_version = joint_onnx.ONNX_IR_VERSION
    return result


