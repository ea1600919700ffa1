"""``torch.export`` of the model with its loss: the wrapper it traces (``Scaled``: the loss times
the loss scale, the description's outputs, under autocast where asked) and the export itself,
with the guard that refuses what a graph cannot hold (``export/guard.py``)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import traceback
import warnings
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from ..._logging import logger
from ..export.guard import ExportGuard, _CONVERSION_FIX
from ..export.validations import source_line
from ..export.torchscript import ExportError, _ModelWithLoss


def autocast_context(dtype: str | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for mixed precision in ``dtype`` (``"float16"``/``"bfloat16"``; None: a no-op).

    Always the CPU autocast, whatever device the graphs will run on: the trace runs on CPU (fake)
    tensors, and autocast only rewrites operators on tensors of its own device type, so the CPU
    autocast op lists (matmul, linear, convolutions... in ``dtype``; losses and reductions such as
    ``cross_entropy``, ``mse_loss``, ``nll_loss`` in float32; everything else in its inputs' dtype)
    decide what the graph computes in half precision on every device.
    """
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cpu", dtype=getattr(torch, dtype))


@contextlib.contextmanager
def without_fake_tensor_errors() -> Iterator[None]:
    """A failed trace's operator error, logged with its traceback by torch's fake tensors (~20 lines on stderr),
    stays off unless ``ort_trainer`` logs at DEBUG: the ``ExportError`` raised says what failed, and where."""
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    before = fake_tensor_log.level
    if not logger.isEnabledFor(logging.DEBUG):
        fake_tensor_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_tensor_log.setLevel(before)


@contextlib.contextmanager
def without_stack_traces() -> Iterator[None]:
    """Traces inside record no Python stack trace per FX node (``torch.fx.config``): nothing here
    reads ``node.meta["stack_trace"]`` (errors name the module from ``nn_module_stack``), and
    collecting them took ~0.5 s of GPT-2 small's symbolic eval-mode export (of ~3). A torch without the
    switch (2.11 has none) records them."""
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        yield
        return
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


class Scaled(_ModelWithLoss):
    """``forward(*inputs, loss_scale)`` -> ``(loss × loss_scale, *description outputs detached)``.

    With ``autocast`` the model and loss run under ``autocast_context`` and the loss is cast to
    float32 (autograd then differentiates the casts: weights stay float32 inputs, their
    gradients float32 outputs).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, input_names: list[str],
                 desc_positions: list[int], loss_position: int, scaled: bool = True, autocast: str | None = None,
                 fused_lstm: bool = False, input_dims: list[tuple] | None = None):
        super().__init__(model, loss_fn, input_names)
        self.desc_positions, self.loss_position, self.scaled = desc_positions, loss_position, scaled
        self.autocast, self.fused_lstm = autocast, fused_lstm
        self.input_dims = input_dims or [()] * len(input_names)  # model_desc's dims of each input, for messages

    @classmethod
    def of_desc(cls, model: torch.nn.Module, loss_fn: Callable | None, desc: Any, order: list[str],
                **options: Any) -> "Scaled":
        """The wrapper of ``model`` and ``loss_fn`` for the model description ``desc``, whose outputs the traced
        forward returns in ``order`` (``export_order``); ``options``: ``scaled``, ``autocast``, ``fused_lstm``."""
        count = len(desc.inputs) - (1 if loss_fn is not None else 0)
        return cls(model, loss_fn, desc.input_names[:count], [order.index(n) for n in desc.output_names],
                   order.index(desc.loss_name), input_dims=[io.shape for io in desc.inputs], **options)

    def forward(self, *inputs: torch.Tensor) -> tuple:
        """The scaled loss then the description outputs (training), or the outputs alone (eval)."""
        data = inputs[:-1] if self.scaled else inputs
        with self.guard.watching(data) if self.guard is not None else contextlib.nullcontext():
            with autocast_context(self.autocast):
                outputs = self._forward(*data)
        if self.autocast and len(outputs) > self.loss_position \
                and outputs[self.loss_position].dtype in (torch.float16, torch.bfloat16):
            outputs = (*outputs[:self.loss_position], outputs[self.loss_position].float(),
                       *outputs[self.loss_position + 1:])
        if len(outputs) != len(self.desc_positions):
            what = "loss_fn's loss plus the model's outputs" if self.loss_fn is not None else "the model's outputs"
            raise ExportError(f"{what} are {len(outputs)} tensor(s) but model_desc.outputs declares "
                              f"{len(self.desc_positions)}; make them agree")
        ordered = [outputs[i] for i in self.desc_positions]
        if not self.scaled:
            return tuple(ordered)
        return (outputs[self.loss_position] * inputs[-1], *(o.detach() for o in ordered))


def tensors_by_name(wrapper: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every parameter and buffer by fully qualified name; the names that are state (not
    non-persistent buffers, which the graphs hold as constants)."""
    tensors, state = {}, set()
    for fqn, tensor in [*wrapper.named_parameters(remove_duplicate=False),
                        *wrapper.named_buffers(remove_duplicate=False)]:
        if tensor is not None:
            tensors[fqn] = tensor
    for fqn in wrapper.state_dict(keep_vars=True):
        if fqn in tensors:
            state.add(fqn)
    return tensors, state


