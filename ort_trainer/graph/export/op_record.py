"""A cheap key for the graph cache: a record of the operators one eager forward runs.

``torch.export`` is what the graphs are built from and what the cache key hashes
(``pipeline.GraphJob.cache_key``), but tracing costs ~0.6 s per mode on the BERT-like model, plus
~1 s importing ``torch._dynamo`` in a fresh process. A cache hit does not need the program, only
proof that the program would be the same. ``record`` gets that from an eager run: the model
and loss run forward once in training mode and once in eval mode, on the sample batch (on fake
tensors for a large model: the operators and tensor metadata, no arithmetic), with the
flags the tracer sets, under a ``TorchDispatchMode`` that hashes every ATen operator that runs,
with its non-tensor arguments, the shapes, strides and dtypes of its tensors and where each tensor
came from (a data input, a weight by name, an earlier operator's output, or a constant, hashed by
value), and the grad and inference mode each operator ran under and whether each of its tensors
requires grad (a ``torch.no_grad()`` or ``set_grad_enabled(False)`` region, a ``detach()``: autograd
sits above the record, so these leave the operators themselves unchanged but not the backward).
Autocast regions show as the casts they insert. That is what was computed, not the source text: a module-level helper, a callable
attribute, a monkeypatched ``forward``, a ``functools.partial``'s keywords, an ``if
self.training`` branch, a device or autocast branch all change the operators that run.

When eval mode's record equals training mode's with each Dropout taken for the identity, eval mode
computes what training mode computes, Dropouts aside, and the pipeline takes the eval graph from the
training graph's forward part with its Dropouts removed instead of tracing eval mode
(``OpRecord.eval_is_training``). A second recorder of the training forward leaves Dropout's own
operators out of its record (``_Recorder(without_dropout=True)``: ``empty_like`` + ``bernoulli_`` +
``div_`` + ``mul``, or ``native_dropout``) and gives their output the label of their input, as eval
mode's identity would. Both modes run ``scaled_dot_product_attention`` by its math backend in the
record: training mode with a dropout cannot take the fused kernels eval mode takes, and the math
backend is the same function whatever the kernel, with its dropout as the one difference.

The pipeline maps a record key to the export key it was seen with (``GraphCache.link``) only
after a full trace in the same process produced both, so a record never names a graph that was
not traced from code producing that record.

What one eager forward cannot show makes the record decline (None), and the build then takes
the export path, whose guard handles it: module, parameter or tensor hooks (they run in the
backward), custom ``autograd.Function``s and custom operators (their backward is Python code),
a value read into Python (``.item()``: control flow may depend on the batch), a random draw in
Python (``random``, NumPy's global generator: ``python_draws``; one forward shows one outcome of it,
and a layer dropped with probability p that drew "keep" records what p 0 records), and Python
attributes the forward changes. Draws that follow a seed with a number are the same at every
forward: the record keys their outcome.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..._logging import logger
from ...model_desc import ModelDescription
from ..job import OpRecord
from . import adaptive_softmax, causal_masks, packed_sequences, python_draws
from .guard import _model_left_untouched
from .torchscript import _ModelWithLoss, export_order

# From this many weights on, the record's forwards run on fake tensors: an eager forward of
# GPT-2 small (124 M weights, batch 4 x 128) takes ~2.5 s here, a fake one ~0.4 s, but the
# first fake tensor of a process imports torch._dynamo (~1.3 s), more than a small model's
# whole eager forward.
FAKE_ABOVE = 1 << 24
_DATA_DEPENDENT = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default"}


class _Declined(Exception):
    """The forward did something a record cannot key (the reason is the message)."""


class _Recorder(TorchDispatchMode):
    """Hashes each ATen operator call: name, arguments, and the provenance of its tensors."""

    def __init__(self, labels: dict[int, str], without_dropout: bool = False):
        super().__init__()
        self._labels = dict(labels)
        self._alive: list[torch.Tensor] = []  # constants: their ids stay unique while the record runs
        self._watched: dict[int, weakref.ref] = {}  # outputs: a label leaves with its tensor
        self._count = 0
        self.digest = hashlib.sha256()
        # without_dropout: Dropout's operators left out (the record eval mode would make of them)
        self._without_dropout = without_dropout
        self._pending: tuple[str, torch.Tensor] | None = None  # an ``empty_like``: a mask, if ``bernoulli_`` fills it
        self._masks: dict[int, weakref.ref] = {}
        self.unsure = False  # a mask was read by something else than Dropout's own operators

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # never under torch.compile; the default wraps __torch_dispatch__ in a dynamo disable,
        # which imports torch._dynamo (~1 s in a fresh process) on the first operator
        return False

    def _forget(self, key: int, ref: weakref.ref) -> None:
        if self._watched.get(key) is ref:
            del self._watched[key], self._labels[key]

    def _watch(self, tensor: torch.Tensor, label: str) -> None:
        """Label an output; the label leaves with the tensor (a new tensor may take its id)."""
        key = id(tensor)
        self._labels[key] = label
        self._watched[key] = weakref.ref(tensor, functools.partial(self._forget, key))

    def _tensor(self, tensor: torch.Tensor) -> str:
        label = self._labels.get(id(tensor))
        if label is None:  # made outside the forward and not a weight: a constant of the graph
            label = f"const:{_value_hash(tensor)}"
            self._labels[id(tensor)] = label
            self._alive.append(tensor)
        # requires_grad: a ``detach()`` or a ``no_grad`` region upstream cuts the backward there
        return f"{label}{tuple(tensor.shape)}{tuple(tensor.stride())}{tensor.dtype}{'g' if tensor.requires_grad else ''}"

    def _encode(self, value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, (list, tuple)):
            return "(" + ",".join(self._encode(v) for v in value) + ")"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{self._encode(v)}" for k, v in sorted(value.items())) + "}"
        return repr(value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":  # a fake tensor's metadata query (``prim.device``): computes nothing
            return func(*args, **kwargs)
        name = str(func)
        if name in _DATA_DEPENDENT:
            raise _Declined(f"the forward reads a tensor's value into Python ({name})")
        if func.namespace not in ("aten", "prims"):
            raise _Declined(f"the forward calls the custom operator {name}")
        if self._without_dropout:
            pending, self._pending = self._pending, None
            if name == "aten.bernoulli_.float" and pending is not None and args[0] is pending[1]:
                self._masks[id(args[0])] = weakref.ref(args[0])  # the empty_like and its filling: a mask
                return func(*args, **kwargs)
            if pending is not None:
                self._emit(*pending)
            dropped = self._dropout(func, name, args, kwargs)
            if dropped is not None:
                return dropped
        # Grad and inference mode live above this mode (autograd), so the operator itself is the
        # same inside ``torch.no_grad()``; what the trace makes of it is not: no backward through it.
        modes = f"{'G' if torch.is_grad_enabled() else ''}{'I' if torch.is_inference_mode_enabled() else ''}"
        line = f"{name}|{modes}|{self._encode(args)}|{self._encode(kwargs)}"
        result = func(*args, **kwargs)
        if self._without_dropout and name == "aten.empty_like.default":
            self._pending = (line, result)  # recorded at the next operator, unless it makes a mask of it
        else:
            self._emit(line, result)
        return result

    def _emit(self, line: str, result: Any) -> None:
        """Label the outputs of an operator (not kept alive: an intermediate is freed when the
        forward drops it, as in an inference, and its label goes with it) and hash the call."""
        for output in result if isinstance(result, (list, tuple)) else [result]:
            if isinstance(output, torch.Tensor):
                self._watch(output, f"v{self._count}")
                self._count += 1
        self.digest.update(f"{line}->{self._encode(result)}\n".encode())

    def _is_mask(self, value: Any) -> bool:
        ref = self._masks.get(id(value)) if isinstance(value, torch.Tensor) else None
        return ref is not None and ref() is value

    def _dropout(self, func, name: str, args: tuple, kwargs: dict) -> Any:
        """Run a Dropout's own operator unrecorded, its output labelled as its input; None for any
        other operator (a mask read by any other marks the record ``unsure``)."""
        if name == "aten.native_dropout.default" and len(args) > 2 and args[2] is True and not kwargs:
            output, mask = func(*args)
            self._watch(output, self._label(args[0]))
            return output, mask
        flat = [*args, *(v for value in args if isinstance(value, (list, tuple)) for v in value), *kwargs.values()]
        if not any(self._is_mask(value) for value in flat):
            return None
        if name == "aten.div_.Scalar" and self._is_mask(args[0]) and not kwargs:
            return func(*args)  # the mask scaled by 1 / (1 - p)
        if (name == "aten.mul.Tensor" and len(args) == 2 and not kwargs and self._is_mask(args[1])
                and not self._is_mask(args[0]) and args[0].shape == args[1].shape):
            output = func(*args)
            self._watch(output, self._label(args[0]))
            return output
        self.unsure = True
        return None

    def _label(self, tensor: torch.Tensor) -> str:
        self._tensor(tensor)  # a tensor made outside the forward gets its constant's label
        return self._labels[id(tensor)]

    def finish(self) -> bytes:
        """The record's digest, once the forward has run."""
        if self._pending is not None:
            self._emit(*self._pending)
            self._pending = None
        return self.digest.digest()


