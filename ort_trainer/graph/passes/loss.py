"""``half_precision_loss``: a mixed-precision cross-entropy without float32 copies of the logits.

Under ``torch.autocast`` (and in Hugging Face's losses, which call ``logits.float()``) the
cross-entropy runs in float32 on half-precision logits. After the ``cross_entropy`` pass
(``joint.py``) the joint graph holds, over the ``[N, vocabulary]`` scores::

    forward:  X = Cast(L, float32) (Reshapes before or after)    Y = LogSoftmax(X)
              picked = GatherElements(Y, target)                 (the loss reads ``picked``)
    backward: G = ScatterElements(Exp(Y) · w, target, spread, reduction="add")
              dL = Cast(G, half) (Reshapes before or after)

``L`` float16 or bfloat16, ``w`` one weight per row (the loss's gradient over the labelled count,
times the loss scale; absent when 1) and ``spread = -w``. Five float32 tensors of the scores'
size, each written and read once (GPT-2 small at 8 x 512 tokens: 823 MB each), and ``Y`` held
from the forward to the backward, at the forward's end, where a step's memory peaks.

The pass computes the same values from ``L`` in its own dtype::

    forward:  Yh = LogSoftmax(Xh)        picked = Cast(GatherElements(Yh, target), float32)
    backward: Ph = Softmax(Xh)           (recomputed: ``Yh`` is not kept for the backward)
              dL = ScatterElements(Ph · Cast(w, half), target,
                                   Cast(Cast(GatherElements(Ph, target), float32) · w + spread, half))

with ``Xh`` the half-precision scores (the same Reshapes, no Cast). No float32 tensor of the
scores' size is left: two kernels that read ``L`` and write one half-size result each, one
multiplication, one scatter of a value per row (``reduction="none"``: ONNX Runtime's CUDA
``ScatterElements`` picks its kernel by element size, so a bfloat16 ``add`` would add the bits as
float16; assignment copies them exactly).

Precision (``tests/test_half_loss.py`` holds it against float64): ONNX Runtime's CUDA softmax
kernels accumulate in float32 and round their outputs once to the half dtype. Each row's
log-probability is therefore rounded once (float16: 2⁻¹¹ of its size, ±0.004 at GPT-2's initial
loss of 10.8; bfloat16: 2⁻⁸, ±0.03), and the mean over ``N`` rows adds them in float32: the
rounding errors are independent, so the mean moves by ~10.8 · 2⁻¹² / √N (GPT-2 small at 8 x 512:
3e-6 relative in float16, 3e-5 in bfloat16). The gradient of each score is ``p · w`` rounded
twice (``p``, then the product: 2u, where autocast's float32 result is rounded once, u) with ``w``
itself rounded once to the half dtype, a factor common to the row; at the label, ``p · w - w`` is
computed in float32 from the rounded ``p``. A float16 ``w`` above 65504 (a loss scale larger than
65504 times the labelled rows) is infinite, and the step counts as an overflow for the dynamic
loss scaler, where float32 would have kept the other scores' gradients finite.

Every float32 value of the pattern must be read inside it only; otherwise nothing is rewritten.
The eval graph (the loss forward only) gets the forward half.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ._graph import _Graph, _attrs, _elem_types, _is, _keep, _other, _sole_consumer

_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def half_precision_loss(model: onnx.ModelProto) -> int:
    """Compute each float32 cross-entropy over half-precision scores in the scores' dtype.

    Args:
        model: a joint graph of the ``"torch"`` source after the ``cross_entropy`` pass, or an
            eval graph after ``cross_entropy_forward``; rewritten in place.

    Returns:
        The number of log-softmaxes rewritten.
    """
    g = _Graph(model)
    types = _elem_types(model)
    dead: set[int] = set()
    before: dict[int, list[onnx.NodeProto]] = {}
    count = 0
    for log_softmax in [n for n in model.graph.node if _is(n, "LogSoftmax")]:
        found = _match(g, types, log_softmax)
        if found is None:
            continue
        half, widening, gathers, backward = found
        prefix = f"{log_softmax.name or log_softmax.output[0]}/half_loss"
        placed = _rewrite(prefix, half, types[half], widening, log_softmax, gathers, backward)
        # Shape readers of the float32 scores or log-probabilities (a runtime row count is read off them)
        # read the half value of the same shape instead: the cast's input, each new Reshape's output
        same = {widening[0].output[0]: half}
        for node, new in placed:
            if any(node is n for n in widening[1:]):
                same[node.output[0]] = new[0].output[0]
            elif node is log_softmax:
                same[node.output[0]] = new[0].input[0]
        for name, value in same.items():
            for shape in _shapes_of(g, name):
                shape.input[0] = value
        for node, new in placed:
            before.setdefault(id(node), []).extend(new)
        dead |= {id(n) for n in [*widening, log_softmax, *gathers, *(backward[1] if backward else [])]}
        count += 1
    if count:
        _keep(model, dead, before=before)
        produced = {o for n in model.graph.node for o in n.output}
        kept = [info for info in model.graph.value_info if info.name in produced]  # not the dropped values'
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept)
    return count


def _rewrite(prefix: str, half: str, dtype: int, widening: list, log_softmax: onnx.NodeProto, gathers: list,
             backward: tuple | None) -> list[tuple[onnx.NodeProto, list[onnx.NodeProto]]]:
    """``[(old node, the new nodes that go right before it)]`` of the rewrite (see the module's
    docstring): each new node goes where the node it replaces was, after what that one read."""
    placed = []
    scores = half
    for i, node in enumerate(n for n in widening if _is(n, "Reshape")):
        out = f"{prefix}/scores_{i}"
        placed.append((node, [helper.make_node("Reshape", [scores, node.input[1]], [out],
                                               name=f"{prefix}/Reshape_{i}", **_attrs(node))]))
        scores = out
    axis = _attrs(log_softmax).get("axis", -1)
    log_probabilities = f"{prefix}/log_probabilities"
    placed.append((log_softmax, [helper.make_node("LogSoftmax", [scores], [log_probabilities],
                                                  name=f"{prefix}/LogSoftmax", axis=axis)]))
    for i, gather in enumerate(gathers):
        placed.append((gather, [
            helper.make_node("GatherElements", [log_probabilities, gather.input[1]], [f"{prefix}/picked_{i}"],
                             name=f"{prefix}/GatherElements_{i}", **_attrs(gather)),
            helper.make_node("Cast", [f"{prefix}/picked_{i}"], [gather.output[0]], name=f"{prefix}/Cast_picked_{i}",
                             to=TensorProto.FLOAT)]))
    if backward is None:
        return placed
    scatter, _, weight, narrowing = backward
    target, spread = scatter.input[1], scatter.input[2]
    p, label = f"{prefix}/probabilities", f"{prefix}/label_probability_float"
    nodes = [helper.make_node("Softmax", [scores], [p], name=f"{prefix}/Softmax", axis=axis),
             helper.make_node("GatherElements", [p, target], [f"{prefix}/label_probability"],
                              name=f"{prefix}/GatherElements_label", axis=axis),
             helper.make_node("Cast", [f"{prefix}/label_probability"], [label], name=f"{prefix}/Cast_label",
                              to=TensorProto.FLOAT)]
    scaled = p
    if weight is not None:
        nodes += [helper.make_node("Cast", [weight], [f"{prefix}/weight"], name=f"{prefix}/Cast_weight", to=dtype),
                  helper.make_node("Mul", [p, f"{prefix}/weight"], [f"{prefix}/scaled"], name=f"{prefix}/Mul_weight"),
                  helper.make_node("Mul", [label, weight], [f"{prefix}/label_scaled"], name=f"{prefix}/Mul_label")]
        label, scaled = f"{prefix}/label_scaled", f"{prefix}/scaled"
    reshapes = [n for n in narrowing if _is(n, "Reshape")]
    gradient = f"{prefix}/gradient" if reshapes else narrowing[-1].output[0]
    nodes += [helper.make_node("Add", [label, spread], [f"{prefix}/label_gradient_float"], name=f"{prefix}/Add_label"),
              helper.make_node("Cast", [f"{prefix}/label_gradient_float"], [f"{prefix}/label_gradient"],
                               name=f"{prefix}/Cast_label_gradient", to=dtype),
              helper.make_node("ScatterElements", [scaled, target, f"{prefix}/label_gradient"], [gradient],
                               name=f"{prefix}/ScatterElements", axis=axis)]
    placed.append((scatter, nodes))
    for i, node in enumerate(reshapes):
        out = narrowing[-1].output[0] if i == len(reshapes) - 1 else f"{prefix}/gradient_{i}"
        placed.append((node, [helper.make_node("Reshape", [gradient, node.input[1]], [out],
                                               name=f"{prefix}/Reshape_gradient_{i}", **_attrs(node))]))
        gradient = out
    return placed


def _match(g: _Graph, types: dict[str, int], log_softmax: onnx.NodeProto) -> tuple | None:
    """``(half-precision scores, widening chain, GatherElements readers, backward or None)`` of a
    cross-entropy at ``log_softmax``, or None. The backward is ``_match_backward``'s."""
    if types.get(log_softmax.output[0]) != TensorProto.FLOAT or log_softmax.input[0] not in g.shapes:
        return None
    widening = _chain_back(g, types, log_softmax)
    if widening is None:
        return None
    half = widening[0].input[0]
    rank = len(g.shapes[log_softmax.input[0]])
    axis = _attrs(log_softmax).get("axis", -1) % rank
    if axis != rank - 1 or log_softmax.output[0] in g.outputs:
        return None
    readers = g.consumers.get(log_softmax.output[0], [])
    gathers = [n for n in readers if _is(n, "GatherElements") and n.input[0] == log_softmax.output[0]
               and _attrs(n).get("axis", 0) % (axis + 1) == axis]
    exps = [n for n in readers if _is(n, "Exp")]
    if len(gathers) + len(exps) + len(_shapes_of(g, log_softmax.output[0])) != len(readers) or len(exps) > 1:
        return None
    backward = _match_backward(g, types, exps[0], axis, types[half]) if exps else None
    if exps and backward is None:
        return None
    return half, widening, gathers, backward


