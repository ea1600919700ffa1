"""Stage 2: make an exported forward graph trainable by ONNX Runtime's gradient builder.

1. The gradient builders read optional outputs that exporters leave out: LayerNormalization's
   mean and inverse std-dev, Dropout's mask, SoftmaxCrossEntropyLoss's log-probabilities.
   Without them the builder aborts with ``GradientBuilderBase::O(...) i < node_->OutputDefs().size()``.
   This pass names those outputs.
2. ONNX Runtime 1.19's CPU ``AveragePoolGrad`` reads its output shape from the graph's static
   shape inference: with a symbolic dimension (a dynamic batch) it divides by zero and kills the
   process (SIGFPE). An unpadded (or ``count_include_pad``) AveragePool is rewritten as the
   equivalent depthwise Conv with a constant ``1 / kernel_size`` kernel, whose gradient works
   with symbolic shapes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..._logging import logger

# op_type -> number of outputs the gradient builder needs (including optional ones)
_REQUIRED_OUTPUTS = {
    "LayerNormalization": 3,
    "SimplifiedLayerNormalization": 2,
    "Dropout": 2,
    "SoftmaxCrossEntropyLoss": 2,
}


def make_trainable(model: onnx.ModelProto) -> onnx.ModelProto:
    """Make ``model`` trainable in place (see the module docstring); returns ``model``."""
    _add_optional_outputs(model)
    _average_pool_as_conv(model)
    return model


def _add_optional_outputs(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.output}
    for index, node in enumerate(model.graph.node):
        needed = _REQUIRED_OUTPUTS.get(node.op_type)
        if needed is None:
            continue
        for position in range(needed):
            if position < len(node.output) and node.output[position]:
                continue
            name = _unique(f"{node.name or node.op_type + str(index)}_out{position}", used)
            if position < len(node.output):
                node.output[position] = name
            else:
                node.output.append(name)


def _average_pool_as_conv(model: onnx.ModelProto) -> None:
    pools = [n for n in model.graph.node if n.op_type == "AveragePool"]
    if not pools:
        return
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: v.type.tensor_type.shape for v in [*inferred.graph.value_info, *inferred.graph.input]}
    for node in pools:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        kernel = list(attrs["kernel_shape"])
        pads = list(attrs.get("pads", [0] * 2 * len(kernel)))
        shape = shapes.get(node.input[0])
        channels = shape.dim[1] if shape is not None and len(shape.dim) == len(kernel) + 2 else None
        equivalent = (
            attrs.get("ceil_mode", 0) == 0
            and attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
            and (not any(pads) or attrs.get("count_include_pad", 0) == 1)
            and channels is not None and channels.HasField("dim_value")
        )
        if not equivalent:
            logger.warning("AveragePool %s is kept as is: its ONNX Runtime gradient needs static input shapes",
                           node.name)
            continue
        c = channels.dim_value
        weight_name = f"{node.name or node.output[0]}_average_kernel"
        weight = np.full([c, 1, *kernel], 1.0 / float(np.prod(kernel)), dtype=np.float32)
        model.graph.initializer.append(numpy_helper.from_array(weight, weight_name))
        conv_attrs = {"group": c, "kernel_shape": kernel, "pads": pads,
                      "strides": list(attrs.get("strides", [1] * len(kernel)))}
        del node.attribute[:]
        node.attribute.extend(helper.make_attribute(k, v) for k, v in conv_attrs.items())
        node.op_type = "Conv"
        node.input.append(weight_name)


def _unique(base: str, used: set[str]) -> str:
    name, suffix = base, 0
    while name in used:
        suffix += 1
        name = f"{base}_{suffix}"
    used.add(name)
    return name
