"""Buffers the forward pass updates: BatchNorm running statistics, exactly as PyTorch does.

In training mode ONNX ``BatchNormalization`` returns updated running statistics, but ONNX Runtime
updates the running variance with the *biased* batch variance, while PyTorch uses the unbiased
one (``n / (n - 1)`` times larger, ``n`` = elements per channel). This pass exposes the running
statistics as graph outputs ``<buffer>.updated``, correcting the variance:

    torch_var = ort_var + (1 - momentum) · biased_var / (n - 1)

with ``biased_var`` recomputed from the layer's input. (It cannot be recovered from the old
running variance: ONNX Runtime may update that input buffer in place, so reading it after the
BatchNorm node is not reliable.) The engine binds each ``.updated`` output to the buffer itself,
so the statistics are updated in place every step.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..._logging import logger
from ..names import UPDATED_SUFFIX


def expose_running_statistics(model: onnx.ModelProto, buffers: set[str]) -> dict[str, str]:
    """Add ``<buffer>.updated`` outputs for every training-mode BatchNormalization, in place.

    Args:
        model: forward graph whose weights and buffers are graph inputs.
        buffers: names of the inputs that are module buffers (running statistics).

    Returns:
        ``{buffer name: output name}`` of the statistics the graph now returns.
    """
    updates: dict[str, str] = {}
    graph = model.graph
    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*inferred.graph.value_info, *inferred.graph.input]
             if v.type.tensor_type.HasField("shape")}
    for index, node in enumerate(list(graph.node)):
        if node.op_type != "BatchNormalization":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if not attrs.get("training_mode", 0) or len(node.output) < 3:
            continue
        mean_in, var_in = node.input[3], node.input[4]
        if mean_in not in buffers or var_in not in buffers:
            continue
        momentum = float(attrs.get("momentum", 0.9))
        rank = ranks.get(node.input[0])
        if rank is None or rank < 2:
            logger.warning("BatchNormalization %s: input rank unknown, its running statistics are not updated",
                           node.name)
            continue
        axes = [0, *range(2, rank)]
        prefix = f"{node.name or 'bn' + str(index)}_running_stats"

        def const(name: str, value, dtype=np.float32) -> str:
            full = f"{prefix}_{name}"
            graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=dtype), full))
            return full

        def op(op_type: str, inputs: list[str], name: str, **kwargs) -> str:
            out = f"{prefix}_{name}"
            graph.node.append(helper.make_node(op_type, inputs, [out], name=out, **kwargs))
            return out

        # n = elements per channel = numel(X) / C, as float
        shape = op("Shape", [node.input[0]], "shape")
        numel = op("ReduceProd", [shape], "numel", keepdims=0)
        channels = op("Gather", [shape, const("one_index", 1, np.int64)], "channels")
        per_channel = op("Cast", [op("Div", [numel, channels], "per_channel_int")], "per_channel",
                         to=onnx.TensorProto.FLOAT)
        denominator = op("Sub", [per_channel, const("one", 1.0)], "n_minus_1")
        centered = op("Sub", [node.input[0], op("ReduceMean", [node.input[0]], "mean", axes=axes)], "centered")
        biased_var = op("ReduceMean", [op("Mul", [centered, centered], "squares")], "biased_var", axes=axes,
                        keepdims=0)
        biased_part = op("Mul", [biased_var, const("one_minus_momentum", 1.0 - momentum)], "biased_part")
        mean_out, var_out = mean_in + UPDATED_SUFFIX, var_in + UPDATED_SUFFIX
        graph.node.append(helper.make_node("Identity", [node.output[1]], [mean_out], name=f"{prefix}_mean_out"))
        graph.node.append(helper.make_node(
            "Add", [node.output[2], op("Div", [biased_part, denominator], "correction")], [var_out],
            name=f"{prefix}_var_out"))
        for name in (mean_out, var_out):
            graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
        updates[mean_in], updates[var_in] = mean_out, var_out
    return updates
