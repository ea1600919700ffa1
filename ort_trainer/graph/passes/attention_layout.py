"""``fused_attention`` on the joint graph: the fused attention nodes read and write the heads where the
projections lay them.

A transformer's attention splits each projection's ``[batch, seq, heads · dim]`` rows into heads with a view
(``[batch, seq, heads, dim]``) and a ``Transpose`` to ``[batch, heads, seq, dim]``; the attention's output goes
back through the inverse ``Transpose``, and so do, in the backward, the output's gradient and q's, k's and v's.
ONNX Runtime runs each ``Transpose`` as a copy: eight per layer and step (GPT-2 small at 8 × 512 in float16,
~1.2 GB). torch's attention kernels read and write any strides (the memory-efficient kernel works on
``[batch, seq, heads, dim]`` itself), so here the ``Attention``, ``BiasAttention``, ``AttentionGrad`` and
``BiasAttentionGrad`` nodes (``graph/gradient/attention_ops.py``) whose q, k and v (and, backward, the
output's gradient) come out of such a ``Transpose`` read its input instead and write their outputs (``out``,
``dq``, ``dk``, ``dv``) in that layout, the attribute ``layout`` 1; each output's readers get the
``[batch, heads, seq, dim]`` value back through one ``Transpose``, which cancels against the inverse
``Transpose`` that reads it (through views that keep the shape), so that in GPT-2's and BERT's graphs none is
left. The same arithmetic: the kernels compute the same sums on the same numbers in another memory layout.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ...kernels import TORCH_OPS_DOMAIN
from ..onnx_graph import drop_dead_nodes
from ._graph import _Graph, _attrs, _is, _keep, _redirect, _value_info_like

HEADS_SWAPPED = [0, 2, 1, 3]  # [batch, seq, heads, dim] <-> [batch, heads, seq, dim] (its own inverse)
# each operator's inputs that are [batch, heads, seq, dim] tensors and the index of the forward output it reads
_FORWARD = {"Attention", "BiasAttention"}
_BACKWARD = {"AttentionGrad": ((0, 1, 2, 3), 4), "BiasAttentionGrad": ((0, 1, 2, 3), 5)}
_SUFFIX = "/heads_last"


def attention_layout(model: onnx.ModelProto) -> int:
    """Rewrite the fused attention nodes as the module docstring says, in place; returns how many."""
    g = _Graph(model)
    after: dict[int, list[onnx.NodeProto]] = {}
    laid_out: dict[str, str] = {}  # a forward output -> its [batch, seq, heads, dim] form
    count = 0
    for node in model.graph.node:
        if node.domain != TORCH_OPS_DOMAIN or node.op_type not in _FORWARD | set(_BACKWARD):
            continue
        forward = node.op_type in _FORWARD
        heads, out_index = ((0, 1, 2), None) if forward else _BACKWARD[node.op_type]
        sources = [_unswapped(node.input[i], g) for i in heads]
        if None in sources or (out_index is not None and node.input[out_index] not in laid_out):
            continue
        for i, source in zip(heads, sources):
            node.input[i] = source
        if out_index is not None:
            node.input[out_index] = laid_out[node.input[out_index]]
        node.attribute.append(helper.make_attribute("layout", 1))
        back = []
        for i in (0,) if forward else (0, 1, 2):
            name = node.output[i]
            node.output[i] = laid_out[name] = name + _SUFFIX
            shape = g.shapes.get(name)  # heads and seq swapped, for the passes after this one
            _value_info_like(model, name, node.output[i], [shape[p] for p in HEADS_SWAPPED] if shape else None)
            back.append(helper.make_node("Transpose", [node.output[i]], [name], perm=HEADS_SWAPPED,
                                         name=name + _SUFFIX + "/back"))
        after[id(node)] = back
        count += 1
    if count:
        _keep(model, set(), after=after)
        _cancel_inverse_transposes(model)
        drop_dead_nodes(model)  # (the back transposes the cancelled ones read: the passes after read the outputs')
    return count


def _unswapped(name: str, g: _Graph) -> str | None:
    """The input of the heads-swapping ``Transpose`` that ``name`` comes out of, else None."""
    producer = g.producer.get(name)
    if producer is None or not _is(producer, "Transpose") or _attrs(producer).get("perm") != HEADS_SWAPPED:
        return None
    return producer.input[0]


def _cancel_inverse_transposes(model: onnx.ModelProto) -> None:
    """Each heads-swapping ``Transpose`` that reads (through ``Reshape`` nodes that keep the shape) another one's
    output goes: its readers read the first one's input instead (the two are the identity)."""
    g = _Graph(model)
    renamed, removed = {}, {}
    for node in model.graph.node:
        if not _is(node, "Transpose") or _attrs(node).get("perm") != HEADS_SWAPPED:
            continue
        name = node.input[0]
        while (producer := g.producer.get(name)) is not None and _is(producer, "Reshape") and _same_shape(
                producer, g):
            name = producer.input[0]
        source = _unswapped(name, g)
        if source is not None:
            renamed[node.output[0]] = source
            removed[id(node)] = node
    identities = _redirect(model, renamed, set(removed))  # a graph output keeps its name through an Identity
    _keep(model, set(removed), before={key: [identities[node.output[0]]] for key, node in removed.items()
                                       if node.output[0] in identities})


def _same_shape(reshape: onnx.NodeProto, g: _Graph) -> bool:
    """A ``Reshape`` whose output has its input's shape, every dimension known."""
    before, after = g.shapes.get(reshape.input[0]), g.shapes.get(reshape.output[0])
    return before is not None and before == after and all(size not in (None, 0, "") for size in before)


__all__ = ["attention_layout"]
