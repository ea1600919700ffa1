"""What the passes share: a graph's producers, consumers, constants and shapes (``_Graph``), and
small edits (keep, replace, redirect nodes)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..onnx_graph import ONNX_DOMAINS as _ONNX_DOMAINS


class _Graph:
    """Producers, consumers, constants and known shapes of a graph's values."""

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}
        self.initializers = {i.name: i for i in graph.initializer}
        self.shapes = {}
        for info in [*graph.input, *graph.value_info, *graph.output]:
            if info.type.tensor_type.HasField("shape"):
                self.shapes[info.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                          for d in info.type.tensor_type.shape.dim]
        for name, init in self.initializers.items():
            self.shapes[name] = list(init.dims)

    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer or ``Constant`` node output, else None."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            return None
        attr = node.attribute[0]
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name in ("value_float", "value_int"):
            return np.array(helper.get_attribute_value(attr))
        if attr.name in ("value_floats", "value_ints"):
            return np.array(list(helper.get_attribute_value(attr)))
        return None

    def only_used_by(self, name: str, *nodes: onnx.NodeProto) -> bool:
        """``name`` is no graph output and every consumer is one of ``nodes``."""
        ids = {id(n) for n in nodes}
        return name not in self.outputs and all(id(c) in ids for c in self.consumers.get(name, []))

    def fill_value(self, name: str) -> float | None:
        """The single value of a constant, an ``Expand`` of a one-element constant or a
        ``ConstantOfShape``; None when it is none of these or not one value."""
        value = self.const(name)
        node = self.producer.get(name)
        if value is None and node is not None and node.op_type == "Expand":
            value = self.const(node.input[0])
        elif value is None and node is not None and node.op_type == "ConstantOfShape":
            attr = next((a for a in node.attribute if a.name == "value"), None)
            value = numpy_helper.to_array(attr.t) if attr is not None else np.zeros(1, np.float32)
        if value is None or value.size == 0 or not np.all(value == value.flat[0]):
            return None
        return float(value.flat[0])


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _other(node: onnx.NodeProto, name: str) -> str:
    return node.input[1] if node.input[0] == name else node.input[0]


def _is(node: onnx.NodeProto, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in _ONNX_DOMAINS


def _op_types(model: onnx.ModelProto) -> dict[tuple[str, str], str]:
    """``{(domain, op_type): ONNX operator}`` of every node's operator: the standard ones, and the
    model's local functions whose body is one standard node (the exporter writes ``aten.erf`` as a
    function around one ``Erf``)."""
    kinds = {}
    for function in model.functions:
        if len(function.node) == 1 and function.node[0].domain in _ONNX_DOMAINS:
            kinds[(function.domain, function.name)] = function.node[0].op_type
    return kinds


def _op(node: onnx.NodeProto, op_of: dict) -> str | None:
    """The ONNX operator ``node`` computes (``op_of``: ``_op_types``'), or None for another domain's."""
    return node.op_type if node.domain in _ONNX_DOMAINS else op_of.get((node.domain, node.op_type))


def _static(shape: list | None) -> bool:
    """Whether ``shape`` (as ``_Graph.shapes`` holds it) is known and every dim a static positive size."""
    return shape is not None and all(isinstance(size, int) and size > 0 for size in shape)


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    types = {info.name: info.type.tensor_type.elem_type for info in [*graph.input, *graph.value_info, *graph.output]
             if info.type.HasField("tensor_type")}
    types.update({init.name: init.data_type for init in graph.initializer})
    return types


def _all_nodes(graph: onnx.GraphProto):
    """The graph's nodes and those of its subgraphs, at any depth."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield from _all_nodes(sub)


def _keep(model: onnx.ModelProto, dead: set[int], before: dict[int, list[onnx.NodeProto]] | None = None,
          after: dict[int, list[onnx.NodeProto]] | None = None) -> None:
    """Drop the nodes whose ids are in ``dead``; put ``before[id(node)]`` right before ``node`` and
    ``after[id(node)]`` right after it."""
    nodes = []
    for node in model.graph.node:
        nodes.extend((before or {}).get(id(node), []))
        if id(node) not in dead:
            nodes.append(node)
        nodes.extend((after or {}).get(id(node), []))
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _value_info_like(model: onnx.ModelProto, name: str, new_name: str, dims: list | None = None) -> None:
    """Give ``new_name`` the value info of ``name`` (nothing where it has none), its dims replaced by ``dims``
    where given, as ``_Graph.shapes`` holds them: an int (a static size), a str (a symbolic one) or None."""
    info = next((info for info in model.graph.value_info if info.name == name), None)
    if info is None:
        return
    like = model.graph.value_info.add()
    like.CopyFrom(info)
    like.name = new_name
    if dims is not None:
        _set_dims(like, dims)


def _set_dims(info: onnx.ValueInfoProto, dims: list) -> None:
    """Give the value info ``info`` the shape ``dims``, as ``_Graph.shapes`` holds them: an int (a static size), a
    str (a symbolic one) or None."""
    shape = info.type.tensor_type.shape
    del shape.dim[:]
    for size in dims:
        dim = shape.dim.add()
        if isinstance(size, int):
            dim.dim_value = size
        elif size:
            dim.dim_param = size


def _shared_constants(g: _Graph, pending: dict[str, onnx.TensorProto], constants) -> None:
    """Queue each ``(name, value)`` of ``constants`` as an initializer unless the graph or
    ``pending`` has it already (passes name their constants by value, so equal ones are shared)."""
    for name, value in constants:
        if name not in g.initializers and name not in pending:
            pending[name] = numpy_helper.from_array(value, name)


def _import_domain(model: onnx.ModelProto, domain: str, version: int) -> None:
    """Import ``domain`` at ``version`` into ``model``, unless it imports that domain already (a pass that wrote
    nodes of another domain than ONNX's)."""
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, version))