def record(model: Any, loss_fn: Callable | None, desc: ModelDescription,
           sample_inputs: Sequence[np.ndarray], tracing: Callable[[], Any] = contextlib.nullcontext,
           on_fake: bool | None = None) -> OpRecord | None:
    """The operator record of ``model`` with ``loss_fn`` on inputs of the sample's shapes and dtypes.

    Args:
        model: the user's module (anything else, e.g. an ONNX model, has no record: None).
        loss_fn: ``loss_fn(prediction, *labels)`` or None.
        desc: the model description (input order, outputs).
        sample_inputs: one array per description input.
        tracing: a context manager that sets the flags the gradient source's tracer sets (code
            may branch on ``torch.compiler.is_exporting()``): the record then runs the branches
            the trace runs.
        on_fake: run the forwards on fake tensors (shapes, strides and dtypes, no arithmetic);
            None: when the model has at least ``FAKE_ABOVE`` weights. The record is the same
            either way (the operators and their tensors' metadata, never intermediate values).

    Returns:
        The record: its key a hex SHA-256 of both modes' records, and whether eval mode ran the
        very operators training mode ran, Dropouts aside (no BatchNorm, no ``if self.training``
        branch that changes what is computed); None when the forward does
        something a record cannot key (logged at DEBUG). The model is left as it was: modes,
        buffers, requires_grad flags, torch's RNG.
    """
    if not isinstance(model, torch.nn.Module):
        return None
    count = len(desc.inputs) - (1 if loss_fn is not None else 0)
    wrapper = _ModelWithLoss(model, loss_fn, desc.input_names[:count])
    try:
        _refuse_hooks(wrapper)
        labels = _weight_labels(wrapper)
        inputs = [torch.from_numpy(np.ascontiguousarray(a)) for a in sample_inputs]
        labels.update({id(t): f"input:{n}" for n, t in zip(desc.input_names, inputs)})
        digest = hashlib.sha256(repr([sorted(set(labels.values())), export_order(desc, loss_fn is not None),
                                      desc.fingerprint(), torch.__version__,
                                      str(torch.get_default_dtype())]).encode())
        state = _python_state(wrapper)
        if on_fake is None:
            on_fake = sum(t.numel() for t in wrapper.state_dict(keep_vars=True).values()) >= FAKE_ABOVE
        fake = (lambda: FakeTensorMode(allow_non_fake_inputs=True)) if on_fake else contextlib.nullcontext
        modes, draws = [], []
        with _model_left_untouched(wrapper):
            for training in (True, False):
                wrapper.train_as_traced() if training else wrapper.train(False)
                recorders = [_Recorder(labels)] + ([_Recorder(labels, without_dropout=True)] if training else [])
                # grad enabled in both modes, as the traces are; the fake mode is entered before the
                # recorders, so they see the real weights and inputs (their labels' ids)
                try:
                    with contextlib.ExitStack() as stack:
                        for context in (torch.enable_grad(), _nothing_saved(), tracing(), _HookWatch(),
                                        packed_sequences.masked_recurrences(), adaptive_softmax.without_branches(),
                                        causal_masks.taken_as_given(),
                                        python_draws.reporting(draws.append), sdpa_kernel([SDPBackend.MATH]),
                                        fake(), *recorders):
                            stack.enter_context(context)
                        outputs = wrapper(*inputs)
                except _Declined:
                    raise
                except Exception as exc:  # the trace reports what is wrong, in its own words
                    raise _Declined(f"the forward failed ({type(exc).__name__})") from exc
                if draws:  # this forward's outcome is one of several: its record keys none of them
                    raise _Declined(f"the forward draws random numbers in Python ({draws[0]}())")
                if training:
                    _refuse_custom_functions(outputs)
                    without_dropout = None if recorders[1].unsure else recorders[1].finish()
                modes.append(recorders[0].finish())
                digest.update(modes[-1])
                del outputs, recorders
        if _python_state(wrapper) != state:
            raise _Declined("the forward changes the model's Python attributes")
    except _Declined as exc:
        logger.debug("no record key (%s); the graph cache is looked up by the export's key", exc)
        return None
    return OpRecord(digest.hexdigest(), eval_is_training=without_dropout == modes[1])


