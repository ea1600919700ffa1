"""What the export trace would silently get wrong: honoured where it can be, refused where not.

One guard, two routes. The ``onnxruntime`` gradient source exports with the TorchScript tracer
(``torchscript.py``, ``stop_gradients=True``); the ``torch`` source traces with ``torch.export``
(``gradient/autograd.py``, ``stop_gradients=False``), whose program autograd differentiates, so
gradient stops need no marker there and ``.data`` becomes ``detach()`` (``torch.export`` cannot
trace ``.data``). The refusals below are the same on both routes unless said otherwise.

The TorchScript tracer records the tensor operations one forward pass makes. These PyTorch
semantics live outside that record:

- **Gradient stops.** ``Tensor.detach()``, ``.data`` and operations under ``torch.no_grad()``
  trace as ordinary operations, so a gradient builder differentiating the graph would train the
  weights behind them. During the export, ``detach``/``.data`` and every tensor that requires grad
  entering an operation while grad mode is off go through :class:`StopGradient`, which exports as a
  ``ort_trainer::StopGradient`` marker node; ``gradient/ort_builder.py`` cuts the gradient at the markers and
  turns them into ``Identity``.
- **Backward-only code**: a custom ``torch.autograd.Function``'s backward (the trace keeps its
  forward), tensor and module backward hooks, ``torch.autograd.grad`` inside the forward. Refused
  when PyTorch would run it (grad on, an input that requires grad). Reentrant checkpointing, whose
  backward recomputes its forward, is traced as the plain call (``_checkpointed_call``).
- **Data read into Python** (``if x.mean() > 0``, ``.item()``, ``float(x)``, ``.tolist()``...).
  The value of the traced batch becomes a constant. Values derived from model inputs, weights or
  buffers are refused (a taint carried through every torch call); values derived from shapes only
  (``x.size(0) > 1``) are recorded by the tracer and allowed. ``torch.export`` cannot freeze such
  a value (it stops at the first one); the guard names it before that. A layer drop read from a draw in a loop
  over layers is decided in the graph instead (``layer_drop.py``).
- **State changed by the forward** (a buffer updated in place, a weight clamped through
  ``.data``): the graph would never store it. Refused, BatchNorm statistics excepted (trained by
  ``passes/buffers.py``); on the ``torch`` route a persistent buffer changed in place is a graph
  output the trainer stores after each step, as BatchNorm's (``_stored``). There the real tensors are
  not touched while tracing: the traced copies' version counters and the program's mutation outputs
  say what changed (``check_program``).
- **In-place change under ``torch.no_grad()`` of a tensor that requires grad**: refused on the
  TorchScript route only; autograd over the ``torch.export`` program keeps PyTorch's gradient.

Every problem found in the one traced forward is collected, with the module (as in
``model.named_modules()``) and the source line, and reported together.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from typing import Any, Iterator

import numpy as np
import onnxruntime as ort
import torch
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..._logging import logger
from . import (adaptive_softmax, causal_masks, checked_losses, cholesky, ctc, data_sizes, distribution_checks,
               fused_lstm, layer_drop, linalg, packed_sequences, python_draws, rewritten_functions, spec_augment,
               validations)
from .guard_state import StateChanges
from . import view_writes
from .view_writes import ViewWrites, is_in_place
from .guard_tables import CONVERSIONS, DRAWS, METADATA, PLACEHOLDERS
from .trace_tools import TensorSet

GUARD_FILE = os.path.abspath(__file__)  # tracer warnings raised from here are conversions already handled
STOP_GRADIENT_DOMAIN = "ort_trainer"
STOP_GRADIENT_OP = "StopGradient"

_TORCH_DIR = os.path.dirname(torch.__file__)
# Functions whose backward is their forward's derivative, written out by hand (Megatron's GELU, DeBERTa's masked
# softmax and dropout in SEW-D): the gradient of the traced forward is theirs (test_hf_families.py, in float64)
DERIVATIVE_BACKWARDS = {"transformers.models.bloom.modeling_bloom.GeLUFunction",
                        *(f"transformers.models.sew_d.modeling_sew_d.{name}" for name in ("XSoftmax", "XDropout"))}
# onnxruntime-training wraps torch.utils.checkpoint.checkpoint when its ortmodule is imported
_LIBRARY_DIRS = tuple(d + os.sep for d in (_TORCH_DIR, os.path.dirname(ort.__file__)))
_REENTRANT_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction
# what the torch.export route computes instead of these functions
_REPLACEMENTS = {**{f: ctc.ctc_loss for f in ctc.FUNCTIONS}, **checked_losses.REPLACEMENTS, **linalg.REPLACEMENTS,
                 **cholesky.REPLACEMENTS, **rewritten_functions.REPLACEMENTS, **packed_sequences.REPLACEMENTS}
_TRUTH_TESTS = (torch._is_all_true, torch._is_any_true)  # a bool tensor torch.export reads into Python
_OWN_OPERATORS = "GeneratedBackwardFor_ort_trainer_"  # the Functions torch.library makes of ort_trainer's operators
# Frames between the user's line and the guard: torch's dispatch to the mode, and this package.
_DISPATCH_FILES = (
    GUARD_FILE, os.path.join(os.path.dirname(GUARD_FILE), "torchscript.py"), python_draws.__file__, data_sizes.__file__,
    view_writes.__file__,
    *(os.path.join(_TORCH_DIR, *p) for p in [("overrides.py",), ("_tensor.py",), ("autograd", "function.py"),
                                           ("utils", "_contextlib.py"), ("autograd", "grad_mode.py")]),
)

_AUTOGRAD_CALLS = {torch.autograd.grad: "torch.autograd.grad()", torch.autograd.backward: "torch.autograd.backward()",
                   torch.Tensor.backward: "Tensor.backward()"}
_CONVERSION_FIX = ("compute it with tensor operations instead (torch.where, masks, clamp, arithmetic), so it "
                   "is recomputed for every batch")


class StopGradient(torch.autograd.Function):
    """Identity whose output carries no gradient; exports as the ``ort_trainer::StopGradient`` marker."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.detach()  # an alias, as detach and .data are: an in-place change reaches the original
        ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:
        return None

    @staticmethod
    def symbolic(g, x):
        out = g.op(f"{STOP_GRADIENT_DOMAIN}::{STOP_GRADIENT_OP}", x)
        out.setType(x.type())
        return out


