"""Branches on a size that comes from the data, on the TorchScript route.

A tensor's size is fixed per graph, so a Python value read from it (``if x.size(0) > 1``) is the same at every
step, and the guard allows it. Not so for a tensor whose size its values give: ``nonzero``, a boolean mask's
selection (``x[mask]``, ``masked_select``), ``unique``... and what is computed from one. The TorchScript tracer
keeps arithmetic on such a size in the graph (``sel.sum() / sel.shape[0]`` divides by each batch's count), but
a branch on it runs once, at the traced batch: ``if sel.shape[0] == 0: return zero`` then returns zero at every
step, or never does (checked: a loss of 0.0 where PyTorch's was 0.093). The comparison happens on Python ints,
which no torch mode sees, so the guard refuses a size of such a tensor read on the line of an ``if``, ``elif``,
``while``, ``assert`` or conditional expression, or assigned to a name such a test further down the same function
reads (``ExportGuard.handle``). ``torch.export`` (the ``torch`` route)
refuses these branches itself ("Could not guard on data-dependent expression").
"""

from __future__ import annotations

import ast
import functools
from types import FrameType
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from . import validations
from .trace_tools import TensorSet

# operators whose output's size comes from their inputs' values
_SIZED_BY_VALUES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
                    "repeat_interleave", "masked_scatter"}
_SIZE_QUERIES = {"size", "shape", "numel", "nelement", "__len__"}
_BRANCHES = (ast.If, ast.While, ast.Assert, ast.IfExp)
TEXT = ("a branch on the size of a tensor sized by the data (nonzero, a boolean mask's selection, unique...) in "
        "module {modules} at {where}: the trace takes the branch the traced batch takes, at every step; write it "
        "without the branch (the count as a tensor, torch.count_nonzero(mask), and torch.where between the two "
        "results; a mean over a selection that may be empty: sel.sum() / count.clamp(min=1))")


class DataSizes:
    """The tensors of one trace whose sizes come from the data."""

    def __init__(self) -> None:
        self._ids = TensorSet()

    def note(self, name: str, tensors: list[torch.Tensor], out: Any) -> None:
        """After an operator: its outputs are sized by the data where it sizes them so, or an input is."""
        boolean_index = name == "__getitem__" and any(t.dtype == torch.bool for t in tensors[1:])
        if name in _SIZED_BY_VALUES or boolean_index or self._ids.any_of(tensors):
            for value in tree_flatten(out)[0]:
                self._ids.add(value)

    def branch_on_size(self, name: str, tensors: list[torch.Tensor], frame: Callable[[], FrameType | None]) -> bool:
        """Whether ``name`` reads the size of a tensor sized by the data on a branch's line (``frame()``: the
        calling frame, looked up only then)."""
        if name not in _SIZE_QUERIES or not self._ids.any_of(tensors[:1]):
            return False
        caller = frame()
        return caller is not None and _is_branch(caller.f_code.co_filename, caller.f_lineno)


@functools.lru_cache(maxsize=256)
def _is_branch(filename: str, lineno: int) -> bool:
    """Whether ``lineno`` is within the test of an ``if``/``elif``/``while``/``assert`` or a conditional
    expression, or assigns a name that such a test further down the same function reads (``n = len(selected)``,
    then ``if n == 0:``)."""
    tree = validations.source_tree(filename)
    if tree is None:
        return False
    if any(isinstance(node, _BRANCHES) and node.test.lineno <= lineno <= (node.test.end_lineno or 0)
           for node in ast.walk(tree)):
        return True
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.lineno <= lineno <= (node.end_lineno or 0)]
    if not functions:
        return False
    function = max(functions, key=lambda node: node.lineno)  # the innermost
    assigned = {target.id for node in ast.walk(function) if isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.lineno <= lineno <= (node.end_lineno or 0)
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(target, ast.Name)}
    return bool(assigned) and any(
        isinstance(node, _BRANCHES) and node.test.lineno > lineno and
        any(isinstance(name, ast.Name) and name.id in assigned for name in ast.walk(node.test))
        for node in ast.walk(function))


__all__ = ["DataSizes", "TEXT"]
