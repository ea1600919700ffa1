"""``fused_layer_norm``: a float32 LayerNorm and the half cast of its output, as one kernel node.

Under mixed precision autocast computes each LayerNorm in float32 and the products after it cast its output to the
half dtype: ``LayerNormalization`` writes a float32 ``[tokens, hidden]`` tensor that a ``Cast`` reads once to write
the half copy (in GPT-2, the input of every layer's attention and MLP; 24 a step of GPT-2 small, 25 MB each at
8 × 512 besides the LayerNorm's own). Each such ``LayerNormalization`` (float32 input, weight and bias, over the
last axis) whose output is read by that ``Cast`` alone, directly or through a ``Reshape``, is one
``LayerNormToFloat16`` / ``LayerNormToBFloat16`` node of ort_trainer's kernels (``ort_trainer/kernels``): the half
output written directly, and the mean and inverse standard deviation (float32, one a row, the backward's) as
ONNX's. Where other nodes read the float32 output too (a post-norm LayerNorm's, as BERT's: the residual stream reads
it in float32, the sublayer's products its half cast), the LayerNorm and one ``Cast`` of its output to the half dtype
are one ``LayerNormWithFloat16`` / ``LayerNormWithBFloat16`` node that writes both (the half one y's rounding, as the
``Cast`` computes it): the ``Cast``'s float32 read is gone. The kernel computes the statistics in its own order (the
CUDA kernel: float32 sums over a block, the CPU's float64), so the output may differ from ONNX Runtime's by a float32
rounding before the half one.

Where the LayerNorm's input is the residual stream's sum of a float32 tensor and a half one widened (an ``AddHalf``
of ``fused_gradient_sums``, or an ``Add`` of a ``Cast`` that the ``Add`` alone reads: GPT-2's every LayerNorm but
the first, BERT's after each sublayer), the node computes that sum too: ``AddLayerNormToFloat16(residual, x, gamma,
beta)`` / ``AddLayerNormWith*`` write it as one more output (under the sum's name: the next residual sum and the
backward read it), one rounded float32 add an element as before, so the sum's read back by the LayerNorm is gone
(12.6 MB at GPT-2 small's 8 × 512). The node goes where the sum's was (its weights and bias being the graph's).
"""

from __future__ import annotations

import onnx
from onnx import helper

from ...kernels import DOMAIN as _KERNELS_DOMAIN
from ...kernels import OPSET as _KERNELS_OPSET
from ._graph import _Graph, _attrs, _elem_types, _import_domain, _is, _keep, _sole_consumer, _widened

_FLOAT = onnx.TensorProto.FLOAT
_OPS = {onnx.TensorProto.FLOAT16: "LayerNormToFloat16", onnx.TensorProto.BFLOAT16: "LayerNormToBFloat16"}
_BOTH = {onnx.TensorProto.FLOAT16: "LayerNormWithFloat16", onnx.TensorProto.BFLOAT16: "LayerNormWithBFloat16"}
_HALF = {name: half for half, name in [*_OPS.items(), *_BOTH.items()]}  # each operator's half dtype


