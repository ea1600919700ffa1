"""A convolution, its backward and the ReLUs' gradients as torch's kernels inside ONNX Runtime
(``graph_optimizations.torch_convolutions``): on the CPU, oneDNN's, the kernels eager PyTorch trains a convolution
with.

Autograd emits one ``aten.convolution_backward`` per convolution, which the exporter cannot translate;
``backward_decompositions.convolution_backward`` writes it in ONNX convolutions: the input's gradient a transposed
convolution, the weight's a convolution of the input by the output gradient, the batch taking the place of the
channels. ONNX Runtime's CPU kernels run that last one 2.6-3.4x slower than oneDNN's weight gradient (its kernel is
as large as the image: a 3 x 3 ResNet convolution of [32, 64, 32, 32] takes 31 ms, oneDNN's 11.8 ms), and it is
half of a CNN's step. Where every convolution of the program is one the kernels take (float32 on the CPU, transposed
or not: ``applies``), the joint trace leaves ``convolution_backward`` and ``threshold_backward`` (a ReLU's
gradient) undecomposed (``KEPT``) and ``rewrite_joint`` replaces

- each ``convolution_backward`` by ``ort_trainer::conv_grad(dy, x, w, stride, padding, dilation, groups)`` ->
  ``(dx, dw)``: a ``ConvGrad`` node of ``kernels.TORCH_OPS_DOMAIN`` (``kernels/csrc/torch_conv.h``:
  ``aten::convolution_backward``), or by ``ort_trainer::conv_weight_grad(...)`` -> ``dw`` (``ConvWeightGrad``) where
  the input needs no gradient (the model's data, the first convolution), and the bias's gradient, where there is
  one, by the sum of the output gradient over all but the channels;
- each forward convolution by ``ort_trainer::conv`` (``Conv`` / ``BiasConv``: ``aten::convolution``; a transposed
  one too, the model's and those a backward's decomposition wrote, an average pool's gradient);
- each float32 ``threshold_backward`` by ``ort_trainer::threshold_grad`` (``ThresholdGrad``, written into ONNX
  Runtime's buffer), one of another dtype by the ``masked_fill`` torch decomposes it into.

The forward's convolutions and the ReLUs' gradients sit between torch's kernels, where ONNX Runtime's threads do not
spin (``Device.torch_kernels_spin``): so run, ONNX Runtime's CPU convolutions took 205-220 ms for ResNet-18's forward
against torch's 108-119 ms (each timed alone, 2-core AMD EPYC), and a ReLU's gradient was two nodes (a comparison
and a ``Where``) taking 18-29 ms a step against the kernel's 6.4 ms.
"""

from __future__ import annotations

import operator

import torch

from ...kernels import TORCH_OPS_DOMAIN as DOMAIN
from . import onnx_schemas
from .fx_nodes import Builder, replace_result_readers, retarget
from .pools import per_dim

_aten = torch.ops.aten
# what the joint trace leaves undecomposed for ``rewrite_joint``
KEPT = (_aten.convolution_backward.default, _aten.threshold_backward.default)
# the forward's convolutions (before autograd), transposed or not
_CONVOLUTIONS = frozenset({_aten.conv1d.default, _aten.conv2d.default, _aten.conv3d.default, _aten.conv1d.padding,
                           _aten.conv2d.padding, _aten.conv3d.padding, _aten.conv_transpose1d.default,
                           _aten.conv_transpose2d.input, _aten.conv_transpose3d.input})


def _backward(dy, x, w, stride, padding, dilation, transposed, output_padding, groups, input_grad):
    return _aten.convolution_backward(dy, x, w, None, stride, padding, dilation, transposed, output_padding, groups,
                                      [input_grad, True, False])


