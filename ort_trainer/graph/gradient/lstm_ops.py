"""The ONNX translations of the fused LSTM layer's operators (``export/fused_lstm.py``): ``ort_trainer::lstm_layer``
as an ``LSTMLayer`` node and ``ort_trainer::lstm_layer_grad`` as an ``LSTMLayerGrad`` node of the domain
``kernels.TORCH_OPS_DOMAIN``, which run oneDNN's LSTM kernels as torch does on the CPU
(``kernels/csrc/torch_rnn.h``).

``LSTMLayer(x, w_ih, w_hh, b_ih, b_hh, h0, c0) -> (y, hy, cy, workspace)`` and ``LSTMLayerGrad(x, w_ih, w_hh, b_ih,
b_hh, h0, c0, y, hy, cy, workspace, dy, dhy, dcy) -> (dx, dw_ih, dw_hh, db_ih, db_hh, dh0, dc0)``: float32, the
workspace's key int64 ``[1]`` (the library keeps the workspace itself); attributes ``reverse`` and ``train`` (ints).
"""

from __future__ import annotations

from ...kernels import TORCH_OPS_DOMAIN as DOMAIN
from ..export import fused_lstm
from . import onnx_schemas

_WEIGHTS = [(name, "T") for name in ("x", "w_ih", "w_hh", "b_ih", "b_hh", "h0", "c0")]
_OUTPUTS = [("y", "T"), ("hy", "T"), ("cy", "T"), ("workspace", "K")]
# each operator's ONNX inputs, outputs and attributes (ints); T: float32, K: the workspace's key, int64 [1]
_SCHEMAS = {
    "LSTMLayer": (_WEIGHTS, _OUTPUTS, ("reverse", "train")),
    "LSTMLayerGrad": ([*_WEIGHTS, *_OUTPUTS, ("dy", "T"), ("dhy", "T"), ("dcy", "T")],
                      [(f"d{name}", "T") for name, _ in _WEIGHTS], ("reverse",)),
}
_TYPES = {"T": ["tensor(float)"], "K": ["tensor(int64)"]}


def register_translations(registry) -> None:
    """Add the translations of ``lstm_layer_op`` and ``lstm_layer_grad_op`` to the exporter's registry
    (``joint_onnx``)."""
    import onnxscript

    onnx_schemas.register(DOMAIN, 1, "ort_trainer's torch operators", _SCHEMAS, _TYPES)
    opset = onnxscript.values.Opset(DOMAIN, 1)

    def lstm_layer_onnx(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse: bool = False, train: bool = False):
        return opset.LSTMLayer(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse=int(reverse), train=int(train))

    def lstm_layer_grad_onnx(x, w_ih, w_hh, b_ih, b_hh, h0, c0, y, hy, cy, workspace, dy, dhy, dcy,
                             reverse: bool = False):
        return opset.LSTMLayerGrad(x, w_ih, w_hh, b_ih, b_hh, h0, c0, y, hy, cy, workspace, dy, dhy, dcy,
                                   reverse=int(reverse))

    registry.register_op(fused_lstm.FORWARD, lstm_layer_onnx)
    registry.register_op(fused_lstm.BACKWARD, lstm_layer_grad_onnx)


__all__ = ["register_translations"]
