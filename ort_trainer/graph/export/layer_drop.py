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

A trace would freeze the traced step's decisions. While the model is exported, such a decision (a 0-d boolean
tensor ``draw < p`` whose truth value is read on a line of a loop over a module list of the model, the draw
``torch.rand``, recognised from the loop's source) reads as "keep the layer", and the layer's output becomes
``where(drop, its input, its output)`` with the draw in the graph: each layer is dropped with probability p,
anew at every step, the dropped one passing its input on as in PyTorch. Every layer is computed, and a dropped
layer's weights get a zero gradient where PyTorch gives them none: plain SGD leaves them as PyTorch does, while
momentum, Adam's moments and weight decay still move them (logged once per loop, as a warning).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import linecache
import threading
from types import FrameType
from typing import Any, Callable, Iterator

import torch

from ..._logging import logger
from .validations import source_tree

_STATE = threading.local()  # the export in progress on this thread (``_Drops``), if any
_WARNED: set[str] = set()


def _is_rand(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rand"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch")


def _listed_attribute(node: ast.expr) -> tuple[str, str] | None:
    """``(owner, X)`` where a loop iterates ``owner.X`` or ``enumerate(owner.X)`` (``owner`` a name: ``self``)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "enumerate" and node.args:
        node = node.args[0]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


def _decision_lines(loop: ast.For) -> set[int]:
    """The lines of the ``if`` tests in ``loop`` that read a drop decision: ``draw < p`` (or ``<=``) with ``draw``
    assigned ``torch.rand(...)`` in the loop, or a name assigned an expression holding that comparison."""
    nodes = list(ast.walk(loop))
    draws = {target.id for node in nodes if isinstance(node, ast.Assign) and _is_rand(node.value)
             for target in node.targets if isinstance(target, ast.Name)}
    tests = [node for node in nodes if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name)
             and node.left.id in draws and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Lt, ast.LtE))]
    decisions = {target.id for node in nodes if isinstance(node, ast.Assign)
                 and any(inner in tests for inner in ast.walk(node.value))
                 for target in node.targets if isinstance(target, ast.Name)}
    lines = set()
    for node in nodes:
        if isinstance(node, ast.If) and any(inner in tests or isinstance(inner, ast.Name) and inner.id in decisions
                                            for inner in ast.walk(node.test)):
            lines.update(range(node.test.lineno, (node.test.end_lineno or node.test.lineno) + 1))
    return lines


@functools.lru_cache(maxsize=256)
def _site(filename: str, lineno: int) -> tuple[str, str] | None:
    """``(owner, X)`` where ``lineno`` reads a drop decision in the innermost loop over ``owner.X`` that holds it."""
    tree = source_tree(filename)
    if tree is None:
        return None
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For) and _listed_attribute(node.iter)
             and node.lineno <= lineno <= (node.end_lineno or 0)]
    if not loops:
        return None
    loop = max(loops, key=lambda node: node.lineno)
    lines = _decision_lines(loop)
    return _listed_attribute(loop.iter) if lineno in lines and _only_the_layer_after(loop, min(lines)) else None


def _only_the_layer_after(loop: ast.For, line: int) -> bool:
    """Whether the code of ``loop`` after ``line`` (what a dropped layer skips, and more) calls nothing but the
    loop's layer (and ``isinstance``): anything else it computed from the layer's output would be computed from
    the blended output, which PyTorch skips (DETR's decoders normalise each layer's output)."""
    target = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) and loop.target.elts else loop.target
    allowed = {"isinstance", target.id if isinstance(target, ast.Name) else None}
    return all(isinstance(node.func, ast.Name) and node.func.id in allowed
               for node in ast.walk(loop) if isinstance(node, ast.Call) and node.lineno > line)


def _blend(drop: torch.Tensor, args: tuple, kwargs: dict, output: Any) -> Any:
    """The layer's ``output`` with its hidden states replaced by its input where ``drop``: the input is the first
    argument (or ``hidden_states=``), the output a tensor shaped as it, or a tuple of one first and tensors the
    call was given (WavLM's position bias) or other values; None where the output is not such."""
    hidden = args[0] if args else kwargs.get("hidden_states")
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
        if where not in _WARNED:
            _WARNED.add(where)
            logger.warning("%s: layer drop, drawn in the graph at every step. Every layer is computed and a dropped "
                           "one passes its input on, as in PyTorch; its weights get a zero gradient where PyTorch "
                           "gives them none, so momentum, Adam's moments and weight decay still move them", where)

    def _blend(self, key: int, _module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if key not in self.pending:
            return None
        decision, where = self.pending.pop(key)
        blended = _blend(decision, args, kwargs, output)
        if blended is None:
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
    """False ("keep the layer") where ``value`` (whose truth value the code on ``frame``'s line reads) is a layer drop
    decision, whose layer is then blended in; None where it is none."""
    drops = getattr(_STATE, "drops", None)
    if drops is None or frame is None or value.dim() != 0 or value.dtype != torch.bool:
        return None
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    site = _site(filename, lineno)
    layers = None if site is None else getattr(frame.f_locals.get(site[0]), site[1], None)
    if not isinstance(layers, torch.nn.ModuleList):
        return None
    where = f"{filename}:{lineno} ({linecache.getline(filename, lineno).strip()})"
    drops.drop(layers, value, where.replace("{", "{{").replace("}", "}}"))
    return False


__all__ = ["decided_in_the_graph", "decision"]
