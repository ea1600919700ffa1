"""Names the graphs' inputs and outputs follow, shared by every stage that builds or binds them."""

from __future__ import annotations

# The gradient of weight ``w`` is the gradient graph's output ``w + GRAD_SUFFIX``.
GRAD_SUFFIX = "_grad"

# Extra inputs of the gradient graph (names no model input can take: they start with "__").
LOSS_SCALE_INPUT = "__loss_scale"
RESET_INPUT = "__lazy_reset_grad"

# Gradient accumulation inside the graph: each weight's accumulator input (its gradient buffer) and, where an
# operator adds into it in place (the onnxruntime source), that operator's flag output.
ACCUMULATOR_SUFFIX = "_grad.accumulation.buffer"
ACCUMULATED_FLAG_SUFFIX = "_grad.accumulation.out"

# A buffer the forward updates (BatchNorm's running statistics) is returned as ``buffer + UPDATED_SUFFIX``.
UPDATED_SUFFIX = ".updated"

# A node that reads a value only so that ONNX Runtime keeps its producer (a training Dropout whose mask nothing
# else reads) is named ``... + KEEPER_SUFFIX``: pruning keeps it although nothing reads its output.
KEEPER_SUFFIX = "/keep_dropout"

__all__ = ["ACCUMULATED_FLAG_SUFFIX", "ACCUMULATOR_SUFFIX", "GRAD_SUFFIX", "KEEPER_SUFFIX", "LOSS_SCALE_INPUT",
           "RESET_INPUT", "UPDATED_SUFFIX"]