def _drop(tensor: torch.Tensor) -> None:
    """The pack hook of ``_nothing_saved``: keeps nothing."""
    return None


def _nothing_saved() -> contextlib.AbstractContextManager:
    """Autograd keeps none of the tensors it would save for a backward the record never runs: the
    forward holds what an inference holds. (Saving them kept the GPT-2-like model's activations,
    ~300 MB, resident until the record ended: the process's peak RSS.)"""
    return torch.autograd.graph.saved_tensors_hooks(_drop, lambda packed: packed)


@contextlib.contextmanager
def exporting_flags() -> Iterator[None]:
    """The flags non-strict ``torch.export`` sets while it traces: ``torch.compiler.is_compiling()``
    and ``is_exporting()`` (torch/_export/utils.py ``_compiling_state_context``) and
    ``torch.fx._symbolic_trace.is_fx_tracing()`` (set by the make_fx tracer)."""
    from torch.fx import _symbolic_trace

    old = torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag, _symbolic_trace._is_fx_tracing_flag
    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
    _symbolic_trace._is_fx_tracing_flag = True
    try:
        yield
    finally:
        (torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag,
         _symbolic_trace._is_fx_tracing_flag) = old


def _weight_labels(wrapper: torch.nn.Module) -> dict[int, str]:
    """``{id(tensor): label}`` of every parameter and buffer: its first name and requires_grad,
    plus the values of non-persistent buffers (constants of the graph)."""
    labels = {}
    persistent = set(wrapper.state_dict(keep_vars=True))
    for name, tensor in [*wrapper.named_parameters(remove_duplicate=False),
                         *wrapper.named_buffers(remove_duplicate=False)]:
        if tensor is None or id(tensor) in labels:
            continue
        label = f"weight:{name}:{tensor.requires_grad}"
        if name not in persistent:
            label += ":" + _value_hash(tensor)
        labels[id(tensor)] = label
    return labels