def _user_saved_tensors_hooks() -> bool:
    """Whether pack/unpack hooks of the user's (not torch's own) are active."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and not getattr(hooks[0], "__module__", "").startswith("torch.")


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property of Tensor (shape, data, T...): name the property
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _is_metadata(name: str) -> bool:
    return name in METADATA or (name.startswith(("is_", "_is")) and name != "is_nonzero")


def _is_python_value(value: Any) -> bool:
    leaves = tree_flatten(value)[0]
    return bool(leaves) and all(isinstance(v, (bool, int, float, complex, np.ndarray, np.generic)) for v in leaves)


class ExportGuard(StateChanges):
    """Watches one export trace; ``problems`` lists what it cannot honour.

    Args:
        wrapper: the module being exported (the user's model under ``model``, plus the loss).
        has_loss_fn: whether code outside the model is the user's loss function.
        stop_gradients: True for the TorchScript route (gradient stops become ``StopGradient``
            markers); False for ``torch.export``, whose autograd honours them itself.
        lstm_layers: ``torch.lstm`` as oneDNN's LSTM layers where it applies (``fused_lstm.py``; the
            ``torch.export`` route): ``"training"`` (the training program's trace) or ``"eval"``; None: torch's.
    """

    def __init__(self, wrapper: torch.nn.Module, has_loss_fn: bool, stop_gradients: bool = True,
                 lstm_layers: str | None = None):
        self._wrapper = wrapper
        self._stop_gradients = stop_gradients
        self._replacements = {**_REPLACEMENTS, **(fused_lstm.replacements(lstm_layers == "training")
                                                  if lstm_layers else {})}
        self._lstm_direction = (functools.partial(fused_lstm.masked_direction, lstm_layers == "training")
                                if lstm_layers else None)
        self._builder = ("ONNX Runtime builds the backward graph" if stop_gradients else
                         "the backward graph comes from autograd's formulas for the traced operations")
        self._outside_model = "the loss function" if has_loss_fn else "<top-level forward>"
        self._labels: dict[int, str] = {}
        for name, module in wrapper.named_modules():
            if name == "model":
                self._labels.setdefault(id(module), f"<top-level forward> ({type(module).__name__})")
            elif name.startswith("model."):
                self._labels.setdefault(id(module), f"{name[len('model.'):]} ({type(module).__name__})")
        self._stack: list[str] = []
        self._tainted = TensorSet()
        self._problems: dict[tuple, tuple[str, list[str]]] = {}
        self._watching = False
        self._sizes = data_sizes.DataSizes()  # the TorchScript route's tensors sized by the data
        self._view_writes = ViewWrites()  # and its changes through views (view_writes.py)
        self.functions: list[str] = []  # custom autograd Functions the forward applied, as "Class in module M"

    def module_label(self, module: Any) -> str | None:
        """``module`` as the problems name it (``path (Class)``), or None where it is no module of the model."""
        return self._labels.get(id(module))

    @property
    def problems(self) -> list[str]:
        """One line per problem: the construct, where, the module(s) and the fix."""
        lines = []
        for (_, where), (text, modules) in self._problems.items():
            lines.append(text.format(where=where, modules=", ".join(modules)))
        return lines

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """Active around the whole ``torch.onnx.export`` call: sees custom autograd Functions."""
        original_apply = torch.autograd.Function.__dict__["apply"]
        guard, thread = self, threading.get_ident()

        def apply(cls, *args, **kwargs):
            if cls is _REENTRANT_CHECKPOINT and threading.get_ident() == thread:
                return guard._checkpointed_call(*args)
            if guard._watching and cls is not StopGradient and threading.get_ident() == thread:
                guard._check_function(cls, args, kwargs)
            grad_mode = torch.is_grad_enabled()
            result = original_apply.__func__(cls, *args, **kwargs)
            # A Function's forward runs with grad off, and autograd turns it back on in C++, unseen by
            # torch.export, which records only Python's grad-mode changes: a forward entering and leaving
            # torch.no_grad() (reentrant checkpointing does) left every later operation recorded without
            # gradient. Setting the mode again records it.
            torch._C._set_grad_enabled(grad_mode)
            return result

        # Function.apply is no torch function, so no mode sees it. The tracer records ``cls.apply``
        # and the exporter later looks for the Function's ``symbolic`` by comparing it with
        # ``cls.apply`` again: the swap must cover conversion too, not only the traced forward.
        torch.autograd.Function.apply = classmethod(apply)
        before = self._state_versions()
        try:
            with spec_augment.drawn_in_the_graph(self._wrapper):  # Hugging Face's NumPy SpecAugment, in torch
                yield
        finally:
            torch.autograd.Function.apply = original_apply
        self._check_state(before)

    @contextlib.contextmanager
    def watching(self, inputs: tuple) -> Iterator[None]:
        """Active around the wrapper's forward during the trace."""
        for tensor in [*inputs, *self._wrapper.parameters(), *self._wrapper.buffers()]:
            self._tainted.add(tensor)
        handles = []
        for module in self._wrapper.modules():
            label = self._labels.get(id(module))
            if label is None:
                continue
            handles.append(module.register_forward_pre_hook(lambda *_, label=label: self._stack.append(label),
                                                            prepend=True))
            handles.append(module.register_forward_hook(self._leave, always_call=True))
        # torch.export traces with fake copies of the weights and buffers, swapped in for the trace:
        # their version counters show what the forward changed
        before = None if self._stop_gradients else self._state_versions()
        self._watching = True
        try:
            with _GuardMode(self), python_draws.reporting(self._report_draw, layer_drop.python_draw), \
                    layer_drop.decided_in_the_graph(lambda text: self._report(("layer drop", text), text)), \
                    distribution_checks.without_branches(), adaptive_softmax.without_branches(), \
                    causal_masks.taken_as_given(), \
                    (contextlib.nullcontext() if self._stop_gradients else
                     packed_sequences.masked_recurrences(self._lstm_direction)):
                yield
        finally:
            if before is not None:
                self._check_state(before)
            self._watching = False
            for handle in handles:
                handle.remove()
            self._stack.clear()
            self._tainted.clear()

    def _leave(self, *_: Any) -> None:
        self._stack.pop()

    # ---- called by the mode -----------------------------------------------------------------
    def handle(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = _func_name(func)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tainted = name in DRAWS or self._tainted.any_of(tensors)
        if func in _AUTOGRAD_CALLS:
            self._report(("autograd", name), f"{_AUTOGRAD_CALLS[func]} inside the forward, in module {{modules}} at "
                         "{where}: the exported graph has no autograd, so the gradients it computes would be "
                         "frozen; compute that term without autograd, or train this model with PyTorch")
        elif _user_saved_tensors_hooks():
            self._report(("saved_tensors_hooks", ""), "torch.autograd.graph.saved_tensors_hooks around code of module "
                         f"{{modules}} at {{where}}: {self._builder}, so the pack/unpack hooks would never run and "
                         "the backward would use the values PyTorch's hooks replace; remove the hooks (torch's own, "
                         "torch.utils.checkpoint and save_on_cpu, are fine)")
        elif name == "_pack_padded_sequence" and self._stop_gradients:  # the torch route masks (packed_sequences)
            self._report(("packed",), "nn.utils.rnn.pack_padded_sequence in module {modules} at {where}: a packed "
                         "batch's size is the sum of the lengths' values, which the TorchScript trace cannot follow; "
                         "set graph.gradient_source='torch', which runs it as a padded batch masked by the lengths")
        elif self._stop_gradients and self._sizes.branch_on_size(name, tensors, _user_frame):
            self._report(("data size",), data_sizes.TEXT)
        elif not self._stop_gradients and (text := packed_sequences.data_use(name, tensors)) and \
                _user_frame().f_code.co_filename not in packed_sequences.READERS:
            self._report(("packed data", name), text)
        elif name in ("register_hook", "register_post_accumulate_grad_hook") and args[0].requires_grad:
            self._report(("hook", name), f"Tensor.{name}() in module {{modules}} at {{where}}: {self._builder}, so "
                         "a gradient hook would never run; remove the hook, or express its effect in the forward or "
                         "the loss")
        if tainted and name == "__bool__" and (kept := layer_drop.decision(_user_frame(), args[0])) is not None:
            return kept  # Hugging Face's layer drop: the layer is kept, and blended in with the draw (layer_drop.py)
        if name == "detach_":
            self._report(("detach_",), "Tensor.detach_() in module {modules} at {where}: the export cannot "
                         "detach a tensor in place; write x = x.detach()")
            out = func(*args, **kwargs)
        elif not self._stop_gradients:
            if tainted and name in PLACEHOLDERS:
                passing = validations.passing_value(_user_frame()) if name == "__bool__" else None
                if passing is not None:  # a check that raises: traced where it passes
                    return passing
                # torch.export cannot produce the value (it stops tracing there): the export is refused
                # anyway, so a stand-in lets the trace go on and find every other problem
                self._report_conversion(name)
                return PLACEHOLDERS[name](args[0])
            if func in _TRUTH_TESTS:  # torch.distributions' `if not torch._is_all_true(valid): raise` (constants too)
                passing = validations.passing_value(_user_frame())
                if passing is not None:
                    return torch.tensor(passing)
            if name == "data":
                out = args[0].detach()
            else:  # CTC loss as operators torch.export can trace (ctc.py), losses' checks traced where they pass
                out = self._replacements.get(func, func)(*args, **kwargs)
        elif name in ("detach", "data"):
            out = StopGradient.apply(args[0])
        elif not torch.is_grad_enabled() and not _is_metadata(name) and any(t.requires_grad for t in tensors):
            out = self._call_without_gradient(func, name, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self._stop_gradients:
            self._sizes.note(name, tensors, out)
            if (changed := self._view_writes.note(name, args, out, _user_source_line)) is not None:
                self._report(("view write", *changed), f"Tensor.{changed[0]} at {changed[1]} changes a view of a "
                             "tensor, and module {modules} reads that tensor at {where}: the TorchScript export drops "
                             "a change made through such a view (only basic indexing, x[:, :2] or select, writes it "
                             "back), so the graph would compute with the values from before it; make the change "
                             "through basic indexing or out of place, or set graph.gradient_source='torch'")
        if name == "__iter__":  # the rows come from one call the mode does not see: taint them here
            out = list(out)
            if tainted:
                for row in out:
                    self._tainted.add(row)
            return iter(out)
        if not tainted and name in CONVERSIONS and logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s of a value computed from shapes only, in module %s at %s: the tracer records it",
                         CONVERSIONS[name], self._stack[-1] if self._stack else self._outside_model,
                         _user_source_line())
        if tainted and not _is_metadata(name):
            if _is_python_value(out):
                if name != "__bool__" or validations.passing_value(_user_frame()) is None:
                    self._report_conversion(name)
            else:
                for value in tree_flatten(out)[0]:
                    if isinstance(value, torch.Tensor):
                        self._tainted.add(value)
                if is_in_place(name) and args and isinstance(args[0], torch.Tensor):
                    self._tainted.add(args[0])
        return out

    def _report_draw(self, name: str) -> None:
        self._report(("draw", name), f"a Python random draw ({name}()) in module {{modules}} at {{where}}: the trace "
                     "computes it once, so the graph repeats the traced batch's outcome every step (the same layers "
                     "dropped, the same positions masked); draw with torch inside the forward instead, as tensors "
                     "the computation multiplies in (keep = (torch.rand(()) >= p).to(x.dtype); x + keep * f(x)), "
                     "or turn the feature off")

    def _report_conversion(self, name: str) -> None:
        construct = CONVERSIONS.get(name, f"{name}() returning a Python value")
        self._report(("convert", name), f"{construct} in module {{modules}} at {{where}}: the value comes from the "
                     "batch, the weights, the buffers or a random draw, and the export would freeze it at its value "
                     f"for the traced batch; {_CONVERSION_FIX}")

    def _call_without_gradient(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        """An operation under ``torch.no_grad()``: its inputs that require grad pass a StopGradient."""
        mutated = args[0] if is_in_place(name) and args and isinstance(args[0], torch.Tensor) else None
        if mutated is not None and mutated.requires_grad:
            self._report(("in-place", name), f"in-place Tensor.{name} under torch.no_grad() on a tensor that requires "
                         "grad, in module {modules} at {where}: PyTorch's gradient passes through that tensor as if "
                         "it were unchanged (and a weight changed in place keeps the change), which the exported "
                         "graph cannot express; apply it outside torch.no_grad(), or to a copy "
                         f"(y = x.{name.rstrip('_')}(...))")

        def stop(value):
            if isinstance(value, torch.Tensor) and value.requires_grad and value is not mutated:
                stopped = StopGradient.apply(value)
                if value in self._tainted:
                    self._tainted.add(stopped)
                return stopped
            return value

        return func(*tree_map(stop, args), **tree_map(stop, kwargs))

    def _checkpointed_call(self, function: Any, _preserve_rng_state: bool, *args: Any) -> Any:
        """Reentrant gradient checkpointing as the plain call it recomputes: PyTorch runs ``function``
        under ``no_grad`` and again with gradient in the backward (the forward's random state restored),
        which gives the gradients of one call with gradient where grad is on and an input requires grad,
        and none otherwise. The backward graph is built whole either way; ``layer_recompute`` is the
        trainer's own checkpointing."""
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        with torch.set_grad_enabled(torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return function(*args)

    def _check_function(self, cls: type, args: tuple, kwargs: dict) -> None:
        if cls.__qualname__.startswith(_OWN_OPERATORS):
            return  # this package's operators (ctc.py): autograd runs the backward registered with torch.library
        module = self._stack[-1] if self._stack else self._outside_model
        if f"{cls.__qualname__} in module {module}" not in self.functions:
            self.functions.append(f"{cls.__qualname__} in module {module}")
        if not torch.is_grad_enabled() or f"{cls.__module__}.{cls.__qualname__}" in DERIVATIVE_BACKWARDS:
            return
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(t.requires_grad for t in tensors):
            return
        if cls.__module__ == "torch.nn.modules._functions" and cls.__name__ == "BackwardHookFunction":
            # applied around the module's forward, partly after its forward hooks: name the module itself
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_name != "_call_impl":
                frame = frame.f_back
            owner = frame.f_locals.get("self") if frame is not None else None
            self._report(("function", cls.__qualname__), "a module backward hook (register_full_backward_hook or "
                         f"register_full_backward_pre_hook) on module {{modules}}: {self._builder}, so the hook would "
                         "never run; remove the hook, or express its effect in the forward or the loss",
                         module=self._labels.get(id(owner)))
        elif cls.__qualname__.startswith("GeneratedBackwardFor_transformers_grouped_mm"):
            self._report(("function", cls.__qualname__), "Hugging Face's grouped_mm mixture-of-experts layer in module "
                         "{modules} at {where}: it calls transformers' custom operator grouped_mm (its backward "
                         "registered with torch.library), which has no ONNX translation and whose routing sizes are "
                         "read from the data; call model.set_experts_implementation(\"batched_mm\") before making "
                         "the trainer (the same values: each token's experts' weights gathered, a [tokens x experts "
                         "per token, ...] copy of them, so for small expert layers only)")
        else:
            self._report(("function", cls.__qualname__), f"custom torch.autograd.Function {cls.__qualname__} called "
                         f"in module {{modules}} at {{where}}: the exported graph keeps its forward only and "
                         f"{self._builder}, which differentiate the forward and never run the Function's backward; "
                         "write it with differentiable torch operations, or freeze the weights that feed it "
                         "(utils.frozen_weights)")

    # ---- bookkeeping --------------------------------------------------------------------------
    def _report(self, kind: Any, text: str, module: str | None = None) -> None:
        where = _user_source_line(outside_torch=kind[0] in ("function", "autograd", "hook", "packed", "packed data"))
        module = module or (self._stack[-1] if self._stack else self._outside_model)
        entry = self._problems.setdefault((kind, where), (text, []))
        if module not in entry[1]:
            entry[1].append(module)


class _GuardMode(TorchFunctionMode):
    def __init__(self, guard: ExportGuard):
        super().__init__()
        self._guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._guard.handle(func, args, kwargs or {})


def _user_frame(outside_torch: bool = False) -> Any:
    """The innermost frame outside torch's dispatch and this package's export code (``_user_source_line``)."""
    return validations.caller_outside(lambda filename: filename in _DISPATCH_FILES or (
        outside_torch and filename.startswith(_LIBRARY_DIRS)))


def _user_source_line(outside_torch: bool = False) -> str:
    """``file:line (code)`` of the innermost caller outside torch's dispatch and this package's export code.

    With ``outside_torch``, the innermost caller outside torch altogether (for what torch's own
    helpers apply on the user's behalf: checkpointing, autograd calls, hooks).
    """
    return validations.frame_line(_user_frame(outside_torch))


@contextlib.contextmanager
def _model_left_untouched(model: torch.nn.Module) -> Iterator[None]:
    """Restore requires_grad flags, each module's training mode, buffers (values, and the tensors a forward
    assigned in their place) and torch's RNG state."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(m._buffers, n, b, b.detach().clone()) for m in model.modules() for n, b in m._buffers.items()
               if b is not None]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            for parameter, flag in flags:
                parameter.requires_grad_(flag)
            for module, mode in modes:
                module.training = mode
            with torch.no_grad():
                for owner, name, buffer, saved in buffers:
                    owner[name] = buffer
                    buffer.copy_(saved)


__all__ = ["ExportGuard", "GUARD_FILE", "STOP_GRADIENT_DOMAIN", "STOP_GRADIENT_OP", "StopGradient"]
