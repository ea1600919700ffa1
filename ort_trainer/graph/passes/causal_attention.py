"""``causal_attention``: a fused attention whose mask holds the causal triangle computes it in the kernel.

A decoder's mask (Hugging Face's GPT-2 under ``torch.export``, where it cannot drop an all-ones padding mask as it
does eagerly) reaches ``scaled_dot_product_attention`` as one boolean ``[batch, 1, seq, seq]`` tensor: the
lower triangle, a constant, and-ed with each sequence's padding. ``fused_attention`` adds it as a bias
(``Where(mask, 0, -inf)``, a ``[batch, 1, seq, seq]`` tensor in q's dtype; a constant where the mask is one), so
the kernels read a bias for every score and compute every block of scores, the half above the diagonal too, which
the bias then removes. Here a ``BiasAttention`` / ``PackedBiasAttention`` node (``attention_layout.py``,
``packed_attention.py``) whose bias is ``Where(c, 0, -inf)`` with ``c`` an ``And`` of the lower-triangular
``[seq, seq]`` constant (leading axes 1, as many keys as queries), constants that are all true, and other terms,
and its ``...Grad`` node(s), take the attribute ``causal`` 1 (torch's kernels mask the scores above the diagonal
themselves and skip the blocks wholly above it) and a bias of the other terms only, ``Where(And(terms), 0, -inf)``
in their own broadcast shape (the padding's ``[batch, 1, 1, seq]``); with no other term (or a constant bias of the
triangle's 0 and -inf), no bias: ``Attention`` / ``PackedAttention``. Every score masked before is masked now and
no other: the same values, bit for bit on the CPU (``tests/test_causal_attention.py``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from ...kernels import TORCH_OPS_DOMAIN
from ._graph import _Graph, _attrs, _elem_types, _is, _keep

_FORWARD = {"BiasAttention": "Attention", "PackedBiasAttention": "PackedAttention"}
_BACKWARD = {"BiasAttentionGrad": "AttentionGrad", "PackedBiasAttentionGrad": "PackedAttentionGrad"}
_BIAS_AT = {"BiasAttention": 3, "PackedBiasAttention": 1, "BiasAttentionGrad": 4, "PackedBiasAttentionGrad": 2}
_QKV = {"BiasAttention": slice(0, 3), "PackedBiasAttention": slice(0, 1), "BiasAttentionGrad": slice(1, 4),
        "PackedBiasAttentionGrad": slice(1, 2)}


def causal_attention(model: onnx.ModelProto) -> int:
    """Rewrite each eligible attention (module docstring) in place; returns how many nodes (forward and backward)."""
    g, types = _Graph(model), _elem_types(model)
    backward: dict[tuple[str, ...], list[onnx.NodeProto]] = {}  # (q, k, v or qkv, bias) -> the gradient nodes
    for node in model.graph.node:
        if node.domain == TORCH_OPS_DOMAIN and node.op_type in _BACKWARD:
            backward.setdefault(_key(node), []).append(node)
    terms_of: dict[str, list[str] | None] = {}  # a bias -> its other terms (None: not causal)
    new_bias: dict[str, str] = {}  # a bias -> the bias of its other terms ("" where none)
    before: dict[int, list[onnx.NodeProto]] = {}
    count = 0
    for node in list(model.graph.node):
        if node.domain != TORCH_OPS_DOMAIN or node.op_type not in _FORWARD or _attrs(node).get("causal"):
            continue
        bias = node.input[_BIAS_AT[node.op_type]]
        if bias not in terms_of:
            terms_of[bias] = _other_terms(g, bias, _seq(g, node))
        terms = terms_of[bias]
        grads = backward.get(_key(node), [])
        if terms is None or not grads or any(_attrs(grad).get("causal") for grad in grads):
            continue
        if bias not in new_bias:
            new_bias[bias] = _bias_of(model, g, types, bias, terms, before.setdefault(id(node), []))
        for rewritten in (node, *grads):
            _make_causal(rewritten, new_bias[bias])
        count += 1 + len(grads)
    if count:
        _keep(model, set(), before=before)
    return count


def _key(node: onnx.NodeProto) -> tuple[str, ...]:
    return (*node.input[_QKV[node.op_type]], node.input[_BIAS_AT[node.op_type]])


def _seq(g: _Graph, node: onnx.NodeProto) -> int | None:
    """The number of queries of a forward attention node (its keys are as many where the mask is causal), else None
    where not static."""
    shape = g.shapes.get(node.input[0])
    if shape is None:
        return None
    # q [batch, heads, seq, dim] (layout 0), [batch, seq, heads, dim] (layout 1), qkv [batch, seq, 3, heads, dim]
    size = shape[2] if node.op_type == "BiasAttention" and _attrs(node).get("layout", 0) == 0 else shape[1]
    return size if isinstance(size, int) and size > 0 else None


def _other_terms(g: _Graph, bias: str, seq: int | None) -> list[str] | None:
    """The non-constant terms of a ``Where(And(...), 0, -inf)`` bias whose constant terms are one lower triangle of
    ``seq`` x ``seq`` (leading axes 1) and any that are all true, none for a constant bias that is 0 on that
    triangle and -inf elsewhere; None where the bias is neither."""
    if seq is None:
        return None
    value = g.const(bias)
    if value is not None:  # a constant bias (a constant mask's, folded): the triangle's 0 and -inf alone
        kept = value == 0
        return [] if _lower_triangle(kept, seq) and np.all(kept | (value == -np.inf)) else None
    where = g.producer.get(bias)
    if where is None or not _is(where, "Where") or g.fill_value(where.input[1]) != 0.0:
        return None
    masked = g.fill_value(where.input[2])
    if masked is None or not (math.isinf(masked) and masked < 0):
        return None
    terms, triangles, pending = [], 0, [where.input[0]]
    while pending:
        name = pending.pop()
        producer = g.producer.get(name)
        if producer is not None and _is(producer, "And"):
            pending.extend(reversed(producer.input))
            continue
        value = g.const(name)
        if value is None:
            terms.append(name)
        elif value.dtype != np.bool_:
            return None
        elif value.all():
            continue
        elif _lower_triangle(value, seq):
            triangles += 1
        else:
            return None
    return terms if triangles == 1 else None


def _lower_triangle(value: np.ndarray, seq: int) -> bool:
    """``value`` is the ``seq`` x ``seq`` lower triangle (the diagonal in) with leading axes of size 1."""
    if value.ndim < 2 or value.shape[-2:] != (seq, seq) or any(size != 1 for size in value.shape[:-2]):
        return False
    return bool(np.array_equal(value.reshape(seq, seq), np.tril(np.ones((seq, seq), dtype=bool))))


def _bias_of(model: onnx.ModelProto, g: _Graph, types: dict[str, int], bias: str, terms: list[str],
             nodes: list[onnx.NodeProto]) -> str:
    """The name of ``Where(And(terms), 0, -inf)`` (the old bias's constants), its nodes appended to ``nodes``;
    "" where there is no term."""
    if not terms:
        return ""
    where = g.producer[bias]
    condition = terms[0]
    for i, term in enumerate(terms[1:]):
        joined = f"{bias}/causal_rest/and{i}"
        nodes.append(helper.make_node("And", [condition, term], [joined], name=joined))
        condition = joined
    name = f"{bias}/causal_rest"
    nodes.append(helper.make_node("Where", [condition, *where.input[1:]], [name], name=name))
    shapes = [g.shapes.get(term) for term in terms]
    if all(shape is not None for shape in shapes):
        rank = max(len(shape) for shape in shapes)
        padded = [[1] * (rank - len(shape)) + list(shape) for shape in shapes]
        dims = [next((size for size in sizes if size != 1), 1) for sizes in zip(*padded)]
        elem = types.get(bias) or types.get(where.input[1])  # (the bias's dtype: its 0's)
        if elem:
            model.graph.value_info.append(helper.make_tensor_value_info(name, elem, dims))
    return name


def _make_causal(node: onnx.NodeProto, bias: str) -> None:
    """``node`` with the attribute causal 1 and ``bias`` for its bias (no bias input and no ``Bias`` in its type
    where ``bias`` is "")."""
    at = _BIAS_AT[node.op_type]
    if bias:
        node.input[at] = bias
    else:
        inputs = [name for i, name in enumerate(node.input) if i != at]
        del node.input[:]
        node.input.extend(inputs)
        node.op_type = {**_FORWARD, **_BACKWARD}[node.op_type]
    kept = [a for a in node.attribute if a.name != "causal"]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute("causal", 1)])


__all__ = ["causal_attention"]