def _refuse(guard: ExportGuard, failure: BaseException | None) -> None:
    """Raise the guard's problems, if any, as one ``ExportError`` (with the export's own failure)."""
    if not guard.problems:
        return
    then = f"\nThe export then failed: {_first_line(failure)}" if failure is not None else ""
    raise ExportError(
        f"the model cannot be exported as written ({len(guard.problems)} problem(s); see docs/export_limits.md):"
        "\n  - " + "\n  - ".join(guard.problems) + then
    ) from failure


def export_train(wrapper: Scaled, args: tuple, dynamic_shapes: Any) -> Any:
    """The guarded ``torch.export`` of the wrapped model in training mode (``train_as_traced``: the graphs' program);
    the caller restores the model's state."""
    wrapper.train_as_traced()
    guard = ExportGuard(wrapper, wrapper.loss_fn is not None, stop_gradients=False,
                        lstm_layers="training" if wrapper.fused_lstm else None)
    wrapper.guard = guard
    try:
        with guard.exporting():
            program = export_program(wrapper, args, dynamic_shapes, guard)
    finally:
        wrapper.guard = None
    guard.check_program(program)
    _refuse(guard, None)
    return program


def export_program(wrapper: Scaled, args: tuple, dynamic_shapes: Any, guard: ExportGuard | None = None) -> Any:
    """``torch.export.export`` with the outputs checked against the description; the guard's
    problems, when it found any, are the error when the trace fails."""
    if dynamic_shapes is not None:  # forward(*inputs): one argument, a tuple
        dynamic_shapes = (tuple(dynamic_shapes),)
    unwatched = wrapper.guard is None
    if unwatched:  # a trace after the watched one (eval mode): the guard only turns .data into detach()
        wrapper.guard = ExportGuard(wrapper, wrapper.loss_fn is not None, stop_gradients=False,
                                    lstm_layers="eval" if wrapper.fused_lstm else None)
    try:
        with warnings.catch_warnings(), without_stack_traces(), without_fake_tensor_errors():
            warnings.simplefilter("ignore", FutureWarning)
            # nn.RNNBase.forward re-lists its own parameters in _flat_weights (no new tensor): not the user's concern
            warnings.filterwarnings("ignore", r"The tensor attributes .*_flat_weights\[", UserWarning)
            return torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # torch raises many types; the message is what helps
        if guard is not None:
            _refuse(guard, exc)
        cause: BaseException | None = exc
        unsized = None  # the operator fake tensors could not size (its output's shape comes from its inputs' values)
        while cause is not None:  # the wrapper's own error, wrapped by torch
            if isinstance(cause, ExportError):
                raise cause from exc
            if isinstance(cause, DynamicOutputShapeException) and unsized is None:
                unsized = str(cause.func)
            cause = cause.__cause__ or cause.__context__
        hint = ""
        data_dependent = re.search(r"Caused by: \(([^)]*)\)", str(exc))
        if "data-dependent" in str(exc):
            where = f" at {data_dependent.group(1)}" if data_dependent else ""
            hint = (f" The model reads a tensor's value into Python{where} (a branch on it, a Python number or "
                    f"list made from it), which a graph cannot recompute for each batch; {_CONVERSION_FIX}.")
        elif unsized is not None:
            hint = (f" Operator {unsized} (called {_user_frame(exc, wrapper.guard)}) returns a tensor whose shape "
                    "depends on its inputs' values, and torch cannot trace it with a shape unknown until the step "
                    "runs; compute that part with other operators, or with PyTorch.")
        elif "specialized" in str(exc) or "specialize" in str(exc):
            hint = (" The model's code fixes a dimension that model_desc declares symbolic: declare it as an int "
                    "in model_desc.")
        message, named = _dims_named(_first_line(exc), exc, wrapper)
        if named and not hint:
            hint = (" Those sizes are the symbolic dimensions model_desc declares, each traced at a size of its own: "
                    "where the model requires two of them to be equal, give them one name in model_desc; where it "
                    "requires a size, declare that size as an int.")
        raise ExportError(f"torch.export could not trace the model: {message.rstrip('.')}.{hint} (see "
                          "docs/export_limits.md)") from exc
    finally:
        if unwatched:
            wrapper.guard = None


