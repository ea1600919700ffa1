"""``torch_products``' last step: its ``Gemm`` nodes read and write ``[..., features]`` tensors where ``Reshape`` nodes
flattened them to 2-D around the product.

A linear layer on ``[batch, seq, features]`` activations is traced as a ``Reshape`` to ``[batch · seq, features]``,
the 2-D product, and a ``Reshape`` back; its backward reshapes the output's gradient to 2-D for the input's gradient
product (and back) and for the weight's. ONNX Runtime runs each ``Reshape`` as a node of its own (no copy, but a
node to dispatch from the host each step: GPT-2 small's training graph holds ~230 of them around its products,
BERT-base's ~380, of ~930 and ~1490 nodes with every lever). torch's product reads an operand of rank > 2 as the
matrix of its rows, a view (``kernels/csrc/torch_ops.cc``): here an ``ort_trainer.torch`` ``Gemm`` / ``BiasGemm`` /
``GemmToFloat`` reads the tensor a flattening ``Reshape`` (leading axes joined, the last kept) reads instead of its
output, as ``b``, as a transposed ``a`` (the output stays 2-D), or as ``a`` not transposed where every reader of
the product is a ``Reshape`` to ``[a's leading axes..., n]`` or one of ort_trainer's kernels that reads it as its
elements in order (``_ROW_READERS``: GPT-2's input gradients, which the LayerNorm gradient's kernel adds): the
product then writes that shape itself and those ``Reshape`` nodes go. The same products of the same numbers in the
same memory.

A column sum (``column_sums`` and ``half_precision_bias_gradient``: ``MatMul(ones[1, K], Reshape(x, [K, n]))``, a
bias's gradient, then a ``Reshape`` to ``[n]``) becomes a ``Gemm`` of a 1-D row of ones (one row: torch's product
on its ``[1, K]`` view, ``y`` then ``[n]``) that reads ``x`` as its rows, through every ``Reshape`` that keeps its
last axis, and writes the ``[n]`` sum itself: both ``Reshape`` nodes go (GPT-2 small: 96 a step; BERT-base: 146,
and the flattening ``Reshape`` that only the column sum read).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from ...kernels import DOMAIN as KERNELS_DOMAIN
from ...kernels import TORCH_OPS_DOMAIN
from ._graph import _Graph, _attrs, _elem_types, _is, _keep, _redirect, _set_dims, _static

_GEMMS = {"Gemm", "BiasGemm", "GemmToFloat"}
# ort_trainer's kernels that read an input as its elements in order, whatever its shape (they check its size only),
# and the inputs they read so: a LayerNorm's gradient added into the residual's (dy), AddHalf's half terms
_ROW_READERS = {"LayerNormGradAdd": range(0, 1), "LayerNormGradAddCast": range(0, 1), "AddHalf": range(1, 1 << 30)}
_SUMS = {"MatMul": "Gemm", "MatMulToFloat": "GemmToFloat"}  # a column sum's product -> the Gemm that takes a row


def product_views(model: onnx.ModelProto) -> int:
    """Rewrite the products' operands and outputs as the module docstring says, in place; returns how many operands
    and outputs now skip a ``Reshape``."""
    g = _Graph(model)
    renamed: dict[str, str] = {}  # an unflattening Reshape's output -> the product's, which now has its shape
    removed: dict[int, onnx.NodeProto] = {}
    count = 0
    for node in model.graph.node:
        if node.domain != TORCH_OPS_DOMAIN or node.op_type not in _GEMMS:
            continue
        source = _flattened(g, node.input[1])
        if source is not None:
            node.input[1] = source
            count += 1
        source = _flattened(g, node.input[0])
        if source is None:
            continue
        if _attrs(node).get("transA", 0):
            node.input[0] = source
            count += 1
            continue
        target = [*g.shapes[source][:-1], (g.shapes.get(node.output[0]) or [None])[-1]]
        readers = _unflattening_readers(g, node.output[0], target)
        if readers is None:
            continue
        node.input[0] = source
        if not readers:  # (only readers of its rows: the product keeps its name, of the shape it now has)
            for info in model.graph.value_info:
                if info.name == node.output[0]:
                    _set_dims(info, target)
            count += 1
            continue
        old, node.output[0] = node.output[0], readers[0].output[0]  # (the first reader's, whose shape is recorded)
        for reader in g.consumers[old]:  # (the readers of its rows read the new name)
            reader.input[:] = [node.output[0] if value == old else value for value in reader.input]
        for reader in readers:
            removed[id(reader)] = reader
            if reader is not readers[0]:
                renamed[reader.output[0]] = node.output[0]
        count += 2
    if removed:
        identities = _redirect(model, renamed, set(removed))
        _keep(model, set(removed), before={key: [identities[node.output[0]]] for key, node in removed.items()
                                           if node.output[0] in identities})
    return count + _column_sums(model)


def _column_sums(model: onnx.ModelProto) -> int:
    """Each column sum as one ``Gemm`` of a row of ones (the module docstring), in place, on the graph the products'
    views left; returns twice their count (each skips two ``Reshape`` nodes)."""
    g, types = _Graph(model), _elem_types(model)
    rows: dict[str, onnx.TensorProto] = {}  # the 1-D rows of ones the column sums read, by name
    removed = set()
    for node in model.graph.node:
        if node.domain == TORCH_OPS_DOMAIN and node.op_type in _SUMS:
            reshape = _column_sum(g, node, types, rows)
            if reshape is not None:
                removed.add(id(reshape))
    model.graph.initializer.extend(rows.values())
    _keep(model, removed)
    return 2 * len(removed)


def _column_sum(g: _Graph, node: onnx.NodeProto, types: dict, rows: dict) -> onnx.NodeProto | None:
    """Where ``node`` (a ``MatMul`` / ``MatMulToFloat``) sums the rows of a ``[K, n]`` view of a tensor
    (``MatMul(ones[1, K], b)``, neither transposed) and a ``Reshape`` to ``[n]`` alone reads it, the ``Gemm`` /
    ``GemmToFloat`` of a 1-D row of ones that reads the tensor itself and writes the ``Reshape``'s output (the module
    docstring), in place; returns that ``Reshape`` (for the caller to drop), else None."""
    ones, b = node.input[0], node.input[1]
    value, shape = g.const(ones), _shape(g, b)
    if (value is None or value.shape != (1, value.size) or np.any(value != 1) or _attrs(node).get("transA", 0)
            or _attrs(node).get("transB", 0) or not _static(shape) or len(shape) != 2 or shape[0] != value.size):
        return None
    readers = g.consumers.get(node.output[0], [])
    if (len(readers) != 1 or node.output[0] in g.outputs or not _is(readers[0], "Reshape")
            or _shape(g, readers[0].output[0]) != shape[1:]):
        return None
    dtype = types.get(ones)
    name = f"ort_trainer/column_sums/row_{value.size}_{onnx.TensorProto.DataType.Name(dtype).lower()}"
    if name not in g.initializers and name not in rows:
        rows[name] = helper.make_tensor(name, dtype, [value.size], [1.0] * value.size)
    node.op_type = _SUMS[node.op_type]
    node.input[:] = [name, _rows_of(g, b)]
    node.output[0] = readers[0].output[0]
    del node.attribute[:]
    return readers[0]


def _shape(g: _Graph, name: str) -> list | None:
    """``name``'s shape: as the graph records it, or where a ``Reshape`` of a constant static shape wrote it (a pass's
    node, which records none)."""
    shape = g.shapes.get(name)
    reshape = g.producer.get(name)
    if shape is None and reshape is not None and _is(reshape, "Reshape"):
        target = g.const(reshape.input[1])
        shape = [int(size) for size in target] if target is not None and np.all(target > 0) else None
    return shape


def _rows_of(g: _Graph, name: str) -> str:
    """The tensor that the chain of ``Reshape`` nodes ``name`` comes out of views as ``name``'s ``[K, n]`` rows (each
    of static shapes, the last axis ``n`` kept), or ``name`` itself."""
    shape = _shape(g, name)
    while True:
        reshape = g.producer.get(name)
        before = _shape(g, reshape.input[0]) if reshape is not None and _is(reshape, "Reshape") else None
        if not _static(before) or before[-1] != shape[-1] or math.prod(before) != math.prod(shape):
            return name
        name = reshape.input[0]


def _flattened(g: _Graph, name: str) -> str | None:
    """The input of the ``Reshape`` that ``name`` comes out of where it flattens a tensor of rank > 2 to
    ``[rows, last axis]`` (static shapes), else None."""
    reshape = g.producer.get(name)
    if reshape is None or not _is(reshape, "Reshape"):
        return None
    before, after = g.shapes.get(reshape.input[0]), g.shapes.get(name)
    if not _static(before) or not _static(after) or len(before) < 3:
        return None
    return reshape.input[0] if after == [math.prod(before[:-1]), before[-1]] else None


def _unflattening_readers(g: _Graph, name: str, target: list[int]) -> list[onnx.NodeProto] | None:
    """The ``Reshape`` readers of the 2-D product ``name`` where every reader is a ``Reshape`` to ``target`` (the
    product's rows unflattened) or reads only its elements in order (``_ROW_READERS``) and ``name`` is no graph
    output, else None."""
    readers = g.consumers.get(name, [])
    if not _static(g.shapes.get(name)) or not _static(target) or name in g.outputs or not readers:
        return None
    reshapes = [reader for reader in readers if _is(reader, "Reshape") and g.shapes.get(reader.output[0]) == target]
    rows = [reader for reader in readers if reader.domain == KERNELS_DOMAIN and reader.op_type in _ROW_READERS
            and all(index in _ROW_READERS[reader.op_type] for index, value in enumerate(reader.input) if value == name)]
    return reshapes if len(reshapes) + len(rows) == len(readers) else None


__all__ = ["product_views"]
