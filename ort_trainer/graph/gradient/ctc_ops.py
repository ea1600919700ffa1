"""The ONNX translations of CTC loss's operators (``export/ctc.py``): ``ort_trainer::ctc_loss`` as a ``CTCLoss``
node and ``ort_trainer::ctc_loss_grad`` as a ``CTCLossGrad`` node of the domain ``kernels.TORCH_OPS_DOMAIN``, which
run torch's CTC kernels inside ONNX Runtime (``kernels/csrc/torch_ops.cc``).

``CTCLoss(log_probs, targets, input_lengths, target_lengths) -> loss`` and ``CTCLossGrad(grad, log_probs, targets,
input_lengths, target_lengths) -> grad_log_probs``: log_probs ``[frames, batch, classes]`` float32 or float64, the
targets ``[batch, longest]`` or concatenated, the targets and lengths int64, loss ``[batch]``; attributes ``blank``
and ``zero_infinity`` (ints).
"""

from __future__ import annotations

from ...kernels import TORCH_OPS_DOMAIN as DOMAIN
from ..export import ctc
from . import onnx_schemas

_INTEGERS = [(name, "I") for name in ("targets", "input_lengths", "target_lengths")]
# each operator's ONNX inputs, outputs and attributes (ints); T: log_probs' dtype, I: int64
_SCHEMAS = {
    "CTCLoss": ([("log_probs", "T"), *_INTEGERS], [("loss", "T")], ("blank", "zero_infinity")),
    "CTCLossGrad": ([("grad", "T"), ("log_probs", "T"), *_INTEGERS], [("grad_log_probs", "T")],
                    ("blank", "zero_infinity")),
}
_TYPES = {"T": ["tensor(float)", "tensor(double)"], "I": ["tensor(int64)"]}


def _register_schemas() -> None:
    """ONNX schemas of the operators (what onnxscript reads to emit their nodes), once per process."""
    onnx_schemas.register(DOMAIN, 1, "ort_trainer's torch operators", _SCHEMAS, _TYPES)


def register_translations(registry) -> None:
    """Add the translations of ``ctc_loss_op`` and ``ctc_loss_grad_op`` to the exporter's registry (``joint_onnx``)."""
    import onnxscript

    _register_schemas()
    opset = onnxscript.values.Opset(DOMAIN, 1)

    def ctc_loss_onnx(log_probs, targets, input_lengths, target_lengths, blank: int = 0, zero_infinity: bool = False):
        return opset.CTCLoss(log_probs, targets, input_lengths, target_lengths, blank=blank,
                             zero_infinity=int(zero_infinity))

    def ctc_loss_grad_onnx(grad, log_probs, targets, input_lengths, target_lengths, blank: int = 0,
                           zero_infinity: bool = False):
        return opset.CTCLossGrad(grad, log_probs, targets, input_lengths, target_lengths, blank=blank,
                                 zero_infinity=int(zero_infinity))

    registry.register_op(ctc.FORWARD, ctc_loss_onnx)
    registry.register_op(ctc.BACKWARD, ctc_loss_grad_onnx)


__all__ = ["register_translations"]