@torch.library.custom_op("ort_trainer::conv_grad", mutates_args=())
def conv_grad(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
              dilation: list[int], transposed: bool, output_padding: list[int],
              groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of a convolution's (or transposed convolution's) input and weight from its output's,
    ``(dx, dw)``, as the ``ConvGrad`` kernel computes them (``aten.convolution_backward``)."""
    dx, dw, _ = _backward(dy, x, w, stride, padding, dilation, transposed, output_padding, groups, True)
    return dx, dw


@conv_grad.register_fake
def _conv_grad_fake(dy, x, w, stride, padding, dilation, transposed, output_padding, groups):
    return torch.empty_like(x), torch.empty_like(w)


@torch.library.custom_op("ort_trainer::threshold_grad", mutates_args=())
def threshold_grad(dy: torch.Tensor, y: torch.Tensor, threshold: float) -> torch.Tensor:
    """``dy`` where ``y`` is above ``threshold``, else 0: a ReLU's gradient from its output (``ThresholdGrad``)."""
    return _aten.threshold_backward(dy, y, threshold)


@threshold_grad.register_fake
def _threshold_grad_fake(dy, y, threshold):
    return torch.empty_like(dy)


@torch.library.custom_op("ort_trainer::conv", mutates_args=())
def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: list[int], padding: list[int],
         dilation: list[int], transposed: bool, output_padding: list[int], groups: int) -> torch.Tensor:
    """A convolution (or transposed convolution) of ``x`` by ``w``, plus ``b`` where given (``Conv``,
    ``BiasConv``)."""
    return _aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


