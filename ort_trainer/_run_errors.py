"""Errors ONNX Runtime raises inside a run, said in the user's terms.

ONNX Runtime reports a failed run as ``[ONNXRuntimeError] : 1 : FAIL : Non-zero status code
returned while running Gather node. Name:'node_embedding_1' Status Message: ...``: a node name of
the exported graph, and nothing of the batch. ``StepError`` says which step failed, for inputs of
which shapes, in which module of the model the node came from (the exporter records it on the
node), and, when memory ran out, how much was asked for and what to change.
"""

from __future__ import annotations

import ast
import re
import numpy as np
import onnx

from .graph.onnx_graph import module_of

_NODE = re.compile(r"running (?P<op>\w+) node\. Name:'(?P<node>[^']*)'(?: Status Message: (?P<message>.*))?", re.S)
_ALLOCATION = re.compile(r"Failed to allocate memory (?:for requested buffer )?of size (?P<bytes>\d+)|"
                         r"out of memory|bad_alloc", re.I)


class StepError(RuntimeError):
    """ONNX Runtime failed inside a step; the message gives the inputs' shapes, the node and its module.

    The trainer's weights, optimizer state and counters are those from before the step.

    Attributes:
        shapes: ``{input name: shape}`` of the step's inputs.
        node: the failing node's name in the graph, or None when ONNX Runtime named none.
        module: the model's module the node came from (``transformer.h.3.attn``), or None.
        requested_bytes: the size of the allocation that failed, or None (not a memory error).
    """

    def __init__(self, message: str, shapes: dict[str, tuple], node: str | None, module: str | None,
                 requested_bytes: int | None):
        super().__init__(message)
        self.shapes, self.node, self.module, self.requested_bytes = shapes, node, module, requested_bytes


def _binding_errors() -> tuple[type, ...]:
    """The exception types of ONNX Runtime's Python binding (a failed run raises one of these, or a
    ``RuntimeError``)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as binding

    return tuple(value for value in vars(binding).values()
                 if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == binding.__name__)


ONNXRUNTIME_ERRORS = _binding_errors()


def node_modules(model: onnx.ModelProto) -> dict[str, str]:
    """``{node name: module path}`` of the nodes whose module the exporter recorded: the
    ``pkg.torch.onnx.name_scopes`` of the torch.export exporter, or the TorchScript exporter's
    ``/model/enc/layers.0/Gemm`` names. Backward nodes have none."""
    modules = {}
    for node in model.graph.node:
        module = None
        for prop in node.metadata_props:
            if prop.key == "pkg.torch.onnx.name_scopes":
                module = _module_of_scopes(prop.value)
                break
        if module is None and node.name.startswith("/"):
            module = module_of(node.name)
        if module:
            modules[node.name] = module
    return modules


def _module_of_scopes(scopes: str) -> str | None:
    try:
        names = ast.literal_eval(scopes)
    except (ValueError, SyntaxError):
        return None
    paths = [n for n in names if isinstance(n, str) and (n == "model" or n.startswith("model."))]
    if not paths:
        return None
    return paths[-1][len("model."):] if paths[-1] != "model" else "<top-level forward>"


def _find_module(node: str, modules: dict[str, str]) -> str | None:
    """The module of ``node``, or of the node it was made from (graph passes and ONNX Runtime's own
    fusions name their nodes after the original: ``node_view_23/output_reshape/MatMul``)."""
    node = node.removeprefix("fused ")  # ONNX Runtime's name for a node it fused into another
    while node:
        if node in modules:
            return modules[node]
        if "/" not in node.strip("/"):
            return None
        node = node.rstrip("/").rsplit("/", 1)[0]
    return None


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit} ({count} bytes)"
    return f"{count} bytes"


def _shapes_text(feeds: dict[str, np.ndarray]) -> str:
    """`` for inputs of shapes x [8, 20] float32, ...`` (nothing for a run with no batch: the update)."""
    if not feeds:
        return ""
    return " for inputs of shapes " + ", ".join(f"{name} {list(np.shape(value))} {np.asarray(value).dtype}"
                                                for name, value in feeds.items())


def explain(exc: BaseException, what: str, feeds: dict[str, np.ndarray], modules: dict[str, str],
            training: bool, gpu: bool) -> StepError:
    """A ``StepError`` for an ONNX Runtime error ``exc`` raised while running ``what``.

    Args:
        exc: ONNX Runtime's exception.
        what: the run, in the user's words (``"the training step (forward and backward)"``).
        feeds: the step's data inputs.
        modules: ``node_modules`` of the graph that ran.
        training: a training step (gradient accumulation is then advice that fits).
        gpu: the run was on a GPU (``device.mem_limit`` then bounds the arena).
    """
    text = str(exc)
    found = _NODE.search(text)
    node = found["node"] if found else None
    op = found["op"] if found else None
    message = (found["message"] or "").strip() if found else text.split(" : ", 3)[-1].strip()
    module = _find_module(node, modules) if node else None
    where = ""
    if node:
        where = f" at node {node!r} ({op})" + (f" of module {module}" if module else
                                                 " (a node of the backward pass or of a rewrite: no module recorded)")
    shapes = {name: tuple(np.shape(value)) for name, value in feeds.items()}
    allocation = _ALLOCATION.search(text)
    if allocation:
        asked = int(allocation["bytes"]) if allocation.group("bytes") else None
        size = f" {_size(asked)}" if asked else ""
        advice = ["a smaller batch"]
        if training:
            advice.append("the same batch in micro-batches (batch.gradient_accumulation_steps = k, each micro-batch "
                          "1/k of it: the same update)")
        limit = " or than device.mem_limit allows" if gpu else ""
        return StepError(
            f"ONNX Runtime ran out of memory in {what}{where}: it could not allocate{size}{_shapes_text(feeds)}, "
            f"more than this machine has free{limit}. Use {' or '.join(advice)}. The weights, "
            f"optimizer state and step counters are as before the step. (ONNX Runtime: {message})",
            shapes, node, module, asked)
    return StepError(f"ONNX Runtime failed in {what}{where}{_shapes_text(feeds)}: {message}", shapes, node, module,
                     None)


__all__ = ["ONNXRUNTIME_ERRORS", "StepError", "explain", "node_modules"]
