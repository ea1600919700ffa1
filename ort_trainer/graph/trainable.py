"""Stage 2: make an exported forward graph trainable by ONNX Runtime's gradient builder.

The gradient builders read optional outputs that exporters leave out: LayerNormalization's
mean and inverse std-dev, Dropout's mask, SoftmaxCrossEntropyLoss's log-probabilities, and
BatchNormalization's running statistics in training mode. Without them the builder aborts with
``GradientBuilderBase::O(...) i < node_->OutputDefs().size()``. This pass names those outputs.
"""

from __future__ import annotations

import onnx

# op_type -> number of outputs the gradient builder needs (including optional ones)
_REQUIRED_OUTPUTS = {
    "LayerNormalization": 3,
    "SimplifiedLayerNormalization": 2,
    "Dropout": 2,
    "SoftmaxCrossEntropyLoss": 2,
}


def make_trainable(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the optional node outputs the gradient builder needs, in place; returns ``model``."""
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
    return model


def _unique(base: str, used: set[str]) -> str:
    name, suffix = base, 0
    while name in used:
        suffix += 1
        name = f"{base}_{suffix}"
    used.add(name)
    return name
