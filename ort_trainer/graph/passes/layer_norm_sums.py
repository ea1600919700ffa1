"""``fused_layer_norm_gradient``'s joint part: a LayerNorm's gradient added into the residual's, or cast to half, in
its kernel.

In a pre-norm transformer (GPT-2) the gradient of a LayerNorm's input goes on into the float32 sum of the residual
stream's gradient: ``Add(residual, LayerNormGrad(dy, ...).dx)``, and under mixed precision the sum is cast to the
half dtype for the products that read it next, while dy arrives as a float32 copy of a half product (``Cast``).
Each such chain becomes one ``LayerNormGradAdd`` node of ort_trainer's kernels (``ort_trainer/kernels``): dy read
in its own dtype, the gradient added to the residual in the kernel (one rounded float32 add, as the ``Add``
computes it), and as ``LayerNormGradAddCast`` the sum also written in dy's half dtype in place of the ``Cast`` of
it. The same values bit for bit; per LayerNorm of GPT-2 small at 8 × 512 about 75 MB of memory traffic less (the
dy copy read three times, the ``Add``, the ``Cast``) and three nodes fewer.

Only float32 LayerNorms (x, its statistics and gamma float32, as autocast computes them) whose gradient has the
``Add`` as its one reader are rewritten, the residual of the gradient's own static or symbolic shape; the new node
takes the ``Add``'s place, so a reader of dgamma or dbeta before it leaves the chain as it is.

A post-norm LayerNorm's gradient (BERT's) is read by the sublayer's backward and by the residual's sum both: there
the gradient's half cast, which the sublayer's products read, is written by the kernel beside it
(``LayerNormGradToFloat16`` / ``LayerNormGradToBFloat16``), about 13 MB a LayerNorm of BERT-base at 32 × 128 and a
node less.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ...kernels import DOMAIN as _KERNELS_DOMAIN
from ._graph import _Graph, _attrs, _elem_types, _is, _keep, _sole_consumer

_FLOAT = onnx.TensorProto.FLOAT
_HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def layer_norm_residual_sums(model: onnx.ModelProto) -> int:
    """Rewrite each eligible ``LayerNormGrad`` and the ``Add`` after it, then each other one whose gradient is cast
    to half (module docstring), in place; returns how many."""
    g = _Graph(model)
    types = _elem_types(model)
    position = {id(node): i for i, node in enumerate(model.graph.node)}
    dead: set[int] = set()
    before: dict[int, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        if node.domain != _KERNELS_DOMAIN or node.op_type != "LayerNormGrad" or id(node) in dead:
            continue
        if any(types.get(name) != _FLOAT for name in node.input[1:5]):
            continue
        add = _sole_consumer(g, node.output[0])
        if add is None or not _is(add, "Add") or id(add) in dead or types.get(add.output[0]) != _FLOAT:
            continue
        residual = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        shape = g.shapes.get(node.output[0])
        if (residual == node.output[0] or not shape or None in shape or g.shapes.get(residual) != shape
                or g.shapes.get(add.output[0]) != shape or types.get(residual) != _FLOAT):
            continue
        if any(position[id(reader)] < position[id(add)] for name in node.output[1:3]
               for reader in g.consumers.get(name, [])):
            continue  # dgamma or dbeta read before the sum: the node cannot move there
        dy, dy_chain = _half_source(node.input[0], node, g, types)
        cast = _half_cast(add.output[0], types.get(dy), g) if dy_chain else None
        outputs = [add.output[0], *node.output[1:4]] + ([cast.output[0]] if cast is not None else [])
        before[id(add)] = [helper.make_node(
            "LayerNormGradAddCast" if cast is not None else "LayerNormGradAdd", [dy, *node.input[1:5], residual],
            outputs, name=f"{node.name or node.output[0]}/add", domain=_KERNELS_DOMAIN)]
        dead |= {id(node), id(add), *dy_chain, *([id(cast)] if cast is not None else [])}
    _gradient_casts(model, g, types, dead, before)
    if before:
        _keep(model, dead, before=before)
    return len(before)


def _gradient_casts(model: onnx.ModelProto, g: _Graph, types: dict, dead: set[int],
                    before: dict[int, list[onnx.NodeProto]]) -> None:
    """Each float32 ``LayerNormGrad`` left whose gradient a ``Cast`` to a half dtype reads, as one
    ``LayerNormGradToFloat16`` / ``LayerNormGradToBFloat16`` in its place (``dead`` and ``before`` take the edits)."""
    for node in model.graph.node:
        if (node.domain != _KERNELS_DOMAIN or node.op_type != "LayerNormGrad" or id(node) in dead
                or any(types.get(name) != _FLOAT for name in node.input[:5])):
            continue
        cast = next((reader for reader in g.consumers.get(node.output[0], []) if _is(reader, "Cast")
                     and _attrs(reader).get("to") in _HALF and id(reader) not in dead), None)
        if cast is None:
            continue
        op = "LayerNormGradToFloat16" if _attrs(cast)["to"] == onnx.TensorProto.FLOAT16 else "LayerNormGradToBFloat16"
        before[id(node)] = [helper.make_node(op, list(node.input), [*node.output[:4], cast.output[0]],
                                             name=f"{node.name or node.output[0]}/cast", domain=_KERNELS_DOMAIN)]
        dead |= {id(node), id(cast)}


def _half_source(name: str, reader: onnx.NodeProto, g: _Graph, types: dict) -> tuple[str, list[int]]:
    """What dy is a float32 copy of: the half tensor of a ``Cast`` to float32, read through views by ``reader``
    alone, and the ids of the cast and views (dropped with the chain); else ``name`` itself and no nodes."""
    chain, current, consumer = [], name, reader
    while True:
        node = g.producer.get(current)
        if node is None or not g.only_used_by(current, consumer):
            return name, []
        if _is(node, "Reshape"):
            chain.append(id(node))
            current, consumer = node.input[0], node
            continue
        if _is(node, "Cast") and _attrs(node).get("to") == _FLOAT and types.get(node.input[0]) in _HALF:
            return node.input[0], [*chain, id(node)]
        return name, []


def _half_cast(name: str, half: int | None, g: _Graph) -> onnx.NodeProto | None:
    """A ``Cast`` of ``name`` to ``half``, the dtype dy came in, among ``name``'s readers (None: none)."""
    return next((reader for reader in g.consumers.get(name, []) if _is(reader, "Cast")
                 and _attrs(reader).get("to") == half and half in _HALF), None)


__all__ = ["layer_norm_residual_sums"]
