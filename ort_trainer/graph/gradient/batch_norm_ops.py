"""A training-mode batch norm and its backward as torch's kernels inside ONNX Runtime
(``graph_optimizations.torch_batch_norm``): on the CPU, the kernels eager PyTorch trains an ``nn.BatchNorm`` with.

The exporter translates a training-mode batch norm in inference mode, so the joint trace decomposes it
(``joint_onnx``) into the batch statistics' arithmetic (about 10 element-wise nodes and reductions, three passes
of them over the input computing its mean), and autograd's ``native_batch_norm_backward`` into more: about 25 per
batch norm, 3x the time of torch's kernel. Where every batch norm of the program is one the kernels take
(``applies``: ``aten.batch_norm`` in training, with weight, bias, running statistics and a momentum, of a float32
input on the CPU), the joint trace leaves both undecomposed (``KEPT``) and ``rewrite_joint`` replaces

- each ``_native_batch_norm_legit_functional`` (the forward) by ``ort_trainer::batch_norm_training(x, w, b,
  running_mean, running_var, momentum, eps)`` -> ``(y, save_mean, save_invstd, new_running_mean,
  new_running_var)``: a ``BatchNormTraining`` node (``kernels/csrc/torch_norm.h``: ``aten::native_batch_norm``,
  written into ONNX Runtime's buffers, the running statistics updated as torch updates a module's);
- each ``native_batch_norm_backward`` by ``ort_trainer::batch_norm_grad(dy, x, w, save_mean, save_invstd, eps)``
  -> ``(dx, dw, db)``: a ``BatchNormGrad`` node (``aten::native_batch_norm_backward``) reading the statistics the
  forward saved, its readers keeping their names.

Both are nodes of ``kernels.TORCH_OPS_DOMAIN``. The forward runs between convolutions, which are torch's kernels as
well where this applies (``conv_ops``, on by default): ONNX Runtime's own convolutions beside a torch batch norm
competed with torch's still-spinning OpenMP threads for the cores (a ResNet-18's forward convolutions took 205 ms
instead of 124 ms, 2-core AMD EPYC).
"""

from __future__ import annotations

import operator

import torch

from ...kernels import TORCH_OPS_DOMAIN as DOMAIN
from . import onnx_schemas
from .fx_nodes import Builder, replace_result_readers, retarget

_aten = torch.ops.aten
# what the joint trace leaves undecomposed for ``rewrite_joint``: the backward, and the forward (in training, with
# running statistics: the functional form that returns their new values)
KEPT = (_aten.native_batch_norm_backward.default, _aten._native_batch_norm_legit_functional.default)


