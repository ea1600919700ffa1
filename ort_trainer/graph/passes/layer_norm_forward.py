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
"""

from __future__ import annotations

import onnx
from onnx import helper

from ...kernels import DOMAIN as _KERNELS_DOMAIN
from ...kernels import OPSET as _KERNELS_OPSET
from ._graph import _Graph, _attrs, _elem_types, _import_domain, _is, _keep, _sole_consumer

_FLOAT = onnx.TensorProto.FLOAT
_OPS = {onnx.TensorProto.FLOAT16: "LayerNormToFloat16", onnx.TensorProto.BFLOAT16: "LayerNormToBFloat16"}
_BOTH = {onnx.TensorProto.FLOAT16: "LayerNormWithFloat16", onnx.TensorProto.BFLOAT16: "LayerNormWithBFloat16"}


def fused_layer_norm(model: onnx.ModelProto) -> int:
    """Rewrite each eligible ``LayerNormalization`` (module docstring) in place; returns how many."""
    g = _Graph(model)
    types = _elem_types(model)
    dead: set[int] = set()
    before: dict[int, list[onnx.NodeProto]] = {}
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
        before[id(node)] = [helper.make_node(op, list(node.input[:3]), outputs,
                                             name=f"{node.name or node.output[0]}/half", domain=_KERNELS_DOMAIN,
                                             epsilon=float(attributes.get("epsilon", 1e-5)))]
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


def _half_cast(g: _Graph, name: str) -> onnx.NodeProto | None:
    """The first ``Cast`` to a half dtype among ``name``'s readers (others read it too), or None."""
    for reader in g.consumers.get(name, []):
        if _is(reader, "Cast") and _attrs(reader).get("to") in _BOTH:
            return reader
    return None


__all__ = ["fused_layer_norm"]
