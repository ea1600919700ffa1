"""Editing a traced torch program's graphs (``rewrite_graphs``) and adding nodes to them (the joint program's
rewrites: ``gelu.py``, ``kernel_ops.py``) with the ``meta["val"]`` fake values the ONNX exporter reads."""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch


class Builder:
    """Adds ``call_function`` nodes where the graph inserts, with the ``meta["val"]`` the exporter
    reads (computed on the fake tensors) and the module metadata of a node they replace."""

    def __init__(self, graph: torch.fx.Graph, like: torch.fx.Node):
        self.graph = graph
        self.meta = {k: like.meta[k] for k in ("nn_module_stack", "stack_trace") if k in like.meta}

    def __call__(self, target: Callable, *args: Any, **kwargs: Any) -> torch.fx.Node:
        """A node computing ``target(*args, **kwargs)``."""
        node = self.graph.call_function(target, args, kwargs)
        node.meta.update(self.meta)
        node.meta["val"] = fake_result(target, args, kwargs)
        return node


def rewrite_graphs(program: Any, rewrite: Callable[[torch.fx.Graph], int]) -> int:
    """Run ``rewrite`` on each graph of ``program`` (its own and its submodules': the regions ``torch.export``
    traced under autocast); it edits the graph in place and returns how many rewrites it made. Each graph it
    changed is linted and recompiled. Returns the total."""
    count = 0
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        found = rewrite(module.graph)
        if found:
            module.graph.lint()
            module.recompile()
            count += found
    return count


def replace_result_readers(program: Any, targets: tuple,
                           readers: Callable[[torch.fx.Node, Builder], dict[int, tuple[Callable, tuple]]]) -> int:
    """Replace each call of ``targets`` in ``program``'s graph, whose results are read by ``getitem`` alone (a joint
    program's backward operators: ``conv_ops.py``, ``batch_norm_ops.py``): ``readers(node, build)`` gives, by result
    index, what each reader computes instead (``(target, args)``; ``build`` adds nodes before the call), and each
    reader keeps its name (the graph's outputs name the weights' gradients by them). Returns how many it replaced
    (the graph linted and recompiled where any).

    Raises:
        RuntimeError: a call's result read other than by ``getitem``.
    """
    graph, count = program.graph, 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in targets]:
        if any(user.target is not operator.getitem for user in node.users):
            raise RuntimeError(f"{node.name}: {node.target}'s results read other than by getitem")
        with graph.inserting_before(node):
            computed = readers(node, Builder(graph, node))
        for user in list(node.users):
            retarget(user, *computed[user.args[1]])
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        program.graph_module.recompile()
    return count


def retarget(node: torch.fx.Node, target: Callable, args: tuple, kwargs: dict | None = None) -> None:
    """Make ``node`` compute ``target(*args)`` (same name, users and value shape/dtype)."""
    node.target, node.args, node.kwargs = target, args, kwargs or {}


def fake_result(target: Callable, args: tuple, kwargs: dict) -> Any:
    """``target``'s value on the fake values of its node arguments (in their fake mode; a data-dependent size it
    makes, e.g. of ``nonzero``, is a fresh symbol the program's shape environment is told not to wait for)."""
    from torch._guards import detect_fake_mode

    values = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    mode = detect_fake_mode([v for v in (*values[0], *values[1].values()) if isinstance(v, torch.Tensor)])
    shape_env = getattr(mode, "shape_env", None)
    fresh = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()
    with mode if mode is not None else contextlib.nullcontext(), fresh:
        return target(*values[0], **values[1])


def fill_fake_values(graph: torch.fx.Graph) -> int:
    """Give each ``call_function`` node without a ``meta["val"]`` (one a rewrite before autograd added, which the
    joint trace does not need) the fake value of its target on its arguments', in the graph's order; a node whose
    value cannot be computed (an argument without one) is left without. Returns how many were filled."""
    filled = 0
    for node in graph.nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue
        arguments = []
        torch.fx.node.map_arg((node.args, node.kwargs), arguments.append)
        if all("val" in argument.meta for argument in arguments):
            try:
                node.meta["val"] = fake_result(node.target, node.args, node.kwargs)
                filled += 1
            except Exception:  # noqa: BLE001 - an operator fake tensors cannot run: its readers stay without values
                continue
    return filled