def _replace_nodes(model: onnx.ModelProto, replaced: dict[int, list[onnx.NodeProto]],
                   initializers: dict[str, onnx.TensorProto]) -> int:
    """Put ``replaced[id(node)]`` in place of each such node, add ``initializers``; returns the count."""
    if replaced:
        _keep(model, set(replaced), before=replaced)
        model.graph.initializer.extend(initializers.values())
    return len(replaced)


def _redirect(model: onnx.ModelProto, renamed: dict[str, str], removed: set[int]) -> dict[str, onnx.NodeProto]:
    """Make readers of each ``old`` name read ``renamed[old]`` instead (the nodes in ``removed``,
    which produced the old names, are skipped: the caller drops them). A graph output, and every
    name in a graph with subgraphs (whose nodes may read it by name), keeps its name through an
    ``Identity``: returned by old name, for the caller to put where the old producer was."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    nested = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node
                 for a in n.attribute)
    identities = {}
    for old, new in list(renamed.items()):
        if nested or old in outputs:
            identities[old] = helper.make_node("Identity", [new], [old], name=f"{old}/identity")
            del renamed[old]
    for node in graph.node:
        if id(node) not in removed:
            node.input[:] = [renamed.get(name, name) for name in node.input]
    kept = [info for info in graph.value_info if info.name not in renamed]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return identities


def _drop_unread_transposes(model: onnx.ModelProto, outputs: set[str]) -> None:
    """Remove the ``Transpose`` nodes nothing reads any more (a pass redirected their readers), a
    chain's last first; ``outputs``: the graph's output names (read by the caller)."""
    graph = model.graph
    while True:
        read = {name for n in graph.node for name in n.input} | outputs
        unread = [n for n in graph.node if _is(n, "Transpose") and n.output[0] not in read]  # held: ids stay
        if not unread:
            return
        _keep(model, {id(n) for n in unread})


def _widened(g: _Graph, name: str, reader: onnx.NodeProto) -> onnx.NodeProto | None:
    """The ``Cast`` to float32 that writes ``name``, where ``reader`` alone reads it (a tensor widened for one
    float32 sum: ``fused_gradient_sums``, ``fused_layer_norm``'s residual sum), else None."""
    cast = g.producer.get(name)
    if (cast is None or not _is(cast, "Cast") or _attrs(cast).get("to") != onnx.TensorProto.FLOAT
            or not g.only_used_by(name, reader)):
        return None
    return cast


def _sole_consumer(g: _Graph, name: str) -> onnx.NodeProto | None:
    readers = g.consumers.get(name, [])
    if len(readers) != 1 or name in g.outputs or list(readers[0].input).count(name) != 1:
        return None
    return readers[0]


def _undo(first: list[int] | None, second: list[int] | None) -> bool:
    """Transposing by ``first`` and then by ``second`` is the identity."""
    return first is not None and second is not None and len(first) == len(second) and all(
        first[axis] == i for i, axis in enumerate(second))


def _undone_pair(g: _Graph, name: str) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
    """The two ``Transpose`` nodes of a chain ``name`` -> first -> second where each alone reads what the one before
    it writes and second undoes first (its output holds ``name``'s values in ``name``'s layout), else None."""
    first = _sole_consumer(g, name)
    second = _sole_consumer(g, first.output[0]) if first is not None and _is(first, "Transpose") else None
    if second is None or not _is(second, "Transpose") or not _undo(_attrs(first).get("perm"),
                                                                    _attrs(second).get("perm")):
        return None
    return first, second


__all__ = []