class _HookWatch(TorchFunctionMode):
    """Declines when the forward registers a hook on a tensor or runs under saved-tensor hooks of
    its own (they would run in the backward). Packs and unpacks packed sequences as the trace does
    (``packed_sequences``: the padded batch, no size read from the lengths)."""

    _HOOKS = {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._HOOKS:
            raise _Declined("the forward registers a tensor hook")
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if hooks is not None and hooks[0] is not _drop:  # the record's own (``_nothing_saved``) aside
            raise _Declined("the forward runs under saved-tensor hooks")
        return packed_sequences.REPLACEMENTS.get(func, func)(*args, **(kwargs or {}))


def _value_hash(tensor: torch.Tensor) -> str:
    if not tensor.numel():
        return "empty"
    data = tensor.detach().contiguous().cpu().reshape(-1)  # 1-d: a 0-d tensor cannot be viewed as bytes
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:32]


def _refuse_hooks(wrapper: torch.nn.Module) -> None:
    from torch.nn.modules import module as module_mod

    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    if any(getattr(module_mod, f"_global{h}", None) for h in hooks):
        raise _Declined("global module hooks are registered")
    for name, module in wrapper.named_modules():
        if any(getattr(module, h, None) for h in hooks):
            raise _Declined(f"module {name or '<top>'} has hooks")
    for name, parameter in wrapper.named_parameters():
        if parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None):
            raise _Declined(f"parameter {name} has hooks")


def _refuse_custom_functions(outputs: Any) -> None:
    """Walk the autograd graph of the forward's outputs; a custom Function's backward is Python."""
    roots = [t.grad_fn for t in (outputs if isinstance(outputs, (list, tuple)) else [outputs])
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            raise _Declined(f"the forward applies a custom autograd.Function ({type(node).__name__})")
        stack.extend(next_node for next_node, _ in node.next_functions)


def _python_state(wrapper: torch.nn.Module) -> list:
    """The modules' plain Python attributes (what a forward that changes state would change)."""
    plain = (bool, int, float, str, type(None))
    return [(name, sorted((k, repr(v)) for k, v in vars(module).items() if isinstance(v, plain)))
            for name, module in wrapper.named_modules()]


__all__ = ["exporting_flags", "record"]
