"""LSTM layers in ONNX's own ``LSTM`` operator: what ``save_as_onnx`` writes for an ``LSTMLayer`` node of
ort_trainer's torch operators (``graph/export/fused_lstm.py``, ``csrc/torch_rnn.h``), so that a stock
``InferenceSession`` runs the model.

``LSTMLayer(x, w_ih, w_hh, b_ih, b_hh, h0, c0)`` holds PyTorch's weights, whose gates are stacked ``i, f, g, o``;
ONNX's ``LSTM`` stacks them ``i, o, f, c`` (``c`` is PyTorch's ``g``) and takes ``W [1, 4H, features]``, ``R [1,
4H, H]``, ``B [1, 8H]`` (the input's biases, then the recurrent ones) and the states ``[1, batch, H]``; its output
``Y`` is ``[steps, 1, batch, H]``. The gates are reordered by a ``Split`` into four and a ``Concat`` (constant
folding turns them into reordered weights where the weights are initializers), ``direction`` is ``"reverse"`` where
the node's ``reverse`` is set. The arithmetic is the same (``sigmoid``, ``tanh``, ``c' = f c + i g``, ``h' = o
tanh(c')``); the kernels differ, so the values agree to float32 roundoff.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import TORCH_OPS_DOMAIN


def _lstm_nodes(node: onnx.NodeProto, hidden: int, opset: int) -> list[onnx.NodeProto]:
    prefix = f"{node.name or node.output[0]}_standard_"
    nodes: list[onnx.NodeProto] = []

    def add(op: str, inputs: list[str], name: str, outputs: int = 1, **attrs) -> list[str]:
        names = [f"{prefix}{name}{i}" for i in range(outputs)] if outputs > 1 else [prefix + name]
        nodes.append(helper.make_node(op, inputs, names, name=prefix + name, **attrs))
        return names

    def constant(name: str, values: list[int]) -> str:
        return add("Constant", [], name, value=numpy_helper.from_array(np.array(values, dtype=np.int64)))[0]

    axis0 = constant("axis0", [0])

    def gates_reordered(value: str, name: str) -> str:
        """PyTorch's ``i, f, g, o`` rows of ``value`` as ONNX's ``i, o, f, c``."""
        split = {"num_outputs": 4} if opset >= 18 else {}
        i, f, g, o = add("Split", [value], f"{name}_gates", outputs=4, axis=0, **split)
        return add("Concat", [i, o, f, g], f"{name}_iofc", axis=0)[0]

    x, w_ih, w_hh, b_ih, b_hh, h0, c0 = node.input
    weight = add("Unsqueeze", [gates_reordered(w_ih, "w"), axis0], "W")[0]
    recurrent = add("Unsqueeze", [gates_reordered(w_hh, "r"), axis0], "R")[0]
    biases = add("Concat", [gates_reordered(b_ih, "wb"), gates_reordered(b_hh, "rb")], "b", axis=0)[0]
    bias = add("Unsqueeze", [biases, axis0], "B")[0]
    initial_h = add("Unsqueeze", [h0, axis0], "initial_h")[0]
    initial_c = add("Unsqueeze", [c0, axis0], "initial_c")[0]
    reverse = any(a.name == "reverse" and a.i for a in node.attribute)
    y, y_h, y_c = add("LSTM", [x, weight, recurrent, bias, "", initial_h, initial_c], "lstm", outputs=3,
                      hidden_size=hidden, direction="reverse" if reverse else "forward")
    axis1 = constant("axis1", [1])
    out, hy, cy, key = node.output
    nodes.append(helper.make_node("Squeeze", [y, axis1], [out], name=prefix + "y"))
    nodes.append(helper.make_node("Squeeze", [y_h, axis0], [hy], name=prefix + "hy"))
    nodes.append(helper.make_node("Squeeze", [y_c, axis0], [cy], name=prefix + "cy"))
    if key:
        nodes.append(helper.make_node("Constant", [], [key], name=prefix + "key",
                                      value=numpy_helper.from_array(np.zeros(1, dtype=np.int64))))
    return nodes


def standard_lstm(nodes: list[onnx.NodeProto], shapes: dict[str, list], opset: int) -> list[onnx.NodeProto]:
    """``nodes`` with each ``LSTMLayer`` of ort_trainer's torch operators as ONNX's ``LSTM``; ``shapes``: the values'
    dims by name (the hidden size is read from ``w_hh``'s, else from ``hy``'s), ``opset``: the model's.

    Raises:
        ValueError: a layer's hidden size is not known from the graph (neither shape is static).
    """
    out = []
    for node in nodes:
        if node.domain != TORCH_OPS_DOMAIN or node.op_type != "LSTMLayer":
            out.append(node)
            continue
        known = [dims[-1] for dims in (shapes.get(node.input[2]), shapes.get(node.output[1]))
                 if dims and isinstance(dims[-1], int) and dims[-1] > 0]
        if not known:
            raise ValueError(f"the LSTM layer {node.name} has no static hidden size in the graph, which ONNX's LSTM "
                             "operator needs")
        out.extend(_lstm_nodes(node, known[0], opset))
    return out


__all__ = ["standard_lstm"]
