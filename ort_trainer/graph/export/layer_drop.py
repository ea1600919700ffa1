"""Layer drop (LayerDrop, Fan et al. 2019) decided in the graph at every step instead of frozen by the trace.

Hugging Face's encoders and decoders with a ``layerdrop`` above 0 (wav2vec2, HuBERT, WavLM and the other speech
encoders, 0.1 by default; BART, Whisper, M2M100... when set) skip each layer in training with that probability,
drawn with torch and read into Python::

    for layer in self.layers:
        if self.training and self.config.layerdrop > 0.0:
            dropout_probability = torch.rand([])
            skip_the_layer = dropout_probability < self.config.layerdrop
        if not skip_the_layer or synced_gpus:
            hidden_states = layer(hidden_states, ...)

A trace would freeze the traced step's decisions. While the model is exported, such a decision reads as "keep
the layer", and the layer's output becomes ``where(drop, its input, its output)`` with the draw in the graph: each
layer is dropped with probability p, anew at every step, the dropped one passing its input on as in PyTorch. A
decision is a 0-d boolean tensor ``draw < p`` (drop) or ``draw > p`` (keep) whose truth value is read on an ``if``
line of a loop over a module list (``for layer in self.layers``), ``draw`` a ``torch.rand`` in the loop, and the
loop's code after it calls nothing but the layer: all recognised from the loop's source. wav2vec2's adapter draws
with NumPy (``np.random.random()``, every step, whatever p): in such a loop the draw is made with torch instead.

Every layer is computed, and a dropped layer's weights get a zero gradient where PyTorch gives them none: plain SGD
leaves them as PyTorch does, while momentum, Adam's moments and weight decay still move them (logged once per
loop, as a warning). At p = 0 nothing is dropped or blended. A layer that changes its input's shape (the
adapter's strided convolutions) cannot be passed over in a graph of fixed shapes: refused above p = 0.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import threading
from types import FrameType
from typing import Any, Callable, Iterator

import torch

from ..._logging import warn_once
from .validations import source_line, source_tree

_STATE = threading.local()  # the export in progress on this thread (``_Drops``), if any


# the draws a layer drop compares with its probability: torch's, and the Python ones the trace would freeze
# (Hugging Face's wav2vec2 adapters draw with NumPy), which are drawn with torch instead (``python_draw``)
_TORCH_DRAWS = {"torch.rand"}
_PYTHON_DRAWS = {"np.random.random", "numpy.random.random", "np.random.uniform", "numpy.random.uniform",
                 "random.random"}


def _draw(node: ast.expr) -> str | None:
    """The name of the draw of one number in [0, 1) that ``node`` calls (``torch.rand``, ``np.random.random``)."""
    if not isinstance(node, ast.Call):
        return None
    name = ast.unparse(node.func)
    if name.endswith("uniform") and [ast.unparse(a) for a in node.args] not in ([], ["0", "1"]):
        return None
    return name if name in _TORCH_DRAWS | _PYTHON_DRAWS else None


def _listed_attribute(node: ast.expr) -> tuple[str, str] | None:
    """``(owner, X)`` where a loop iterates ``owner.X`` or ``enumerate(owner.X)`` (``owner`` a name: ``self``)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "enumerate" and node.args:
        node = node.args[0]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


@dataclasses.dataclass(frozen=True)
class _Loop:
    """A loop over ``owner.attribute`` whose layers a draw drops: the lines that read a decision (each with whether
    its truth means "drop", and the probability's expression) and the lines that draw in Python."""

    owner: str
    attribute: str
    decisions: dict[int, tuple[bool, ast.expr]]
    python_draws: frozenset[int]


