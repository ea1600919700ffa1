"""The ONNX translations of the matrix operators (``export/linalg.py``): ``ort_trainer::inverse`` as ONNX Runtime's
``com.microsoft`` ``Inverse`` (float32, float64, float16, batched; CPU and CUDA), ``ort_trainer::det`` as the
standard ``Det`` and ``ort_trainer::logabsdet`` as the logarithm of its absolute value."""

from __future__ import annotations

from ..export import linalg
from . import onnx_schemas

MICROSOFT = "com.microsoft"
# ONNX Runtime's contrib operator, declared for onnxscript (onnx has no schema of it)
_SCHEMAS = {"Inverse": ([("X", "T")], [("Y", "T")], ())}
_TYPES = {"T": ["tensor(float)", "tensor(double)", "tensor(float16)"]}


def register_translations(registry) -> None:
    """Add the translations of ``inverse``, ``det`` and ``logabsdet`` to the exporter's registry (``joint_onnx``)."""
    import onnxscript
    from onnxscript import opset18

    onnx_schemas.register(MICROSOFT, 1, "ONNX Runtime's contrib operators", _SCHEMAS, _TYPES)
    microsoft = onnxscript.values.Opset(MICROSOFT, 1)

    def inverse_onnx(a):
        return microsoft.Inverse(a)

    def det_onnx(a):
        return opset18.Det(a)

    def logabsdet_onnx(a):
        return opset18.Log(opset18.Abs(opset18.Det(a)))

    registry.register_op(linalg.INVERSE, inverse_onnx)
    registry.register_op(linalg.DET, det_onnx)
    registry.register_op(linalg.LOGABSDET, logabsdet_onnx)


__all__ = ["register_translations"]
