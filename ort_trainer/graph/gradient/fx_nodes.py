"""Adding nodes to a traced torch program (the joint program's rewrites: ``gelu.py``, ``kernel_ops.py``) with the
``meta["val"]`` fake values the ONNX exporter reads."""

from __future__ import annotations

import contextlib
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


def retarget(node: torch.fx.Node, target: Callable, args: tuple, kwargs: dict | None = None) -> None:
    """Make ``node`` compute ``target(*args)`` (same name, users and value shape/dtype)."""
    node.target, node.args, node.kwargs = target, args, kwargs or {}


def fake_result(target: Callable, args: tuple, kwargs: dict) -> Any:
    """``target``'s value on the fake values of its node arguments (in their fake mode)."""
    from torch._guards import detect_fake_mode

    values = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    mode = detect_fake_mode([v for v in (*values[0], *values[1].values()) if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        return target(*values[0], **values[1])