def _decisions(loop: ast.For) -> tuple[dict[int, tuple[bool, ast.expr]], set[int]]:
    """The lines of the ``if`` tests in ``loop`` that read a decision, ``draw < p`` (drop; or ``<=``) or ``draw > p``
    (keep; or ``>=``) with ``draw`` assigned a draw in the loop, or a name assigned an expression holding that
    comparison; and the lines of the Python draws."""
    nodes = list(ast.walk(loop))
    assigned = [(node, _draw(node.value)) for node in nodes if isinstance(node, ast.Assign)]
    draws = {target.id for node, name in assigned if name for target in node.targets if isinstance(target, ast.Name)}
    senses = {ast.Lt: True, ast.LtE: True, ast.Gt: False, ast.GtE: False}
    tests = {node: (senses[type(node.ops[0])], node.comparators[0]) for node in nodes
             if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id in draws
             and len(node.ops) == 1 and type(node.ops[0]) in senses}
    named = {target.id: tests[inner] for node in nodes if isinstance(node, ast.Assign)
             for inner in ast.walk(node.value) if inner in tests
             for target in node.targets if isinstance(target, ast.Name)}
    lines = {}
    for node in nodes:
        if isinstance(node, ast.If):
            read = [tests[inner] if inner in tests else named[inner.id] for inner in ast.walk(node.test)
                    if inner in tests or isinstance(inner, ast.Name) and inner.id in named]
            if read:
                lines.update(dict.fromkeys(range(node.test.lineno, (node.test.end_lineno or node.test.lineno) + 1),
                                           read[0]))
    return lines, {node.lineno for node, name in assigned if name in _PYTHON_DRAWS}


@functools.lru_cache(maxsize=256)
def _loop(filename: str, lineno: int) -> _Loop | None:
    """The innermost loop over a list of layers around ``lineno``, where its layers are dropped by a draw and its
    code after the first decision calls nothing but the layer."""
    tree = source_tree(filename)
    if tree is None:
        return None
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For) and _listed_attribute(node.iter)
             and node.lineno <= lineno <= (node.end_lineno or 0)]
    if not loops:
        return None
    loop = max(loops, key=lambda node: node.lineno)
    decisions, python_draws = _decisions(loop)
    if not decisions or not _only_the_layer_after(loop, min(decisions)):
        return None
    return _Loop(*_listed_attribute(loop.iter), decisions, frozenset(python_draws))


def _probability(expression: ast.expr, frame: FrameType) -> float | None:
    """The value of ``expression`` (a number, or attributes of a local: ``self.config.layerdrop``) on ``frame``."""
    if isinstance(expression, ast.Constant):
        return expression.value if isinstance(expression.value, (int, float)) else None
    names = []
    while isinstance(expression, ast.Attribute):
        names.append(expression.attr)
        expression = expression.value
    if not isinstance(expression, ast.Name) or expression.id not in frame.f_locals:
        return None
    value = frame.f_locals[expression.id]
    for name in reversed(names):
        value = getattr(value, name, None)
    return float(value) if isinstance(value, (int, float)) else None


def _only_the_layer_after(loop: ast.For, line: int) -> bool:
    """Whether the code of ``loop`` after ``line`` (what a dropped layer skips, and more) calls nothing but the
    loop's layer (and ``isinstance``): anything else it computed from the layer's output would be computed from
    the blended output, which PyTorch skips (DETR's decoders normalise each layer's output)."""
    target = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) and loop.target.elts else loop.target
    allowed = {"isinstance", target.id if isinstance(target, ast.Name) else None}
    return all(isinstance(node.func, ast.Name) and node.func.id in allowed
               for node in ast.walk(loop) if isinstance(node, ast.Call) and node.lineno > line)


def _blend(drop: torch.Tensor, hidden: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """The layer's ``output`` with its hidden states replaced by its input ``hidden`` where ``drop``: the output a
    tensor shaped as the input, or a tuple of one first and tensors the call was given (WavLM's position bias) or
    other values; None where the output is not such."""
    if not isinstance(hidden, torch.Tensor):
        return None
    if isinstance(output, torch.Tensor) and output.shape == hidden.shape:
        return torch.where(drop, hidden, output)
    given = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) \
            and output[0].shape == hidden.shape \
            and all(not isinstance(value, torch.Tensor) or any(value is g for g in given) for value in output[1:]):
        return (torch.where(drop, hidden, output[0]), *output[1:])
    return None


