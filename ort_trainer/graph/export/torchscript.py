"""Stage 1: export a ``torch.nn.Module`` (plus the loss) to an ONNX forward graph.

The TorchScript exporter is used (``dynamo=False``): in torch 2.13 the default dynamo exporter
produces graphs ONNX Runtime 1.19's gradient builder does not expect. Export runs in training
mode without constant folding, so parameters keep their ``state_dict`` names and Dropout stays
in the graph. Symbolic dimensions of the model description become dynamic axes.

The one traced forward pass runs under ``guard.ExportGuard``: ``detach``/``no_grad`` become
gradient stops, and what a trace cannot capture (custom autograd backward, tensor values read into
Python, state changed by the forward...) is refused with every problem listed
(docs/export_limits.md).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import onnx
import torch

from ..._logging import logger
from ...model_desc import ModelDescription
from . import symbolics
from .guard import ExportGuard, GUARD_FILE, _model_left_untouched

MODEL_PREFIX = "model."


class ExportError(RuntimeError):
    """The model could not be exported to ONNX; the message names the operator and module."""


class ExportMismatchError(RuntimeError):
    """The exported graph computes different outputs than the torch model (``debug.check_model_export``)."""


class _ModelWithLoss(torch.nn.Module):
    """Wraps the user's model and loss so one forward returns ``(loss, *model_outputs)``.

    When every model input's name is a parameter of the model's ``forward`` (as with Hugging Face
    models: ``input_ids``, ``attention_mask``, ``labels``), the inputs are passed by keyword.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, input_names: list[str]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.input_names = list(input_names)
        self.num_model_inputs = len(input_names)
        try:
            parameters = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            parameters = {}
        positional_only = any(p.kind == p.VAR_POSITIONAL for p in parameters.values())
        self.by_name = not positional_only and all(name in parameters for name in input_names) and any(
            list(parameters).index(name) != i for i, name in enumerate(input_names))
        self.guard: ExportGuard | None = None  # set while the exporter traces

    def train_as_traced(self) -> None:
        """Put the user's model (and a module ``loss_fn``) in the modes the training trace runs it in.

        A model in eval mode itself (as Hugging Face's ``from_pretrained`` returns it) is put in training mode,
        ``model.train()``, as a PyTorch training loop does first. A model in training mode is left as it is: the
        submodules the user put in eval mode (a frozen BatchNorm, which normalises with its running statistics
        and never updates them; a Dropout turned off) stay so, as PyTorch trains them."""
        training = training_in_trace(self.model)
        self.training = True
        for module in (self.model, self.loss_fn):
            if isinstance(module, torch.nn.Module) and not module.training:
                module.train()
        frozen = [f"{name} ({type(m).__name__})" for name, m in self.model.named_modules() if name not in training]
        if frozen:
            logger.info("submodules in eval mode in a model in training mode train in eval mode, as in PyTorch: %s",
                        ", ".join(frozen[:10]) + (f" and {len(frozen) - 10} more" if len(frozen) > 10 else ""))

    def forward(self, *inputs: torch.Tensor) -> tuple:
        """``(loss, *flattened model outputs)``, or the model's own outputs without a loss_fn."""
        if self.guard is None:
            return self._forward(*inputs)
        with self.guard.watching(inputs):
            return self._forward(*inputs)

    def _forward(self, *inputs: torch.Tensor) -> tuple:
        model_inputs = inputs[: self.num_model_inputs]
        if self.by_name:
            prediction = self.model(**dict(zip(self.input_names, model_inputs)))
        else:
            prediction = self.model(*model_inputs)
        outputs = flatten_outputs(prediction)
        if self.loss_fn is None:
            return tuple(outputs)
        loss = self.loss_fn(prediction, *inputs[self.num_model_inputs:])
        return (loss, *outputs)


