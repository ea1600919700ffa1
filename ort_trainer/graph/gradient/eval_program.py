"""The eval-mode program made translatable: ``forward_program`` gives what the ONNX exporter
translates, without tracing the program again where a few rewrites in place do.

``run_decompositions`` traces the whole program again: 13.8 s of GPT-2 small's 24.7 s
``save_as_onnx`` with symbolic shapes (sympy arithmetic on every fake tensor's sizes). An
eval-mode program of a transformer needs little of it: its operators have translations but for
``aten.__and__`` (HF's mask: ``bitwise_and``), ``aten.to`` (a cast: ``_to_copy``), ``aten.diff``
(HF's packed-sequence check on the positions of a model called without an attention mask: slices
subtracted) and the ``_assert_tensor_metadata`` checks ``torch.export`` puts beside them (nothing
to compute).
"""

from __future__ import annotations

import functools
import operator
import sys

import torch

from .joint_onnx import _quiet_exporter, _registry_and_tables

_aten = torch.ops.aten
# operators the exporter's table decomposes into one other operator of the same arguments
_ALIASES = {_aten.__and__.Tensor: _aten.bitwise_and.Tensor, _aten.__or__.Tensor: _aten.bitwise_or.Tensor,
            _aten.__xor__.Tensor: _aten.bitwise_xor.Tensor}
_TO = {_aten.to.dtype: 1, _aten.to.device: 2, _aten.to.dtype_layout: None}  # where its dtype is, None: keyword only
_EXPANDED = {_aten.diff.default}  # rewritten into several translated operators (``_expand_diff``)


def forward_program(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` decomposed to the operators the ONNX exporter translates (what ``torch.onnx.export`` does).

    The operators of the module docstring are rewritten in place, and a program whose operators
    all translate then, none mutating and without submodules (autocast regions), is returned as
    it is (the same program, edited); any other is decomposed (``run_decompositions``).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if _translatable_as_is(program):
        graph = program.graph_module.graph
        for node in list(graph.nodes):
            if node.op == "call_function":
                _canonicalize(graph, node)
        graph.lint()
        program.graph_module.recompile()
        return program
    with _quiet_exporter(), sdpa_kernel([SDPBackend.MATH]):
        return program.run_decompositions(_registry_and_tables()[1])


@functools.lru_cache(maxsize=1)
def _implemented() -> frozenset:
    """The overloads the exporter translates directly (no decomposition)."""
    from torch.onnx._internal.exporter import _decomp

    registry, table, _ = _registry_and_tables()
    return frozenset(op for op in _decomp.get_onnx_implemented_overloads(registry) if op not in table)


def _translatable_as_is(program: torch.export.ExportedProgram) -> bool:
    """Whether every operator of ``program`` translates without a decomposition once canonicalized."""
    gm = program.graph_module
    if any(isinstance(child, torch.fx.GraphModule) for child in gm.children()):
        return False
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module", "call_method"):
            return False
        if node.op != "call_function" or node.target is operator.getitem or node.target in _TO \
                or node.target in _EXPANDED or (node.target is _aten._assert_tensor_metadata.default
                                                and not node.users):
            continue
        target = _ALIASES.get(node.target, node.target)
        if not isinstance(target, torch._ops.OpOverload) or target not in _implemented() or target._schema.is_mutable:
            return False
    return True


def _canonicalize(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Rewrite ``node`` (see ``forward_program``) into what the exporter translates, in place."""
    if node.target in _ALIASES:
        node.target = _ALIASES[node.target]
    elif node.target is _aten._assert_tensor_metadata.default and not node.users:
        graph.erase_node(node)
    elif node.target is _aten.diff.default:
        _expand_diff(graph, node)
    elif node.target in _TO:
        position = _TO[node.target]
        dtype = node.kwargs.get("dtype", node.args[position] if position is not None and len(node.args) > position
                                else None)
        source = node.args[0]  # a cast to its own dtype stays a node: it may be an output the signature names
        node.target, node.args = _aten._to_copy.default, (source,)
        node.kwargs = {"dtype": source.meta["val"].dtype if dtype is None else dtype}



def _expand_diff(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """``diff(x, n, dim, prepend, append)`` as torch computes it: ``x`` concatenated between
    ``prepend`` and ``append`` along ``dim``, then ``n`` times ``x[1:] - x[:-1]`` along ``dim``
    (``logical_xor`` for booleans). Sizes stay symbolic: the slices end at -1 and at the largest index."""
    arguments = node.target._schema.arguments
    values = {a.name: a.default_value if a.has_default_value() else None for a in arguments}
    values.update(zip((a.name for a in arguments), node.args))
    values.update(node.kwargs)
    dim = values["dim"]
    fake_mode = node.meta["val"].fake_mode

    def emit(target, *args):
        new = graph.call_function(target, args)
        inputs = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
        with fake_mode:
            new.meta["val"] = target(*inputs)
        new.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
        return new

    # the last operator is ``node`` itself, retargeted: a program output keeps its name
    with graph.inserting_before(node):
        parts = [p for p in (values["prepend"], values["self"], values["append"]) if p is not None]
        current = emit(_aten.cat.default, parts, dim) if len(parts) > 1 else parts[0]
        subtract = _aten.logical_xor.default if node.meta["val"].dtype == torch.bool else _aten.sub.Tensor
        target, args = _aten.clone.default, (current,)  # n = 0: x itself
        for step in range(values["n"]):
            target, args = subtract, (emit(_aten.slice.Tensor, current, dim, 1, sys.maxsize),
                                      emit(_aten.slice.Tensor, current, dim, 0, -1))
            if step < values["n"] - 1:
                current = emit(target, *args)
    node.target, node.args, node.kwargs = target, args, {}


__all__ = ["forward_program"]