class _Drops:
    """The decisions of one traced forward waiting for their layer's call, and the hooks that blend them in."""

    def __init__(self, report: Callable[[str], None]) -> None:
        self.report = lambda text: report(text + " (in module {modules})")
        self.pending: dict[int, tuple[torch.Tensor, str]] = {}  # id(module list) -> (drop, where)
        self.handles: list[Any] = []
        self.hooked: set[int] = set()

    def drop(self, layers: torch.nn.ModuleList, decision: torch.Tensor, where: str) -> None:
        if id(layers) not in self.hooked:
            self.hooked.add(id(layers))
            for layer in layers:
                self.handles.append(layer.register_forward_hook(functools.partial(self._blend, id(layers)),
                                                                with_kwargs=True))
        self._left_over(id(layers))
        self.pending[id(layers)] = (decision, where)
        warn_once(("layer drop", where), "%s: layer drop, drawn in the graph at every step. Every layer is computed "
                  "and a dropped one passes its input on, as in PyTorch; its weights get a zero gradient where PyTorch "
                  "gives them none, so momentum, Adam's moments and weight decay still move them", where)

    def _blend(self, key: int, _module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if key not in self.pending:
            return None
        decision, where = self.pending.pop(key)
        hidden = args[0] if args else kwargs.get("hidden_states")  # the layer's input: the first argument
        blended = _blend(decision, hidden, args, kwargs, output)
        first = output[0] if isinstance(output, tuple) and output else output
        if blended is None and isinstance(hidden, torch.Tensor) and isinstance(first, torch.Tensor) \
                and first.shape != hidden.shape:
            self.report(f"layer drop at {where}: the layer changes its input's shape (a strided convolution: "
                        "wav2vec2's adapter), so a dropped layer would change the shapes after it, which the graph "
                        "cannot follow; set the model's layer drop probability to 0 (config.layerdrop)")
        elif blended is None:
            self.report(f"layer drop at {where}: the layer returns more than its hidden states (a tensor shaped as "
                        "its first input, with tensors it was given), so the graph cannot pass its input on in their "
                        "place; set the model's layer drop probability "
                        "to 0 (config.layerdrop, encoder_layerdrop, decoder_layerdrop)")
        return blended

    def _left_over(self, key: int) -> None:
        if key in self.pending:
            where = self.pending.pop(key)[1]
            self.report(f"layer drop at {where}: no layer of the list was called after the decision, so the graph "
                        "cannot tell which layer it drops; set the model's layer drop probability to 0 "
                        "(config.layerdrop, encoder_layerdrop, decoder_layerdrop)")

    def close(self) -> None:
        for key in list(self.pending):
            self._left_over(key)
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def decided_in_the_graph(report: Callable[[str], None]) -> Iterator[None]:
    """Within (the traced forward, on this thread): :func:`decision` recognises layer drops; ``report(text)``
    is called for one it cannot express."""
    _STATE.drops = drops = _Drops(report)
    try:
        yield
    finally:
        _STATE.drops = None
        drops.close()


def decision(frame: FrameType | None, value: torch.Tensor) -> bool | None:
    """The truth value that keeps the layer where ``value`` (whose truth value the code on ``frame``'s line reads)
    is a layer drop decision, whose layer is then blended in with it; None where it is none."""
    drops = getattr(_STATE, "drops", None)
    if drops is None or frame is None or value.dim() != 0 or value.dtype != torch.bool:
        return None
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    loop = _loop(filename, lineno)
    if loop is None or lineno not in loop.decisions:
        return None
    layers = getattr(frame.f_locals.get(loop.owner), loop.attribute, None)
    if not isinstance(layers, torch.nn.ModuleList):
        return None
    dropping, threshold = loop.decisions[lineno]
    probability = _probability(threshold, frame)
    if probability is None or probability > 0:  # (a draw in [0, 1) is never below 0: no layer dropped)
        drops.drop(layers, value if dropping else torch.logical_not(value),
                   source_line(filename, lineno).replace("{", "{{").replace("}", "}}"))
    return not dropping


def python_draw(name: str, frame: FrameType) -> torch.Tensor | None:
    """A torch draw in [0, 1) for the Python draw ``name`` (``np.random.random``) called on ``frame``'s line where
    that line draws a layer drop (module docstring), which the graph then draws at every step; None elsewhere."""
    loop = _loop(frame.f_code.co_filename, frame.f_lineno) if getattr(_STATE, "drops", None) else None
    if loop is None or frame.f_lineno not in loop.python_draws or name not in _PYTHON_DRAWS:
        return None
    return torch.rand([])


__all__ = ["decided_in_the_graph", "decision", "python_draw"]