def training_in_trace(model: torch.nn.Module) -> set[str]:
    """The names (as ``named_modules`` gives them) of ``model``'s submodules that its training trace runs in
    training mode (``_ModelWithLoss.train_as_traced``): every one of a model in eval mode, else those in training
    mode."""
    return {name for name, module in model.named_modules() if module.training or not model.training}


def flatten_outputs(value: Any) -> list[torch.Tensor]:
    """Flatten a model's return value (tensor, tuple, list, dict, Hugging Face ModelOutput).

    Hugging Face key/value caches (``DynamicCache``...) are not outputs: set ``use_cache=False``
    in the model config, or they are skipped here.
    """
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or type(value).__name__.endswith("Cache"):  # Hugging Face key/value caches
        return []
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in flatten_outputs(item)]
    raise ExportError(f"the model returned a {type(value).__name__}; expected tensors (or tuples/dicts of them)")


@dataclass
class ExportedModel:
    """The forward graph and how its initializers map back to the torch module.

    Attributes:
        model: the ONNX forward graph (weights still initializers).
        torch_keys: ONNX initializer name -> the torch ``state_dict`` keys holding that tensor
            (several keys when weights are tied).
        trainable: ONNX names of weights that require grad.
        output_order: graph output names in the order the wrapper returns them.
    """

    model: onnx.ModelProto
    torch_keys: dict[str, list[str]]
    trainable: list[str]
    output_order: list[str]
    padding: dict[str, int]  # weight -> padding_idx of the nn.Embedding that uses it


def export_order(desc: ModelDescription, has_loss_fn: bool) -> list[str]:
    """Output names in the order the wrapped model returns them."""
    if has_loss_fn:
        return [desc.loss_name] + [n for n in desc.output_names if n != desc.loss_name]
    return desc.output_names


def export_torch(
    model: torch.nn.Module,
    loss_fn: Callable | None,
    desc: ModelDescription,
    sample_inputs: Sequence[np.ndarray],
    opset: int,
) -> ExportedModel:
    """Export ``model`` (and ``loss_fn``) to an ONNX forward graph in training mode.

    Args:
        model: the user's module.
        loss_fn: ``loss_fn(prediction, label)`` or None when the model returns its loss.
        desc: the validated model description; symbolic dims become dynamic axes.
        sample_inputs: one array per description input, used to trace.
        opset: ONNX opset version.

    Raises:
        ExportError: when the exporter rejects an operator (named, with its module) or the model
            returns a different number of outputs than the description declares.
    """
    num_model_inputs = len(desc.inputs) - (1 if loss_fn is not None else 0)
    wrapper = _ModelWithLoss(model, loss_fn, desc.input_names[:num_model_inputs])
    args = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in sample_inputs)
    names = export_order(desc, loss_fn is not None)

    # Tracing runs forward in training mode: keep each module's mode, the user's RNG stream and buffers
    # (BatchNorm running statistics) exactly as they were.
    with _model_left_untouched(model):
        wrapper.train_as_traced()
        return _export(wrapper, loss_fn, desc, args, names, opset)


