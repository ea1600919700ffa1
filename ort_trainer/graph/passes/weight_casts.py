"""``weight_casts``: a step's half-precision copies of its float32 weights as one kernel node.

Under mixed precision each weight a product reads is cast to the half dtype once a step (torch's autocast:
``_to_copy``), one ``Cast`` node a weight: GPT-2 small has 97, BERT-base 148, each a kernel launch and a node for
ONNX Runtime's executor to run, most of them on tensors of a few thousand values. Here every ``Cast`` to float16 (or
to bfloat16) of a float32 graph input is one ``CastsToFloat16`` (``CastsToBFloat16``) node of ort_trainer's kernels
(``ort_trainer/kernels``), whose CUDA kernel rounds them all in one launch (up to 64 tensors a launch), as ``Cast``
rounds (to nearest even): the same values bit for bit.

Where a copy is read only by ``aligned_products``' pad of its rows (a ``Concat`` on axis 0 with a constant of zeros:
GPT-2's head, 50257 rows padded to 50304), the node writes the padded tensor itself (its attribute ``output_rows``),
so the weight is not written once and then copied: GPT-2 small's head moves 232 + 155 MB a step as a ``Cast`` and a
``Concat``, 232 MB here.

The node takes the place of the first ``Cast`` it replaces (its inputs are the graph's, so every reader of its
outputs comes later). Every copy is then made at the step's start rather than before its first reader: no peak
grows by it, as each copy is held until the backward's product reads it again.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ...kernels import DOMAIN as _KERNELS_DOMAIN
from ...kernels import OPSET as _KERNELS_OPSET
from ._graph import _Graph, _attrs, _elem_types, _import_domain, _is, _keep

_OPS = {onnx.TensorProto.FLOAT16: "CastsToFloat16", onnx.TensorProto.BFLOAT16: "CastsToBFloat16"}
_HALF = tuple(_OPS)


def weight_casts(model: onnx.ModelProto) -> int:
    """Rewrite the ``Cast`` nodes of float32 graph inputs to each half dtype as one ``CastsTo*`` node (module
    docstring) in place; returns how many ``Cast`` nodes it replaced."""
    g = _Graph(model)
    types = _elem_types(model)
    inputs = {i.name for i in model.graph.input}
    casts: dict[int, list[onnx.NodeProto]] = {dtype: [] for dtype in _HALF}
    for node in model.graph.node:
        if (_is(node, "Cast") and node.input[0] in inputs and types.get(node.input[0]) == onnx.TensorProto.FLOAT
                and _attrs(node).get("to") in _HALF):
            casts[_attrs(node)["to"]].append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[int] = set()
    for dtype, nodes in casts.items():
        if not nodes:
            continue
        outputs, rows = [], []
        for cast in nodes:
            pad, padded_rows = _zero_row_pad(g, cast, dtype)
            outputs.append(pad.output[0] if pad is not None else cast.output[0])
            rows.append(padded_rows)
            if pad is not None:
                dropped.add(id(pad))
            replaced[id(cast)] = []
        attributes = {}
        if any(rows):  # (0: a copy of x's own rows)
            attributes["output_rows"] = rows
        xs = [cast.input[0] for cast in nodes]
        replaced[id(nodes[0])] = [helper.make_node(_OPS[dtype], xs, outputs, domain=_KERNELS_DOMAIN,
                                                   name=f"weight_casts/{_OPS[dtype]}", **attributes)]
        _outputs_value_info(model, g, xs, outputs, rows, dtype)
    if not replaced:
        return 0
    _keep(model, set(replaced) | dropped, before=replaced)
    _import_domain(model, _KERNELS_DOMAIN, _KERNELS_OPSET)
    return len(replaced)


def _outputs_value_info(model: onnx.ModelProto, g: _Graph, inputs: list[str], outputs: list[str], rows: list[int],
                        dtype: int) -> None:
    """Each of ``outputs`` (the copies of ``inputs`` in ``dtype``, ``rows`` their first dims, 0: the input's) without
    a value info gets one (ONNX's shape inference does not know the kernels' operators: the readers' shapes follow
    from it)."""
    known = {info.name for info in model.graph.value_info}
    for x, y, first in zip(inputs, outputs, rows):
        shape = g.shapes.get(x)
        if y in known or y in g.outputs or shape is None or (first and not shape):
            continue
        shape = list(shape)
        if first:
            shape[0] = first
        model.graph.value_info.append(helper.make_tensor_value_info(y, dtype, shape))


def _zero_row_pad(g: _Graph, cast: onnx.NodeProto, dtype: int) -> tuple[onnx.NodeProto | None, int]:
    """The ``Concat`` that alone reads ``cast``'s output and appends rows of zeros to it (a constant of its other
    dims, +0 as the kernel writes), and the rows it gives, where there is one (``aligned_products``' pad of a
    product's weight) and the weight's shape is static; else ``(None, 0)``."""
    name, none = cast.output[0], (None, 0)
    readers = g.consumers.get(name, [])
    if len(readers) != 1 or not g.only_used_by(name, readers[0]):
        return none
    concat = readers[0]
    if not _is(concat, "Concat") or _attrs(concat).get("axis") != 0 or list(concat.input[:1]) != [name]:
        return none
    zeros = g.const(concat.input[1]) if len(concat.input) == 2 else None
    shape = g.shapes.get(cast.input[0])
    if (zeros is None or zeros.dtype != helper.tensor_dtype_to_np_dtype(dtype) or np.any(zeros != 0)
            or np.any(np.signbit(zeros)) or not shape or not all(isinstance(size, int) for size in shape)
            or list(zeros.shape[1:]) != shape[1:]):
        return none
    return concat, shape[0] + zeros.shape[0]


__all__ = ["weight_casts"]
