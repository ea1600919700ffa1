"""Dropout, BatchNormalization and SoftmaxCrossEntropyLoss as training runs them, for onnx2fx.

onnx2fx's own handlers are inference ones (Dropout is the identity, BatchNormalization has no
running-statistics outputs, SoftmaxCrossEntropyLoss no ``log_prob``). These are registered with
``onnx2fx.register_op`` on ``TRAINING_DOMAIN``, where ``onnx_to_torch`` dispatches these operators,
so onnx2fx's handlers stay as they are for everyone else. They run with ``onnx_to_torch``'s
builder (``Builder``), which also gives ``static``, ``training`` and ``is_buffer``. The names the
conversion shares (``TRAINING_DOMAIN``, ``UnsupportedOnnxOperatorError``) live here, below it.
"""

from __future__ import annotations

from typing import Any

import onnx
import torch

from .onnx_sizes import attribute

CONVERTER = "onnx2fx"
_INSTALL_HINT = 'pip install "ort_trainer[training]"'
TRAINING_DOMAIN = "ai.ort_trainer.training"  # where the handlers below are registered


class UnsupportedOnnxOperatorError(ValueError):
    """The ONNX model uses operators the ONNX-to-torch conversion does not cover.

    Attributes:
        operators: ``{(domain, op_type): [node names]}`` of every such operator.
    """

    def __init__(self, operators: dict[tuple[str, str], list[str]]):
        self.operators = operators
        listed = "; ".join(f"{op if not domain else domain + '::' + op} (node{'s' if len(nodes) > 1 else ''} "
                           f"{', '.join(repr(n) for n in nodes[:5])}{', ...' if len(nodes) > 5 else ''})"
                           for (domain, op), nodes in operators.items())
        super().__init__(
            f"the ONNX model uses operator(s) that {CONVERTER} and ort_trainer cannot turn into PyTorch for "
            f"training on the current ONNX Runtime: {listed}. ONNX Runtime's own gradient builder trains ONNX "
            f"models with them: install the training runtime instead ({_INSTALL_HINT}), or export the model "
            "again from PyTorch and train the torch module")


def _number(builder: Any, node: onnx.NodeProto, index: int, default: Any) -> Any:
    if len(node.input) <= index or not node.input[index]:
        return default
    static = builder.static(node.input[index])
    if static is None or static.symbolic:
        raise UnsupportedOnnxOperatorError(
            {("", node.op_type): [f"{node.name} (input {index} is computed, not a constant)"]})
    return static.array.reshape(-1)[0].item()


def _dropout_handler(builder: Any, node: onnx.NodeProto) -> Any:
    """ONNX Dropout: with ``training_mode`` true (and the module training), zero elements with
    probability ``ratio`` and scale the rest by ``1 / (1 - ratio)``; the optional mask output."""
    data = builder.get_value(node.input[0])
    opset = builder.get_opset_version(TRAINING_DOMAIN)
    if opset < 12:  # no training_mode input before opset 12: inference, as ONNX Runtime runs it
        ratio, training = attribute(node, "ratio", 0.5), False
    else:
        ratio, training = _number(builder, node, 1, 0.5), bool(_number(builder, node, 2, False))
    with_mask = len(node.output) > 1 and bool(node.output[1])
    if training and builder.training and ratio > 0:
        output, mask = torch.ops.aten.native_dropout(data, float(ratio), True)
    else:
        output, mask = data, (torch.ones_like(data, dtype=torch.bool) if with_mask else None)
    return (output, mask) if with_mask else output


def _batch_norm_handler(builder: Any, node: onnx.NodeProto) -> Any:
    """ONNX BatchNormalization; in training mode (``training_mode=1``, or extra outputs before opset
    14) normalise with the batch statistics and update the running ones, ONNX's way:
    ``running = running * momentum + batch * (1 - momentum)`` with the biased batch variance."""
    x, scale, bias, mean, var = (builder.get_value(n) for n in node.input[:5])
    epsilon, momentum = attribute(node, "epsilon", 1e-5), attribute(node, "momentum", 0.9)
    outputs = [n for n in node.output if n]
    opset = builder.get_opset_version(TRAINING_DOMAIN)
    training = bool(attribute(node, "training_mode", 0)) if opset >= 14 else len(outputs) > 1
    if len(node.output) > 3:
        raise UnsupportedOnnxOperatorError(
            {("", "BatchNormalization"): [f"{node.name} (saved mean/variance outputs of opset {opset})"]})
    if not (training and builder.training):
        y = torch.nn.functional.batch_norm(x, mean, var, scale, bias, training=False, eps=epsilon)
        return (y, mean, var)[:len(node.output)] if len(node.output) > 1 else y
    y = torch.nn.functional.batch_norm(x, None, None, scale, bias, training=True, eps=epsilon)
    dims = [d for d in range(x.dim()) if d != 1]
    with torch.no_grad():
        batch_mean = x.mean(dims)
        batch_var = x.var(dims, correction=0)
        new_mean = mean * momentum + batch_mean * (1 - momentum)
        new_var = var * momentum + batch_var * (1 - momentum)
        for name, buffer, value in ((node.input[3], mean, new_mean), (node.input[4], var, new_var)):
            if builder.is_buffer(name):
                buffer.copy_(value)
    return (y, new_mean, new_var)[:len(node.output)] if len(node.output) > 1 else y


def _softmax_cross_entropy_handler(builder: Any, node: onnx.NodeProto) -> Any:
    """ONNX SoftmaxCrossEntropyLoss with its optional ``log_prob`` output (scores ``[N, C, ...]``)."""
    scores, labels = builder.get_value(node.input[0]), builder.get_value(node.input[1])
    weights = builder.get_value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    ignore_index = attribute(node, "ignore_index")
    reduction = attribute(node, "reduction", "mean")
    log_prob = torch.log_softmax(scores, dim=1)
    loss = torch.nn.functional.nll_loss(log_prob, labels.long(), weight=weights, reduction=reduction,
                                        ignore_index=-100 if ignore_index is None else ignore_index)
    return (loss, log_prob) if len(node.output) > 1 and node.output[1] else loss


_registered = False


def register() -> None:
    """Register the handlers with onnx2fx (once)."""
    global _registered
    if _registered:
        return
    import onnx2fx

    for op, handler in (("Dropout", _dropout_handler), ("BatchNormalization", _batch_norm_handler),
                        ("SoftmaxCrossEntropyLoss", _softmax_cross_entropy_handler)):
        onnx2fx.register_op(op, handler, domain=TRAINING_DOMAIN)
    _registered = True


__all__ = ["CONVERTER", "TRAINING_DOMAIN", "UnsupportedOnnxOperatorError", "register"]
