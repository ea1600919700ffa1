"""In-place changes of an output whose backward reads it, taken out of place before autograd.

A custom ``torch.autograd.Function`` taken for its forward (``guard.DERIVATIVE_BACKWARDS``) is traced as the
operators of that forward, which PyTorch runs without autograd. DeBERTa's masked softmax (SEW-D's ``XSoftmax``)
zeroes its softmax's output in place, ``softmax(...).masked_fill_(mask, 0)``: autograd over the traced program
would find the output that softmax's backward reads changed and refuse ("modified by an inplace operation"),
where PyTorch ran the Function's own backward. The same values written out of place,
``masked_fill(softmax(...), mask, 0)``, are what the exported graph computes anyway (ONNX has no in-place
operators), and autograd differentiates them.

So each in-place operator that changes the output of an operator whose backward reads its own output (softmax,
sigmoid, tanh, exp, relu...) becomes its functional twin, and the later readers of that output read the twin's
result instead; where that output has a view taken before the change (which would see it), or its floating-point
operands another dtype (a promotion would differ), it is left in place. Outside such a Function PyTorch's autograd
refuses these changes too, so no program that autograd differentiates as written is changed.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

_aten = torch.ops.aten
# operators whose derivative (torch's derivatives.yaml) reads their result
_RESULT_READ = {_aten.softmax, _aten._softmax, _aten.log_softmax, _aten._log_softmax, _aten.sigmoid, _aten.tanh,
                _aten.exp, _aten.sqrt, _aten.rsqrt, _aten.relu, _aten.reciprocal}


def _aliases(node: Any) -> bool:
    """Whether ``node``'s value may share memory with another's (a view, an in-place result, an input)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return True
    if node.target is operator.getitem:  # an output of a tuple-valued operator: split's are views
        return _aliases(node.args[0])
    target = node.target
    return not isinstance(target, torch._ops.OpOverload) or any(r.alias_info is not None
                                                                 for r in target._schema.returns)


def _functional(node: torch.fx.Node) -> Any:
    """The functional twin of ``node``'s in-place operator (``aten.masked_fill_.Scalar`` ->
    ``aten.masked_fill.Scalar``), or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    name = schema.name.split("::")[-1]
    first = schema.arguments[0].alias_info if schema.arguments else None
    if not name.endswith("_") or name.endswith("__") or first is None or not first.is_write:
        return None
    packet = getattr(_aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _same_dtype(node: torch.fx.Node) -> bool:
    """Whether ``node`` changes a floating-point tensor whose floating-point operands share its dtype: the
    functional twin then computes in that dtype too (masks and indices of other dtypes promote nothing)."""
    values = [a.meta.get("val") for a in node.all_input_nodes]
    if not all(isinstance(v, torch.Tensor) for v in values) or not values[0].is_floating_point():
        return False
    return all(v.dtype == values[0].dtype for v in values if v.is_floating_point() or v.is_complex())


def _read_by_its_backward(node: Any) -> bool:
    return (isinstance(node, torch.fx.Node) and isinstance(node.target, torch._ops.OpOverload)
            and node.target.overloadpacket in _RESULT_READ)


def out_of_place(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph``'s in-place changes of outputs their backward reads (module docstring), in place; returns
    how many."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    count = 0
    for node in list(graph.nodes):
        functional = _functional(node)
        source = node.args[0] if functional is not None and node.args else None
        if not _read_by_its_backward(source) or _aliases(source) or not _same_dtype(node):
            continue
        if any(_aliases(user) for user in source.users if user is not node and order[user] < order[node]):
            continue  # a view taken before the change would see it
        for user in list(source.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(source, node)
        node.target = functional
        count += 1
    return count


__all__ = ["out_of_place"]