def _export(wrapper: "_ModelWithLoss", loss_fn: Callable | None, desc: ModelDescription, args: tuple,
            names: list[str], opset: int) -> ExportedModel:
    """Trace the wrapper once with the TorchScript exporter, watched by an ``ExportGuard``."""
    guard = ExportGuard(wrapper, loss_fn is not None)
    produced: list[int] = []
    handle = wrapper.register_forward_hook(lambda _module, _inputs, outputs: produced.append(len(outputs)))
    buffer = io.BytesIO()
    wrapper.guard = guard
    with warnings.catch_warnings(record=True) as caught, _native_stdout_to_log(), guard.exporting(), \
            symbolics.registered(opset):
        warnings.simplefilter("always")
        try:
            torch.onnx.export(
                wrapper, args, buffer, dynamo=False, training=torch.onnx.TrainingMode.PRESERVE,
                do_constant_folding=False, opset_version=opset, input_names=desc.input_names,
                output_names=names, dynamic_axes=_dynamic_axes(desc), export_params=True,
                keep_initializers_as_inputs=False,
            )
            failure = None
        except Exception as exc:  # the exporter raises several exception types
            failure = exc
        finally:
            wrapper.guard = None
            handle.remove()
    for warning in caught:
        if issubclass(warning.category, torch.jit.TracerWarning) and os.path.abspath(warning.filename) != GUARD_FILE:
            logger.debug("tracer warning (%s:%d): %s", warning.filename, warning.lineno, warning.message)
    if failure is None and any("duplicated values in 'index'" in str(w.message) for w in caught):
        raise ExportError(
            "index_add (Tensor.index_add_, torch.index_add) exports to ONNX as a scatter in which, where the index "
            "repeats a position, the last update wins instead of all adding up (torch's TorchScript exporter says "
            "so), a silently wrong result: train this model with graph.gradient_source='torch' (PyTorch's autograd, "
            "which computes it exactly)")
    if produced and produced[0] != len(names):
        what = "loss_fn's loss plus the model's outputs" if loss_fn is not None else "the model's outputs"
        raise ExportError(
            f"{what} are {produced[0]} tensor(s) but model_desc.outputs declares {len(names)} "
            f"({desc.output_names}); make them agree"
        ) from failure
    if failure is not None:
        failed = _explain_export_failure(failure, wrapper, args)
        if guard.functions:
            failed += (f" The model applies custom torch.autograd.Function(s) ({'; '.join(guard.functions)}); the "
                       "exporter traces a Function's forward only with tensor arguments: call its computation "
                       "directly instead.")
    if guard.problems:
        then = f"\nThe export then failed: {failed}" if failure is not None else ""
        raise ExportError(
            f"the model cannot be exported as written ({len(guard.problems)} problem(s); see docs/export_limits.md):"
            "\n  - " + "\n  - ".join(guard.problems) + then
        ) from failure
    if failure is not None:
        raise ExportError(failed) from failure

    onnx_model = onnx.load_from_string(buffer.getvalue())
    torch_keys, trainable = _map_initializers(onnx_model, wrapper)
    torch_keys, trainable = _rename_weights(onnx_model, torch_keys, trainable, desc)
    by_key = {key: weight for weight, keys in torch_keys.items() for key in keys}
    padding = {}
    for name, module in wrapper.model.named_modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            weight = by_key.get(f"{name}.weight" if name else "weight")
            if weight is not None:
                padding[weight] = int(module.padding_idx) % module.num_embeddings
    logger.debug("exported %d nodes, %d weights (%d trainable)",
                 len(onnx_model.graph.node), len(torch_keys), len(trainable))
    return ExportedModel(onnx_model, torch_keys, trainable, names, padding)


