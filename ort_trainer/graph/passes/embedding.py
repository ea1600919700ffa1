"""The gradient of a small embedding table as a one-hot product.

- ``embedding_gradient`` (with ``joint.identity_transposes``): the gradient of a table of
  at most ``SMALL_TABLE_ROWS`` rows (BERT's token types: 2) as ``Gemm(OneHot(index), updates,
  transA=1)`` instead of ``ScatterElements(add)`` into zeros, whose CPU kernel adds one element at
  a time on one thread: 1.8 ms per BERT-like step for 1024 x 256 updates into 2 rows (the product
  is 2·V·N·D flops, 0.5 M here). Another summation order: equal to float32 rounding.

Each has a name under ``graph_optimizations`` and is checked against float64 PyTorch gradients
(``tests/test_joint_passes.py``, ``tests/test_rewrites.py``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ._graph import _Graph, _attrs, _elem_types, _is, _replace_nodes, _shared_constants


SMALL_TABLE_ROWS = 64  # up to here a one-hot product beats the scatter (~7 ns per added element)


def small_table_gradients(model: onnx.ModelProto) -> int:
    """``ScatterElements(zeros[V, D], Expand(index[N, 1]), updates[N, D], axis=0, add)`` with a static
    ``V <= SMALL_TABLE_ROWS`` -> ``Gemm(OneHot(index, V), updates, transA=1)``; returns the count.

    A ``data`` that is not a constant zero is added to the product. float32 tables only (ONNX
    Runtime's CPU ``OneHot`` has no float64 output).
    """
    g = _Graph(model)
    types = _elem_types(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    initializers: dict[str, onnx.TensorProto] = {}
    for node in model.graph.node:
        expand = lookup_scatter(g, node)
        if expand is None:
            continue
        data, _, updates = node.input
        shape, elem_type = g.shapes.get(data), types.get(data)
        if (shape is None or len(shape) != 2 or not isinstance(shape[0], int) or not 0 < shape[0] <= SMALL_TABLE_ROWS
                or elem_type != TensorProto.FLOAT):
            continue  # (updates have data's rank, 2, by ScatterElements' definition)
        rows = shape[0]
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
        prefix = f"{node.name or node.output[0]}/small_table"
        names = {"flat": "ort_trainer/small_table/flat", "depth": f"ort_trainer/small_table/depth_{rows}",
                 "values": f"ort_trainer/small_table/values_{dtype.name}"}
        _shared_constants(g, initializers, [(names["flat"], np.array([-1], np.int64)),
                                            (names["depth"], np.array(rows, np.int64)),
                                            (names["values"], np.array([0, 1], dtype))])
        zero = g.fill_value(data) == 0.0
        product = node.output[0] if zero else prefix + "/product"
        nodes = [helper.make_node("Reshape", [expand.input[0], names["flat"]], [prefix + "/index"],
                                  name=prefix + "/Reshape")]
        index = prefix + "/index"
        if types.get(expand.input[0]) != TensorProto.INT64:  # CPU OneHot: no int32 index with an int64 depth
            nodes.append(helper.make_node("Cast", [index], [prefix + "/index64"], name=prefix + "/Cast",
                                          to=TensorProto.INT64))
            index = prefix + "/index64"
        nodes += [helper.make_node("OneHot", [index, names["depth"], names["values"]], [prefix + "/onehot"],
                                   name=prefix + "/OneHot", axis=-1),
                 helper.make_node("Gemm", [prefix + "/onehot", updates], [product], name=prefix + "/Gemm", transA=1)]
        if not zero:
            nodes.append(helper.make_node("Add", [data, product], [node.output[0]], name=prefix + "/Add"))
        replaced[id(node)] = nodes
    return _replace_nodes(model, replaced, initializers)


def lookup_scatter(g: _Graph, node: onnx.NodeProto) -> onnx.NodeProto | None:
    """The ``Expand`` of ``node`` when it is an embedding lookup's gradient, ``ScatterElements(table,
    Expand(index[N, 1]), rows[N, D], axis=0, reduction="add")``, else None."""
    if not _is(node, "ScatterElements") or len(node.input) != 3:
        return None
    attrs = _attrs(node)
    reduction = attrs.get("reduction", b"none")
    if (reduction.decode() if isinstance(reduction, bytes) else reduction) != "add" or attrs.get("axis", 0) != 0:
        return None
    expand = g.producer.get(node.input[1])
    if expand is None or not _is(expand, "Expand") or not _column_of_indices(g, expand.input[0]):
        return None
    return expand


def _column_of_indices(g: _Graph, name: str) -> bool:
    """``name`` is an ``[N, 1]`` tensor: so its shape says, or a ``Reshape`` to ``[-1, 1]`` makes it."""
    shape = g.shapes.get(name)
    if shape is not None:
        return len(shape) == 2 and shape[1] == 1
    producer = g.producer.get(name)
    target = g.const(producer.input[1]) if producer is not None and _is(producer, "Reshape") else None
    return target is not None and target.reshape(-1).tolist() == [-1, 1]


__all__ = ["SMALL_TABLE_ROWS", "lookup_scatter", "small_table_gradients"]
