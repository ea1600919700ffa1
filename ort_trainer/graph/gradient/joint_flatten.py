"""The joint program's calling convention changed in place, where torch traces it a second time.

``aot_export_module(trace_joint=True)``, which ``torch.export``'s joint decomposition calls
(``joint_onnx.joint_program``), traces the model with autograd once and then traces the finished
joint graph a second time (``make_fx(flattened_joint)`` in ``torch/_functorch/aot_autograd.py``)
only to change how it is called: its inputs ``(primals, tangents)`` become the primals alone (a
scalar loss needs no tangent: the traced backward starts from ``ones_like``), and its output
``(forward outputs, gradients)`` one flat tuple without the ``None`` gradients of the inputs that
get none. That second trace re-runs every operator of the forward and the backward on fake
tensors: 3-6 s of GPT-2 small's cold build on the 2-core machine, 8 s of BERT-base's
(commit 3469f31).

``flattened_in_place`` makes the same change to the traced graph itself: its placeholders minus
the unused tangents, its outputs flattened and filtered as ``flattened_joint`` filters them. The
nodes are the first trace's, with its metadata (module stacks, source lines), where the retrace
gives the same operators, in the same order but for where a few symbolic-size products sit, under
other names (``tests/test_joint_flatten.py`` builds both and compares their ONNX graphs node by
node). Where the traced graph is not what this expects (another torch, a tangent that is read, a
gradient where ``flattened_joint`` would refuse one), torch's own retrace runs, with its checks
and errors.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree


@contextlib.contextmanager
def flattened_in_place() -> Iterator[None]:
    """While active, ``aot_export_module``'s retrace of a joint graph is replaced by ``flatten``.

    Only the call of ``make_fx`` on torch's ``flattened_joint`` changes; every other ``make_fx``
    call, and that one when ``flatten`` declines, traces as torch would.
    """
    from torch._functorch import aot_autograd

    make_fx = aot_autograd.make_fx

    def make_fx_or_flatten(function: Callable, *args: Any, **kwargs: Any) -> Callable:
        retrace = make_fx(function, *args, **kwargs)
        joint = _traced_joint(function)
        if joint is None:
            return retrace

        def flat(*inputs: Any) -> torch.fx.GraphModule:
            flattened = flatten(joint, inputs)
            return flattened if flattened is not None else retrace(*inputs)

        return flat

    aot_autograd.make_fx = make_fx_or_flatten
    try:
        yield
    finally:
        aot_autograd.make_fx = make_fx


def flatten(joint: torch.fx.GraphModule, inputs: Sequence[Any]) -> torch.fx.GraphModule | None:
    """``joint`` called with ``inputs`` flat, as ``flattened_joint`` calls it, edited in place.

    Args:
        joint: the joint graph ``_aot_export_function`` traced: called as ``(primals, tangents)``,
            returning ``(forward outputs, gradients)`` with one gradient (or None) per primal.
        inputs: the primals (``aot_export_module``'s fake parameters, buffers and inputs); a tensor
            that requires grad must have a gradient, every other input None.

    Returns:
        ``joint``, now called with the primals and returning the forward outputs then the
        gradients of the inputs that require grad; None, ``joint`` untouched, where it is not of
        that form.
    """
    graph = joint.graph
    codegen = graph._codegen
    if not isinstance(codegen, torch.fx.graph._PyTreeCodeGen):
        return None
    in_spec, out_spec = codegen.pytree_info.in_spec, codegen.pytree_info.out_spec
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    output = graph.output_node()
    try:
        primals, tangents = pytree.tree_unflatten(placeholders, in_spec)
        forward, gradients = pytree.tree_unflatten(list(output.args[0]), out_spec)
    except (TypeError, ValueError, IndexError, RuntimeError):
        return None
    if len(primals) != len(inputs) or len(gradients) != len(inputs) or any(node.users for node in tangents):
        return None
    trained = [isinstance(value, torch.Tensor) and value.requires_grad for value in inputs]
    if any((gradient is not None) != wanted for gradient, wanted in zip(gradients, trained)):
        return None  # torch's retrace raises its own error for that
    for node in tangents:
        graph.erase_node(node)
    output.args = ((*forward, *(gradient for gradient, wanted in zip(gradients, trained) if wanted)),)
    graph._codegen = torch.fx.graph.CodeGen()
    joint.recompile()
    return joint


def _traced_joint(function: Callable) -> torch.fx.GraphModule | None:
    """The joint graph that torch's ``flattened_joint`` calls (its closure's ``fx_g``), or None
    for any other function."""
    code = getattr(function, "__code__", None)
    if code is None or code.co_name != "flattened_joint":
        return None
    cells = dict(zip(code.co_freevars, getattr(function, "__closure__", None) or ()))
    try:
        joint = cells["fx_g"].cell_contents
    except (KeyError, ValueError):
        return None
    return joint if isinstance(joint, torch.fx.GraphModule) else None


__all__ = ["flatten", "flattened_in_place"]