@conv.register_fake
def _conv_fake(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    return _aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


@torch.library.custom_op("ort_trainer::conv_weight_grad", mutates_args=())
def conv_weight_grad(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
                     dilation: list[int], transposed: bool, output_padding: list[int], groups: int) -> torch.Tensor:
    """The gradient of a convolution's (or transposed convolution's) weight alone (``ConvWeightGrad``)."""
    return _backward(dy, x, w, stride, padding, dilation, transposed, output_padding, groups, False)[1]


@conv_weight_grad.register_fake
def _conv_weight_grad_fake(dy, x, w, stride, padding, dilation, transposed, output_padding, groups):
    return torch.empty_like(w)


def applies(program) -> bool:
    """Whether every convolution of ``program`` (before autograd) is one the kernels take: float32 on the CPU,
    transposed or not. Autograd decomposes every ``convolution_backward`` or none, so one that is not keeps them all
    ONNX's. An operator of another name with "conv" in it (``aten.convolution`` itself, say) keeps them too."""
    found = False
    for node in program.graph.nodes:
        if node.op != "call_function" or "conv" not in str(node.target):
            continue
        value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if (node.target not in _CONVOLUTIONS or not isinstance(value, torch.Tensor)
                or value.dtype != torch.float32 or value.device.type != "cpu"):
            return False
        found = True
    return found


def kept(program, switches) -> tuple:
    """What the joint trace of ``program`` leaves undecomposed for ``rewrite_joint``: ``KEPT`` where the switch
    ``torch_convolutions`` is among ``switches`` and every convolution ``applies``, else nothing."""
    return KEPT if "torch_convolutions" in switches and applies(program) else ()


def _settings(w: torch.fx.Node, stride, padding, dilation, transposed, output_padding, groups) -> tuple:
    """``aten.convolution``'s settings as the kernels' operators take them: one value per spatial dim."""
    dims = w.meta["val"].dim() - 2
    def ints(values) -> list[int]:
        return [int(v) for v in per_dim(values, dims)]
    return ints(stride), ints(padding), ints(dilation), bool(transposed), ints(output_padding), int(groups)


def rewrite_joint(program) -> int:
    """Where the joint trace left what ``KEPT`` names (it decomposes them unless ``kept`` named them: the switch
    applies), replace, in place, each float32 convolution on the CPU by the kernels' operator (``conv``), each
    ReLU's gradient (``threshold_backward``) by ``threshold_grad`` (float32) or torch's ``masked_fill``
    decomposition (another dtype), and each ``convolution_backward`` by the kernels' operator (and a sum for the
    bias); returns how many backwards it replaced."""
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    if not any(n.target in KEPT for n in calls):
        return 0
    for node in [n for n in calls if n.target == _aten.convolution.default]:
        x, w, b, *settings = node.args
        value = x.meta["val"]
        if value.dtype != torch.float32 or value.device.type != "cpu":
            continue
        retarget(node, torch.ops.ort_trainer.conv.default, (x, w, b, *_settings(w, *settings)))
    for node in [n for n in calls if n.target == KEPT[1]]:
        dy, y, threshold = node.args
        if dy.meta["val"].dtype == torch.float32:
            retarget(node, torch.ops.ort_trainer.threshold_grad.default, (dy, y, float(threshold)))
        else:
            with program.graph.inserting_before(node):
                below = Builder(program.graph, node)(_aten.le.Scalar, y, threshold)
            retarget(node, _aten.masked_fill.Scalar, (dy, below, 0.0))
    replaced = replace_result_readers(program, KEPT[:1], _gradients)
    if not replaced:  # (else linted and recompiled there)
        program.graph.lint()
        program.graph_module.recompile()
    return replaced


def _gradients(node: torch.fx.Node, build: Builder) -> dict[int, tuple]:
    """What reads each of a ``convolution_backward``'s results instead: the kernels' operator's, the bias's sum."""
    dy, x, w, _bias, *settings, mask = node.args
    dims = w.meta["val"].dim() - 2
    settings = _settings(w, *settings)
    gradients = {2: (_aten.sum.dim_IntList, (dy, [0, *range(2, 2 + dims)]))}
    if mask[0]:
        both = build(torch.ops.ort_trainer.conv_grad.default, dy, x, w, *settings)
        gradients.update({index: (operator.getitem, (both, index)) for index in (0, 1)})
    else:
        gradients[1] = (torch.ops.ort_trainer.conv_weight_grad.default, (dy, x, w, *settings))
    return gradients


_CONV_ATTRIBUTES = ("stride", "padding", "dilation", "transposed", "output_padding", "groups")
_SCHEMAS = {
    "ThresholdGrad": ([("dy", "T"), ("y", "T")], [("dx", "T")], ("threshold",)),
    "Conv": ([("x", "T"), ("w", "T")], [("y", "T")], _CONV_ATTRIBUTES),
    "BiasConv": ([("x", "T"), ("w", "T"), ("b", "T")], [("y", "T")], _CONV_ATTRIBUTES),
    "ConvGrad": ([("dy", "T"), ("x", "T"), ("w", "T")], [("dx", "T"), ("dw", "T")], _CONV_ATTRIBUTES),
    "ConvWeightGrad": ([("dy", "T"), ("x", "T"), ("w", "T")], [("dw", "T")], _CONV_ATTRIBUTES),
}


def register_translations(registry) -> None:
    """Add the translations of ``conv_grad`` and ``conv_weight_grad`` to the exporter's registry (``joint_onnx``)."""
    import onnx
    import onnxscript

    ints = onnx.defs.OpSchema.AttrType.INTS
    onnx_schemas.register(DOMAIN, 1, "ort_trainer's torch operators", _SCHEMAS, {"T": ["tensor(float)"]},
                          attribute_types={"stride": ints, "padding": ints, "dilation": ints, "output_padding": ints,
                                           "threshold": onnx.defs.OpSchema.AttrType.FLOAT})
    opset = onnxscript.values.Opset(DOMAIN, 1)

    def attributes(stride, padding, dilation, transposed, output_padding, groups) -> dict:
        return {"stride": stride, "padding": padding, "dilation": dilation, "transposed": int(transposed),
                "output_padding": output_padding, "groups": groups}

    def conv_grad_onnx(dy, x, w, *settings):
        return opset.ConvGrad(dy, x, w, **attributes(*settings))

    def conv_weight_grad_onnx(dy, x, w, *settings):
        return opset.ConvWeightGrad(dy, x, w, **attributes(*settings))

    def conv_onnx(x, w, b, *settings):
        if b is None:
            return opset.Conv(x, w, **attributes(*settings))
        return opset.BiasConv(x, w, b, **attributes(*settings))

    registry.register_op(torch.ops.ort_trainer.conv_grad.default, conv_grad_onnx)
    registry.register_op(torch.ops.ort_trainer.conv.default, conv_onnx)
    registry.register_op(torch.ops.ort_trainer.threshold_grad.default,
                         lambda dy, y, threshold: opset.ThresholdGrad(dy, y, threshold=threshold))
    registry.register_op(torch.ops.ort_trainer.conv_weight_grad.default, conv_weight_grad_onnx)


__all__ = ["KEPT", "applies", "conv_grad", "conv_weight_grad", "kept", "register_translations", "rewrite_joint"]
