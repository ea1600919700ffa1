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


def frozen_batch_norms_as_arithmetic(model: onnx.ModelProto) -> int:
    """Write each inference-mode BatchNormalization of a forward graph about to be differentiated as its
    arithmetic, in place, and return how many.

    Such a node is a BatchNorm the user put in eval mode in a model that trains (a frozen BatchNorm): it
    normalises with the running statistics and never updates them. ONNX Runtime's gradient builder
    differentiates every BatchNormalization as training mode's, whatever its ``training_mode`` (it puts a
    training-mode ``BatchNormInternal`` in its place: batch statistics, running ones updated), so it is
    written out, ``y = x · s + (bias − mean · s)`` with ``s = scale / √(var + ε)`` a channel, which the builder
    differentiates as written: the weight and bias get their gradients, the statistics none.
    """
    graph = model.graph
    inferred = onnx.shape_inference.infer_shapes(model)
    values = [*inferred.graph.value_info, *inferred.graph.input]
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}
    types = {v.name: v.type.tensor_type.elem_type for v in values}
    types.update({t.name: t.data_type for t in graph.initializer})
    nodes, count = [], 0
    for index, node in enumerate(graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        frozen = node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") \
            and not attrs.get("training_mode", 0) and len([o for o in node.output if o]) == 1
        rank = ranks.get(node.input[0]) if frozen else None
        if not frozen or rank is None or rank < 2:
            if frozen:
                logger.warning("BatchNormalization %s in eval mode: input rank unknown, so ONNX Runtime's "
                               "gradient builder trains it in training mode", node.name)
            nodes.append(node)
            continue
        x, scale, bias, mean, var = node.input[:5]
        prefix = f"{node.name or 'bn' + str(index)}_frozen"

        def op(op_type: str, inputs: list[str], name: str, output: str | None = None) -> str:
            out = output or f"{prefix}_{name}"
            nodes.append(helper.make_node(op_type, inputs, [out], name=f"{prefix}_{name}"))
            return out

        epsilon = f"{prefix}_epsilon"
        channel_shape = f"{prefix}_channel_shape"  # [C, 1, ...]: a channel's value against x's [N, C, ...]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(types.get(var, onnx.TensorProto.FLOAT))
        graph.initializer.extend([numpy_helper.from_array(np.array(attrs.get("epsilon", 1e-5), dtype), epsilon),
                                  numpy_helper.from_array(np.array([-1] + [1] * (rank - 2), np.int64), channel_shape)])
        factor = op("Div", [scale, op("Sqrt", [op("Add", [var, epsilon], "var_eps")], "std")], "factor")
        shift = op("Sub", [bias, op("Mul", [mean, factor], "mean_factor")], "shift")
        scaled = op("Mul", [x, op("Reshape", [factor, channel_shape], "factor_c")], "scaled")
        op("Add", [scaled, op("Reshape", [shift, channel_shape], "shift_c")], "y", output=node.output[0])
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(nodes)
    return count
