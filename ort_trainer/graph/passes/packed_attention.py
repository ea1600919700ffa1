"""``packed_attention``: a fused attention reads q, k and v where one projection packed them, and writes their
gradients so.

A transformer whose q, k and v come out of one product (GPT-2's ``c_attn``: ``[batch, seq, 3 · heads · dim]``)
splits them with a ``Split`` on the last axis, a copy of the whole tensor, and its backward joins their gradients
with a ``Concat``, another (GPT-2 small at 8 × 512 in float16: 19 MB read and 19 MB written by each, a layer). With
``fused_attention`` the attention's nodes take q, k and v as ``[batch, seq, heads, dim]`` views of those parts
(``attention_layout.py``), and torch's kernels read any strides: here an ``Attention`` / ``BiasAttention`` node
whose q, k and v are views of a ``Split``'s three equal outputs, in order, and whose one ``AttentionGrad`` /
``BiasAttentionGrad`` node's gradients go, through views, into one ``Concat`` in that order (the ``Split``'s
gradient), become ``PackedAttention`` / ``PackedBiasAttention(qkv)`` and ``PackedAttentionGrad`` /
``PackedBiasAttentionGrad(dout, qkv, ...)`` on a ``[batch, seq, 3, heads, dim]`` view of the ``Split``'s input,
the gradient written as one tensor of that shape, which a view makes the ``Concat``'s output (torch's kernels:
``kernels/csrc/torch_ops.cc``). The same arithmetic on the same numbers; the ``Split`` and the ``Concat`` go.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ...kernels import TORCH_OPS_DOMAIN
from ._graph import _Graph, _attrs, _elem_types, _is, _keep

_FORWARD = {"Attention": "PackedAttention", "BiasAttention": "PackedBiasAttention"}
_BACKWARD = {"AttentionGrad": "PackedAttentionGrad", "BiasAttentionGrad": "PackedBiasAttentionGrad"}


def packed_attention(model: onnx.ModelProto) -> int:
    """Rewrite each eligible attention (module docstring) in place; returns how many (forward and backward, one)."""
    g = _Graph(model)
    types = _elem_types(model)
    backward: dict[tuple[str, ...], list[onnx.NodeProto]] = {}  # (q, k, v) -> the gradient nodes that read them
    for node in model.graph.node:
        if node.domain == TORCH_OPS_DOMAIN and node.op_type in _BACKWARD:
            backward.setdefault(tuple(node.input[1:4]), []).append(node)
    dead: set[int] = set()
    before: dict[int, list[onnx.NodeProto]] = {}
    count = 0
    for node in list(model.graph.node):
        if node.domain != TORCH_OPS_DOMAIN or node.op_type not in _FORWARD or _attrs(node).get("layout") != 1:
            continue
        packed, grads = _packed(g, node.input[:3]), backward.get(tuple(node.input[:3]), [])
        if packed is None or len(grads) != 1 or _attrs(grads[0]).get("layout") != 1:
            continue
        split, views, heads, dim = packed
        grad = grads[0]
        joined = _joined(g, grad)
        if joined is None or not all(g.only_used_by(name, node, grad) for name in node.input[:3]):
            continue
        concat, grad_views = joined
        source, elem = split.input[0], types.get(split.input[0])
        qkv, qkv_grad = f"{source}/qkv_heads", f"{concat.output[0]}/qkv_heads"
        dims = [*g.shapes[source][:2], 3, heads, dim]
        model.graph.initializer.extend([
            helper.make_tensor(f"{qkv}/shape", onnx.TensorProto.INT64, [5], [0, 0, 3, heads, dim]),
            helper.make_tensor(f"{qkv_grad}/shape", onnx.TensorProto.INT64, [3], [0, 0, -1])])
        model.graph.value_info.extend([helper.make_tensor_value_info(name, elem, dims) for name in (qkv, qkv_grad)])
        forward = helper.make_node(_FORWARD[node.op_type], [qkv, *node.input[3:]], list(node.output),
                                   name=f"{node.name or node.output[0]}/packed", domain=TORCH_OPS_DOMAIN)
        gradient = helper.make_node(_BACKWARD[grad.op_type], [grad.input[0], qkv, *grad.input[4:]], [qkv_grad],
                                    name=f"{grad.name or grad.output[0]}/packed", domain=TORCH_OPS_DOMAIN)
        forward.attribute.extend(node.attribute)
        gradient.attribute.extend(grad.attribute)
        before[id(split)] = [helper.make_node("Reshape", [source, f"{qkv}/shape"], [qkv], name=f"{qkv}/view")]
        before[id(node)], before[id(grad)] = [forward], [gradient]
        before[id(concat)] = [helper.make_node("Reshape", [qkv_grad, f"{qkv_grad}/shape"], [concat.output[0]],
                                               name=f"{qkv_grad}/view")]
        dead |= {id(n) for n in (split, *views, node, grad, concat, *grad_views)}
        count += 1
    if count:
        _keep(model, dead, before=before)
    return count


def _packed(g: _Graph, names) -> tuple[onnx.NodeProto, list[onnx.NodeProto], int, int] | None:
    """Where q, k and v (``names``) are ``[batch, seq, heads, dim]`` views (``Reshape``) of a ``Split``'s three
    equal outputs in order, on the last axis of a ``[batch, seq, 3 · heads · dim]`` tensor, each read by its view
    alone: (the ``Split``, the views, heads, dim); else None."""
    views = [g.producer.get(name) for name in names]
    if any(v is None or not _is(v, "Reshape") for v in views):
        return None
    split = g.producer.get(views[0].input[0])
    shape, part = g.shapes.get(split.input[0]) if split is not None else None, g.shapes.get(names[0])
    if (split is None or not _is(split, "Split") or len(split.output) != 3 or not shape or len(shape) != 3
            or _attrs(split).get("axis", 0) not in (2, -1) or not part or len(part) != 4
            or not all(isinstance(size, int) for size in part[2:]) or shape[2] != 3 * part[2] * part[3]
            or any(g.shapes.get(name) != part for name in names)
            or [v.input[0] for v in views] != list(split.output)
            or not all(g.only_used_by(out, v) for out, v in zip(split.output, views))):
        return None
    return split, views, part[2], part[3]


def _joined(g: _Graph, grad: onnx.NodeProto) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """The ``Concat`` on the last axis that joins views (``Reshape``) of ``grad``'s three outputs, in order, each
    read by its view alone and the views by the ``Concat`` alone, and the views; else None."""
    views = [g.consumers.get(name, []) for name in grad.output]
    if any(len(v) != 1 or not _is(v[0], "Reshape") or not g.only_used_by(name, v[0])
           for name, v in zip(grad.output, views)):
        return None
    views = [v[0] for v in views]
    concat = g.consumers.get(views[0].output[0], [None])[0]
    rank = len(g.shapes.get(concat.output[0]) or []) if concat is not None else 0
    if (concat is None or not _is(concat, "Concat") or list(concat.input) != [v.output[0] for v in views]
            or _attrs(concat).get("axis") not in (rank - 1, -1) or rank != 3
            or not all(g.only_used_by(v.output[0], concat) for v in views)):
        return None
    return concat, views


__all__ = ["packed_attention"]