def _chain_back(g: _Graph, types: dict[str, int], reader: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """The Reshapes and the one ``Cast(half -> float32)`` that lead to ``reader``'s first input, first
    node first, each output read by the next alone; None when there is no such chain."""
    chain: list[onnx.NodeProto] = []
    name = reader.input[0]
    while True:
        others = [n for n in g.consumers.get(name, []) if n not in _shapes_of(g, name)]
        if name in g.outputs or len(others) != 1 or others[0] is not (chain[0] if chain else reader) \
                or list(others[0].input).count(name) != 1:
            return None
        node = g.producer.get(name)
        if node is None or not (_is(node, "Reshape") or _is(node, "Cast")):
            return None
        chain.insert(0, node)
        if _is(node, "Cast"):
            widens = _attrs(node).get("to") == TensorProto.FLOAT and types.get(node.input[0]) in _HALF
            return chain if widens else None
        name = node.input[0]


def _shapes_of(g: _Graph, name: str) -> list[onnx.NodeProto]:
    """The ``Shape`` nodes reading ``name`` (the row count of a runtime size is read off the scores):
    the rewrite points them at the half-precision value of the same shape."""
    return [n for n in g.consumers.get(name, []) if _is(n, "Shape")]


def _match_backward(g: _Graph, types: dict[str, int], exp: onnx.NodeProto, axis: int, dtype: int) -> tuple | None:
    """``(ScatterElements, nodes to drop, w or None, narrowing chain)`` of the cross-entropy pass's
    backward from ``exp``, narrowed back to ``dtype``; None when it is not that pattern."""
    nodes = [exp]
    reader = _sole_consumer(g, exp.output[0])
    weight = None
    if reader is not None and _is(reader, "Mul"):
        weight = _other(reader, exp.output[0])
        if types.get(weight) != TensorProto.FLOAT or not _one_per_row(g, weight, exp.output[0], axis):
            return None
        nodes.append(reader)
        reader = _sole_consumer(g, reader.output[0])
    if reader is None or not _is(reader, "ScatterElements") or reader.input[0] != nodes[-1].output[0]:
        return None
    scatter, attrs = reader, _attrs(reader)
    reduction = attrs.get("reduction", b"none")
    target = g.shapes.get(scatter.input[1])
    if (reduction.decode() if isinstance(reduction, bytes) else reduction) != "add" or \
            attrs.get("axis", 0) % (axis + 1) != axis or target is None or target[-1] != 1:
        return None  # one target per row (assigned, not added); updates float32 as the data (and untyped)
    narrowing, name = [], scatter.output[0]
    while True:
        node = _sole_consumer(g, name)
        if node is None or not (_is(node, "Reshape") or _is(node, "Cast")):
            return None
        narrowing.append(node)
        if _is(node, "Cast"):
            break
        name = node.output[0]
    if _attrs(narrowing[-1]).get("to") != dtype:
        return None
    return scatter, [*nodes, scatter, *narrowing], weight, narrowing


def _one_per_row(g: _Graph, weight: str, scores: str, axis: int) -> bool:
    shape, full = g.shapes.get(weight), g.shapes.get(scores)
    if shape is None or full is None or len(shape) > len(full):
        return False
    offset = len(full) - len(shape)
    return axis < offset or shape[axis - offset] == 1


__all__ = ["half_precision_loss"]