def _dims_named(message: str, exc: BaseException, wrapper: Scaled) -> tuple[str, bool]:
    """``message`` with torch's symbols for the inputs' sizes (``s21``, ``L['inputs'][0].size()[1]``) written as
    ``x[1] ('seq')``: input, axis and model_desc's name, found through the shape environment that a frame of the
    failed trace holds; and whether any was."""
    def label(position: int, axis: int) -> str:
        if position >= len(wrapper.input_names):
            return f"input {position}[{axis}]"
        dims = wrapper.input_dims[position]
        declared = f" ({dims[axis]!r})" if axis < len(dims) else ""
        return f"{wrapper.input_names[position]}[{axis}]{declared}"

    source = re.compile(r"L\['inputs'\]\[(\d+)\]\.size\(\)\[(\d+)\]")
    names = {}
    shape_env = _shape_env_of(exc) if re.search(r"\bs\d+\b", message) else None
    for symbol, sources in (shape_env.var_to_sources.items() if shape_env is not None else ()):
        name = sources[0].name if sources else ""
        found = source.fullmatch(name() if callable(name) else name)
        if found:
            names[str(symbol)] = label(int(found.group(1)), int(found.group(2)))
    named = source.sub(lambda m: label(int(m.group(1)), int(m.group(2))), message)
    named = re.sub(r"\bs\d+\b", lambda m: names.get(m.group(0), m.group(0)), named)
    return named, named != message


def _shape_env_of(exc: BaseException) -> Any:
    """The shape environment of a symbolic size that a frame of ``exc``'s tracebacks (its causes' too) holds."""
    cause: BaseException | None = exc
    while cause is not None:
        for frame, _ in traceback.walk_tb(cause.__traceback__):
            for value in list(frame.f_locals.values()):
                sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
                for size in sizes:
                    if isinstance(size, torch.SymInt) and size.node.shape_env is not None:
                        return size.node.shape_env
        cause = cause.__cause__ or cause.__context__
    return None


def _user_frame(exc: BaseException, guard: ExportGuard) -> str:
    """``in module M at file:line (code)``: the innermost frame of ``exc``'s traceback outside torch and this
    package, with the module whose method it is (as ``guard`` names it)."""
    libraries = (os.path.dirname(torch.__file__) + os.sep,  # torch, and this package
                 os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep)
    found = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if not frame.f_code.co_filename.startswith(libraries):
            found = frame, lineno
    if found is None:
        return "in the model"
    frame, lineno = found
    label = guard.module_label(frame.f_locals.get("self"))
    module = f"in module {label} " if label else ""
    return f"{module}at {source_line(frame.f_code.co_filename, lineno)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["Scaled", "autocast_context", "export_program", "export_train", "tensors_by_name"]