@torch.library.custom_op("ort_trainer::batch_norm_grad", mutates_args=())
def batch_norm_grad(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, save_mean: torch.Tensor,
                    save_invstd: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of a training-mode batch norm's input, weight and bias from the forward's statistics
    (``BatchNormGrad``)."""
    return tuple(_aten.native_batch_norm_backward(dy, x, w, None, None, save_mean, save_invstd, True, eps,
                                                  [True, True, True]))


@batch_norm_grad.register_fake
def _batch_norm_grad_fake(dy, x, w, save_mean, save_invstd, eps):
    return torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)


@torch.library.custom_op("ort_trainer::batch_norm_training", mutates_args=())
def batch_norm_training(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, running_mean: torch.Tensor,
                        running_var: torch.Tensor, momentum: float,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training-mode batch norm's output, batch statistics (the mean and 1 / sqrt(var + eps)) and new running
    statistics, as ``aten._native_batch_norm_legit_functional`` returns them (``BatchNormTraining``)."""
    return tuple(t.clone() for t in _aten._native_batch_norm_legit_functional(x, w, b, running_mean, running_var,
                                                                              True, momentum, eps))


@batch_norm_training.register_fake
def _batch_norm_training_fake(x, w, b, running_mean, running_var, momentum, eps):
    return (torch.empty_like(x), *(torch.empty_like(running_mean) for _ in range(4)))


def applies(program) -> bool:
    """Whether every batch norm of ``program`` (before autograd) is one the kernels take: ``aten.batch_norm`` in
    training with weight, bias and running statistics, of a float32 input on the CPU. Autograd decomposes every
    batch norm or none, so one that is not (another batch norm operator too, an instance norm) keeps them all
    ONNX's."""
    found = False
    for node in program.graph.nodes:
        if node.op == "call_function" and "instance_norm" in str(node.target):
            return False  # (its batch norm of the reshaped input, without weight or running statistics)
        if node.op != "call_function" or "batch_norm" not in str(node.target):
            continue
        if node.target != _aten.batch_norm.default or len(node.args) < 8:
            return False
        x, w, b, mean, var, training, momentum = node.args[:7]
        value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if (not training or any(t is None for t in (w, b, mean, var)) or not isinstance(value, torch.Tensor)
                or not isinstance(momentum, (int, float))
                or value.dtype != torch.float32 or value.device.type != "cpu"):
            return False
        found = True
    return found


def kept(program, switches) -> tuple:
    """What the joint trace of ``program`` leaves undecomposed for ``rewrite_joint``: ``KEPT`` where the switch
    ``torch_batch_norm`` is among ``switches`` and every batch norm ``applies``, else nothing."""
    return KEPT if "torch_batch_norm" in switches and applies(program) else ()


def rewrite_joint(program) -> int:
    """Replace each batch norm the joint trace left (``KEPT``), in place: the backward by the kernel's operator, the
    forward by ``batch_norm_training``; returns how many batch norms it rewrote."""
    backward, forward = KEPT
    forwards = [n for n in program.graph.nodes if n.op == "call_function" and n.target == forward]
    for node in forwards:
        x, w, b, running_mean, running_var, train, momentum, eps = node.args
        if not train or not isinstance(momentum, (int, float)):
            raise RuntimeError(f"{node.name}: a batch norm out of training or of a momentum that is no number, "
                               "which applies() should have kept ONNX's")
        retarget(node, torch.ops.ort_trainer.batch_norm_training.default,
                 (x, w, b, running_mean, running_var, float(momentum), float(eps)))
    replaced = replace_result_readers(program, (backward,), _gradients)
    if forwards and not replaced:  # (else recompiled there)
        program.graph_module.recompile()
    return max(replaced, len(forwards))


def _gradients(node: torch.fx.Node, build: Builder) -> dict[int, tuple]:
    """What reads each of a ``native_batch_norm_backward``'s results instead: the kernel's operator's."""
    dy, x, w, _mean, _var, save_mean, save_invstd, train, eps, _mask = node.args
    if not train:
        raise RuntimeError(f"{node.name}: a batch norm's backward out of training, which applies() should have "
                           "kept ONNX's")
    gradients = build(torch.ops.ort_trainer.batch_norm_grad.default, dy, x, w, save_mean, save_invstd, float(eps))
    return {index: (operator.getitem, (gradients, index)) for index in range(3)}


_SCHEMAS = {
    "BatchNormGrad": ([("dy", "T"), ("x", "T"), ("w", "T"), ("save_mean", "T"), ("save_invstd", "T")],
                      [("dx", "T"), ("dw", "T"), ("db", "T")], ("epsilon",)),
    "BatchNormTraining": ([("x", "T"), ("w", "T"), ("b", "T"), ("running_mean", "T"), ("running_var", "T")],
                          [("y", "T"), ("save_mean", "T"), ("save_invstd", "T"), ("new_running_mean", "T"),
                           ("new_running_var", "T")], ("epsilon", "momentum")),
}


def register_translations(registry) -> None:
    """Add the translations of ``batch_norm_grad`` and ``batch_norm_training`` to the exporter's registry
    (``joint_onnx``)."""
    import onnx
    import onnxscript

    floats = onnx.defs.OpSchema.AttrType.FLOAT
    onnx_schemas.register(DOMAIN, 1, "ort_trainer's torch operators", _SCHEMAS, {"T": ["tensor(float)"]},
                          attribute_types={"epsilon": floats, "momentum": floats})
    opset = onnxscript.values.Opset(DOMAIN, 1)

    def batch_norm_grad_onnx(dy, x, w, save_mean, save_invstd, eps: float):
        return opset.BatchNormGrad(dy, x, w, save_mean, save_invstd, epsilon=eps)

    def batch_norm_training_onnx(x, w, b, running_mean, running_var, momentum: float, eps: float):
        return opset.BatchNormTraining(x, w, b, running_mean, running_var, epsilon=eps, momentum=momentum)

    registry.register_op(torch.ops.ort_trainer.batch_norm_grad.default, batch_norm_grad_onnx)
    registry.register_op(torch.ops.ort_trainer.batch_norm_training.default, batch_norm_training_onnx)


__all__ = ["KEPT", "applies", "batch_norm_grad", "batch_norm_training", "kept", "register_translations",
           "rewrite_joint"]
