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
the product is a ``Reshape`` to ``[a's leading axes..., n]``: the product then writes that shape itself and those
``Reshape`` nodes go. The same products of the same numbers in the same memory.
"""

from __future__ import annotations

import math

import onnx

from ...kernels import TORCH_OPS_DOMAIN
from ._graph import _Graph, _attrs, _is, _keep, _redirect

_GEMMS = {"Gemm", "BiasGemm", "GemmToFloat"}


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
        readers = _unflattening_readers(g, node.output[0], g.shapes[source][:-1])
        if readers is None:
            continue
        node.input[0] = source
        node.output[0] = readers[0].output[0]  # (the first reader's name, whose shape the graph records)
        for reader in readers:
            removed[id(reader)] = reader
            if reader is not readers[0]:
                renamed[reader.output[0]] = node.output[0]
        count += 2
    if removed:
        identities = _redirect(model, renamed, set(removed))
        _keep(model, set(removed), before={key: [identities[node.output[0]]] for key, node in removed.items()
                                           if node.output[0] in identities})
    return count


def _static(shape) -> bool:
    return shape is not None and all(isinstance(size, int) and size > 0 for size in shape)


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


def _unflattening_readers(g: _Graph, name: str, leading: list[int]) -> list[onnx.NodeProto] | None:
    """The readers of the 2-D product ``name`` where every one is a ``Reshape`` to ``leading + [columns]`` and
    ``name`` is no graph output, else None."""
    shape = g.shapes.get(name)
    readers = g.consumers.get(name, [])
    if not _static(shape) or name in g.outputs or not readers:
        return None
    target = [*leading, shape[-1]]
    if all(_is(reader, "Reshape") and g.shapes.get(reader.output[0]) == target for reader in readers):
        return readers
    return None


__all__ = ["product_views"]