@contextlib.contextmanager
def _native_stdout_to_log():
    """Route what the exporter's C++ code prints (its IR dump on failure) to the debug log."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no usable stdout: nothing to capture
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            if text.strip():
                logger.debug("exporter output:\n%s", text)


def _dynamic_axes(desc: ModelDescription) -> dict[str, dict[int, str]]:
    axes = {}
    for io_desc in [*desc.inputs, *desc.outputs]:
        symbolic = {i: d for i, d in enumerate(io_desc.shape) if isinstance(d, str)}
        if symbolic:
            axes[io_desc.name] = symbolic
    return axes


def _explain_export_failure(exc: Exception, wrapper: torch.nn.Module, args: tuple) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, IndexError):  # the exporter runs the model on the first batch: PyTorch refused it
        return (f"the model raised IndexError ({message}) on the first batch, which the ONNX export runs through it: "
                "an index input (a label, a token id, or a sequence longer than the position table) is out of "
                "range for the model; fix the batch")
    match = re.search(r"(aten::\w+|prim::\w+)", str(exc))
    if not match:
        return f"ONNX export of the model failed: {message}"
    op = match.group(1)
    modules = _modules_using(op, wrapper, args)
    where = f" in module {', '.join(modules)}" if modules else ""
    return (
        f"ONNX export failed: operator {op}{where} cannot be exported ({message}). "
        "Rewrite that part of the model with supported torch operations, train it with graph.gradient_source="
        "\"torch\" (PyTorch's autograd, whose export takes more operators: F.ctc_loss among them), or pass an ONNX "
        "model instead."
    )


def _modules_using(op: str, wrapper: torch.nn.Module, args: tuple) -> list[str]:
    """Module paths (as in ``model.named_modules()``) whose forward calls ``op``, found by tracing."""
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(wrapper, args, check_trace=False, strict=False)
        modules = dict(wrapper.named_modules())
        found = []
        for node in traced.inlined_graph.nodes():
            if node.kind() == op:
                scope = node.scopeName().split("/")[-1].replace("__module.", "")
                module = modules.get(scope)
                scope = scope[len(MODEL_PREFIX):] if scope.startswith(MODEL_PREFIX) else scope
                label = f"{scope or '<top-level forward>'} ({type(module).__name__})" if module is not None else scope
                if label and label not in found:
                    found.append(label)
        return found
    except Exception:  # tracing is only used to improve the message
        return []


def _map_initializers(onnx_model: onnx.ModelProto, wrapper: torch.nn.Module) -> tuple[dict[str, list[str]], list[str]]:
    """Map ONNX initializers to the torch state_dict keys they come from.

    Names are tried first; an initializer the exporter renamed is matched by identical contents.
    Initializers that are not parameters or buffers (constants the exporter made) are left out.
    """
    tensors: dict[str, torch.Tensor] = {}
    requires_grad: dict[str, bool] = {}
    aliases: dict[int, list[str]] = {}
    for name, tensor in [*wrapper.named_parameters(remove_duplicate=False), *wrapper.named_buffers(remove_duplicate=False)]:
        if tensor is None:
            continue
        key = name[len(MODEL_PREFIX):] if name.startswith(MODEL_PREFIX) else name
        tensors[name] = tensor
        requires_grad[name] = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
        aliases.setdefault(id(tensor), []).append(key)

    torch_keys: dict[str, list[str]] = {}
    trainable: list[str] = []
    unmatched_inits = []
    used_ids = set()
    for init in onnx_model.graph.initializer:
        tensor = tensors.get(init.name)
        if tensor is None:
            unmatched_inits.append(init)
            continue
        torch_keys[init.name] = aliases[id(tensor)]
        used_ids.add(id(tensor))
        if requires_grad[init.name]:
            trainable.append(init.name)
    leftovers = {n: t for n, t in tensors.items() if id(t) not in used_ids and t.is_floating_point()}
    for init in unmatched_inits:
        if init.data_type != onnx.TensorProto.FLOAT:
            continue
        value = onnx.numpy_helper.to_array(init)
        for name, tensor in list(leftovers.items()):
            if tuple(tensor.shape) == value.shape and np.array_equal(tensor.detach().cpu().numpy(), value):
                torch_keys[init.name] = aliases[id(tensor)]
                if requires_grad[name]:
                    trainable.append(init.name)
                for other in [n for n, t in leftovers.items() if t is tensor]:
                    del leftovers[other]
                break
    return torch_keys, trainable


def _rename_weights(
    onnx_model: onnx.ModelProto, torch_keys: dict[str, list[str]], trainable: list[str], desc: ModelDescription
) -> tuple[dict[str, list[str]], list[str]]:
    """Rename weight initializers to their torch ``state_dict`` key, the name users know them by."""
    taken = set(desc.input_names) | set(desc.output_names)
    rename = {}
    for old, keys in torch_keys.items():
        if keys[0] in taken:
            raise ExportError(f"weight {keys[0]!r} has the same name as a model_desc input or output; rename one")
        rename[old] = keys[0]
    graph = onnx_model.graph
    for init in graph.initializer:
        init.name = rename.get(init.name, init.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    return {rename[k]: v for k, v in torch_keys.items()}, [rename[t] for t in trainable]