def fused_layer_norm(model: onnx.ModelProto) -> int:
    """Rewrite each eligible ``LayerNormalization`` (module docstring) in place; returns how many."""
    g = _Graph(model)
    types = _elem_types(model)
    dead: set[int] = set()
    before: dict[int, list[onnx.NodeProto]] = {}
    position = {id(node): i for i, node in enumerate(model.graph.node)}
    count = 0
    for node in model.graph.node:
        if not _is(node, "LayerNormalization") or len(node.input) < 3 or not node.input[2]:
            continue
        shape, attributes = g.shapes.get(node.input[0]), _attrs(node)
        if (any(types.get(name) != _FLOAT for name in node.input[:3]) or not shape
                or attributes.get("axis", -1) not in (-1, len(shape) - 1) or attributes.get("stash_type", 1) != 1
                or len(g.shapes.get(node.input[1]) or []) != 1):
            continue
        statistics = [name or f"{node.output[0]}/statistics{i}"
                      for i, name in enumerate((list(node.output) + ["", ""])[1:3], 1)]
        reader = _sole_consumer(g, node.output[0])
        view = reader if reader is not None and _is(reader, "Reshape") else None
        cast = _sole_consumer(g, view.output[0]) if view is not None else reader
        if cast is None or not _is(cast, "Cast") or _attrs(cast).get("to") not in _OPS:
            view, cast = None, _half_cast(g, node.output[0])  # read in float32 too: both outputs
            if cast is None:
                continue
            op, outputs = _BOTH[_attrs(cast)["to"]], [node.output[0], *statistics, cast.output[0]]
        else:
            half = f"{node.output[0]}/half" if view is not None else cast.output[0]
            op, outputs = _OPS[_attrs(cast)["to"]], [half, *statistics]
        inputs, at = list(node.input[:3]), node
        summed = _residual_sum(g, types, node, _HALF[op], position)
        if summed is not None and id(summed[0]) not in dead:  # (where the sum was, in its place)
            at, residual, half_x, gone = summed
            op, inputs, outputs = f"Add{op}", [residual, half_x, *node.input[1:3]], [*outputs, node.input[0]]
            dead |= {id(n) for n in gone}
        before[id(at)] = [helper.make_node(op, inputs, outputs, name=f"{node.name or node.output[0]}/half",
                                           domain=_KERNELS_DOMAIN, epsilon=float(attributes.get("epsilon", 1e-5)))]
        if view is not None:  # (where the view was: its shape may be made after the LayerNorm)
            before[id(view)] = [helper.make_node("Reshape", [half, view.input[1]], [cast.output[0]],
                                                 name=f"{view.name or view.output[0]}/half")]
            model.graph.value_info.append(helper.make_tensor_value_info(half, _attrs(cast)["to"], shape))
        dead |= {id(node), id(cast), *([id(view)] if view is not None else [])}
        count += 1
    if before:
        _keep(model, dead, before=before)
        _import_domain(model, _KERNELS_DOMAIN, _KERNELS_OPSET)
    return count


def _residual_sum(g: _Graph, types: dict, node: onnx.NodeProto, half: int,
                  position: dict[int, int]) -> tuple[onnx.NodeProto, str, str, list[onnx.NodeProto]] | None:
    """Where the LayerNorm ``node``'s input is a float32 tensor plus a ``half`` one widened, of one shape (an
    ``AddHalf`` of two, or an ``Add`` of a ``Cast`` it alone reads), and the LayerNorm's weight and bias are made
    before it: (the sum's node, the float32 tensor, the half one, the nodes the sum takes: the sum's, its cast);
    else None."""
    total = node.input[0]
    add, shape = g.producer.get(total), g.shapes.get(total)
    if add is None or any(p is not None and position[id(p)] > position[id(add)]
                          for p in (g.producer.get(name) for name in node.input[1:3])):
        return None
    if add.domain == _KERNELS_DOMAIN and add.op_type == "AddHalf" and len(add.input) == 2 and not add.attribute:
        pairs = [(add.input[0], add.input[1], [add])]
    elif _is(add, "Add"):
        casts = [(_widened(g, add.input[i], add), add.input[1 - i]) for i in (0, 1)]
        pairs = [(other, cast.input[0], [add, cast]) for cast, other in casts if cast is not None]
    else:
        return None
    for residual, x, gone in pairs:
        if (types.get(residual) == _FLOAT and types.get(x) == half and shape
                and g.shapes.get(residual) == shape and g.shapes.get(x) == shape):
            return add, residual, x, gone
    return None


def _half_cast(g: _Graph, name: str) -> onnx.NodeProto | None:
    """The first ``Cast`` to a half dtype among ``name``'s readers (others read it too), or None."""
    for reader in g.consumers.get(name, []):
        if _is(reader, "Cast") and _attrs(reader).get("to") in _BOTH:
            return reader
    return None


__all__ = ["fused_layer_norm"]
