"""``fused_gradient_sums``: a float32 sum of a half-precision gradient in one kernel node.

Under mixed precision a weight read by several half-precision products (GPT-2's tied embedding: the input
embedding and, with ``loss_pieces``, the head of each piece of the loss) gets its float32 gradient as a chain
``Add(sum, Cast(g, to=float32))``: each term cast to a float32 copy first (GPT-2 small's head: a
``[50257, 768]`` copy per piece, read again by the ``Add``). Here each such ``Add`` whose cast has no other
reader is one ``AddHalf(sum, g)`` node of ort_trainer's kernels (``ort_trainer/kernels``): g widened as it is
read, one float32 add an element, the same values bit for bit. Where g is a padded product's leading rows
(``aligned_products``' ``Slice`` of rows from 0, possibly under pairs of ``Transpose`` nodes that undo each
other), the kernel reads the padded product itself: its first elements are those rows. The chain's first term,
itself a ``Cast`` of a half tensor, is read in its half dtype too (from a padded product, the node's attribute
``rows`` giving the sum's own). A chain of such sums, each read only by the next, is one node of up to three
half tensors: ``AddHalf(sum, g1, g2, g3)`` adds them in the chain's order, one float32 add each as before, without
writing and reading back a float32 sum between them (GPT-2's tied embedding: the pieces' head gradients, a half
first term and three more at its 8 × 512; BERT's: the gradients the query, key and value products give a layer's
input).

Only an ``Add`` of two tensors of one static shape is rewritten (no broadcasting).
"""

from __future__ import annotations

import onnx
from onnx import helper

from ...kernels import DOMAIN as _KERNELS_DOMAIN
from ...kernels import OPSET as _KERNELS_OPSET
from ._graph import _Graph, _attrs, _elem_types, _import_domain, _is, _replace_nodes, _undo, _widened

_HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
# the half tensors a chain's node adds to its sum at most: each keeps a gradient alive until the node runs, where
# the chain added it at once to a float32 partial sum, so a node of three holds at most two gradients more than the
# chain did at its fullest, however long the chain (GPT-2 small's head: 77 MB a loss piece; at 8 x 512, four
# pieces, one node, 77 MB more); a longer chain is several nodes
_MAX_TERMS = 3


def fused_gradient_sums(model: onnx.ModelProto) -> int:
    """Rewrite each eligible ``Add`` (module docstring) in place; returns how many (a chain's each)."""
    g = _Graph(model)
    types = _elem_types(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    sums: dict[str, tuple[onnx.NodeProto, onnx.NodeProto]] = {}  # an AddHalf's output: (the Add it replaces, it)
    for node in model.graph.node:
        if not _is(node, "Add") or types.get(node.output[0]) != onnx.TensorProto.FLOAT:
            continue
        shape = g.shapes.get(node.output[0])
        if not shape or not all(isinstance(size, int) for size in shape):
            continue
        for index in (0, 1):
            name, other = node.input[index], node.input[1 - index]
            cast = _widened(g, name, node)
            if (cast is None or types.get(cast.input[0]) not in _HALF or g.shapes.get(name) != shape
                    or g.shapes.get(other) != shape):
                continue
            x = _rows_source(cast.input[0], g)
            chained = sums.get(other)
            if (chained is not None and len(chained[1].input) <= _MAX_TERMS and g.only_used_by(other, node)
                    and types.get(chained[1].input[1]) == types.get(x)):
                # the chain's previous sum, read by this one alone: one node adds both nodes' half tensors
                replaced[id(chained[0])] = []
                fused = helper.make_node("AddHalf", [*chained[1].input, x], [node.output[0]],
                                         name=f"{node.output[0]}/AddHalf", domain=_KERNELS_DOMAIN)
                fused.attribute.extend(chained[1].attribute)
            else:
                source, attributes = _half_sum(other, node, types.get(cast.input[0]), shape, g, types)
                fused = helper.make_node("AddHalf", [source, x], [node.output[0]], name=f"{node.output[0]}/AddHalf",
                                         domain=_KERNELS_DOMAIN, **attributes)
            replaced[id(node)] = [fused]
            sums[node.output[0]] = (node, fused)
            break
    if _replace_nodes(model, replaced, {}):
        _import_domain(model, _KERNELS_DOMAIN, _KERNELS_OPSET)
    return len(replaced)


def _half_sum(name: str, add: onnx.NodeProto, half: int, shape: list[int], g: _Graph,
              types: dict) -> tuple[str, dict]:
    """The sum ``AddHalf`` reads for ``name``, and its attributes: where ``name`` is itself a ``Cast`` to float32 of
    the half dtype ``half`` that ``add`` alone reads (the first term of a chain), the half tensor it widens (through
    ``_rows_source``: a padded product itself), with ``rows`` the sum's first dim; else ``name``, none."""
    cast = _widened(g, name, add)
    if cast is None or types.get(cast.input[0]) != half:
        return name, {}
    # (the source is the cast's input, of ``shape``, or a tensor of ``shape``'s other dims and more rows)
    return _rows_source(cast.input[0], g), {"rows": shape[0]}


def _rows_source(name: str, g: _Graph) -> str:
    """The tensor whose first elements are ``name``'s, in order: ``name`` itself, or what a pair of ``Transpose``
    nodes that undo each other reads, or the input of a ``Slice`` of leading rows from 0 (a padded product)."""
    while True:
        second = g.producer.get(name)
        first = g.producer.get(second.input[0]) if second is not None and _is(second, "Transpose") else None
        if first is None or not _is(first, "Transpose") or not _undo(_attrs(first).get("perm"),
                                                                      _attrs(second).get("perm")):
            break
        name = first.input[0]
    piece = g.producer.get(name)
    if piece is None or not _is(piece, "Slice") or len(piece.input) < 4:
        return name
    starts, axes = g.const(piece.input[1]), g.const(piece.input[3])
    steps = g.const(piece.input[4]) if len(piece.input) > 4 and piece.input[4] else [1]
    if (starts is not None and axes is not None and steps is not None and list(starts) == [0]
            and list(axes) == [0] and list(steps) == [1]):
        return piece.input[0]
    return name


__all__ = ["fused_gradient_sums"]
