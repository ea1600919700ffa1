"""``graph_optimizations.fused_gelu_gradient``, ``fused_layer_norm_gradient``, ``fused_softmax_gradient``,
``fused_safe_softmax`` and ``fused_cross_entropy``: each GELU's, LayerNorm's and softmax's backward, each
attention's safe softmax and each cross-entropy as nodes of ort_trainer's kernel library (``GeluGrad`` /
``TanhGeluGrad``, ``LayerNormGrad`` / ``LayerNormGradAdd``, ``SoftmaxGrad``, ``SafeSoftmax``, ``CrossEntropy`` and
``CrossEntropyGrad``: ``ort_trainer/kernels``), run by its CPU kernels here and its CUDA kernels under
``make gpu-check`` (the pieces of a loss with the cross-entropy kernels: ``test_loss_pieces.py``).

Checked against float64 PyTorch: one float32 step of a tiny GPT-2 (tanh GELU) and of TinyEncoder (erf), and one
float16 step of the GPT-2 (bfloat16 on a GPU only: ONNX Runtime's CPU provider lacks bfloat16 kernels the graph
needs), loss and every gradient, each option on and off; the graphs (one kernel node per GELU, LayerNorm or
softmax).
The kernels' own values: ``test_kernels.py``.
"""

import copy

import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.kernels import DOMAIN
from ort_trainer.optim import SGDConfig

from test_half_loss import _encoder_case, _float64, _gpt2_case, _relative
from tolerances import BFLOAT16, FLOAT16, FLOAT32, check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(),
                                reason="the 'torch' gradient source exports with onnxscript")

# float32 against float64, relative to each tensor's norm: the tiny GPT-2's logits carry ~370 roundings
# (test_eval_passes.py's GPT2_LOGITS_BOUND derivation) and the backward runs the chain back once more, ~800 in
# all; the kernel computes GELU's derivative in float32 in another sequence of operations (a few roundings on each
# element). Bound: 4000·u32 = 2.4e-4, a 5x margin; on against off, the same chain from the GELU on.
FLOAT32_BOUND = 4000 * FLOAT32
# float16: test_half_loss.py's HALF_BOUND (40 roundings of the tiny models' longest float16 chain); the kernel
# rounds its result once where the element-wise backward rounds each of its 6-7 nodes
HALF_BOUND = 40 * FLOAT16


# the kernel nodes each option writes into the tiny models' float32 gradient graphs (two GELUs, five LayerNorms, two
# attention softmaxes). GPT-2's LayerNorms are pre-norm: but for the final one, each one's gradient goes on into the
# residual's sum, in its kernel (LayerNormGradAdd; under mixed precision with the sum's half cast,
# LayerNormGradAddCast, but for the first layer's first, whose sum the embeddings' float32 gradients read);
# TinyEncoder's are post-norm, their gradient read by the sublayer's backward and the residual both (under mixed
# precision the kernel casts it for the sublayer's products, LayerNormGradToFloat16, as for GPT-2's final one; the
# encoder's own final LayerNorm's gradient goes to its embeddings in float32)
NODES = {("fused_gelu_gradient", "gpt2"): ["TanhGeluGrad"] * 2, ("fused_gelu_gradient", "encoder"): ["GeluGrad"] * 2,
         ("fused_layer_norm_gradient", "gpt2"): ["LayerNormGrad"] + ["LayerNormGradAdd"] * 4,
         ("fused_layer_norm_gradient", "encoder"): ["LayerNormGrad"] * 5,
         ("fused_softmax_gradient", "gpt2"): ["SoftmaxGrad"] * 2,
         ("fused_softmax_gradient", "encoder"): ["SoftmaxGrad"] * 2,
         # each attention's and, activation_recompute being on, its copy in the backward (no probabilities kept),
         # adding the causal mask
         ("fused_safe_softmax", "gpt2"): ["BiasSafeSoftmax"] * 4,
         ("fused_safe_softmax", "encoder"): [],  # (TinyEncoder's attention softmax is a plain one)
         ("fused_cross_entropy", "gpt2"): ["CrossEntropy", "CrossEntropyGrad"],
         ("fused_cross_entropy", "encoder"): ["CrossEntropy", "CrossEntropyGrad"]}
OPTIONS = ("fused_gelu_gradient", "fused_layer_norm_gradient", "fused_softmax_gradient", "fused_safe_softmax",
           "fused_cross_entropy")


_TO = {"float16": "LayerNormGradToFloat16", "bfloat16": "LayerNormGradToBFloat16"}


def _nodes(option: str, case: str, half: str | None) -> list[str]:
    """``NODES[option, case]`` in a graph of ``half`` mixed precision (None: float32)."""
    if half and (option, case) == ("fused_layer_norm_gradient", "gpt2"):
        return [_TO[half]] + ["LayerNormGradAddCast"] * 3 + ["LayerNormGradAdd"]
    if half and (option, case) == ("fused_layer_norm_gradient", "encoder"):
        return ["LayerNormGrad"] + [_TO[half]] * 4
    return NODES[option, case]


def _step(model, desc, batch, loss_fn, option: str, on: bool, half: str | None):
    scaler = DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)  # unscaled gradients, no skipped step
    mixed = ({"enabled": True, "dtype": half, **({"loss_scaler": scaler} if half == "float16" else {})}
             if half else {"enabled": False})
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), loss_fn=loss_fn,
                         options={"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
                                  "mixed_precision": mixed, "graph_optimizations": {option: on}})
    outputs = trainer.train_step(*batch)
    loss = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    return trainer, float(loss), {w: g.float().numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case, half", [("gpt2", None), ("encoder", None), ("gpt2", "float16")],
                         ids=["gpt2-float32", "encoder-float32", "gpt2-float16"])
def test_the_kernel_trains_within_rounding_of_float64(option, case, half, record_property):
    """One step, the option on and off: the loss and every gradient within the bound of float64 PyTorch's, on
    against off too. On, each GELU's, LayerNorm's or softmax's backward is one node of the kernels' domain."""
    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    bound = HALF_BOUND if half else FLOAT32_BOUND
    loss64, grads64 = _float64(model, batch, loss_fn)
    results, errors = {}, {}
    for on in (True, False):
        trainer, value, grads = _step(model, desc, batch, loss_fn, option, on, half)
        results[on] = grads
        errors[on] = {"loss": abs(value - loss64) / abs(loss64),
                      **{name: _relative(grads[name], grad) for name, grad in grads64.items()}}
        for name, error in errors[on].items():
            check(error, bound, (on, name))
        kernels = [n.op_type for n in trainer._graphs.gradient.graph.node if n.domain == DOMAIN]
        assert kernels == (_nodes(option, case, half) if on else []), kernels
    on_off = {name: _relative(results[True][name], grad) for name, grad in results[False].items()}
    for name, error in on_off.items():
        check(error, bound, ("on/off", name))
    record_property("errors", {**{on: max(e.values()) for on, e in errors.items()}, "on/off": max(on_off.values())})


# bfloat16 against float64: the same 40 roundings of the longest chain, each u_bf16 of its value
BFLOAT16_BOUND = 40 * BFLOAT16


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["gpt2", "encoder"])
@pytest.mark.parametrize("half", [None, "float16", "bfloat16"])
def test_the_cuda_kernels_train_within_rounding_of_float64(half, case, record_property):
    """On CUDA (``make gpu-check``): one step of the tiny GPT-2 and of TinyEncoder in float32, float16 and
    bfloat16 with their GELU, LayerNorm and softmax backwards on the library's CUDA kernels, the loss and every
    gradient within the bound of float64 PyTorch's (a library without CUDA kernels is refused before the
    session)."""
    model, desc, batch, loss_fn = _gpt2_case() if case == "gpt2" else _encoder_case()
    loss64, grads64 = _float64(model, batch, loss_fn)
    scaler = DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)
    mixed = ({"enabled": True, "dtype": half, **({"loss_scaler": scaler} if half == "float16" else {})}
             if half else {"enabled": False})
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), loss_fn=loss_fn,
                         options={"device": {"id": "cuda"}, "graph": {"gradient_source": "torch"},
                                  "utils": {"grad_norm_clip": False}, "mixed_precision": mixed,
                                  "graph_optimizations": dict.fromkeys(OPTIONS, True)})
    outputs = trainer.train_step(*[t.cuda() for t in batch])
    loss = float((outputs[0] if isinstance(outputs, (list, tuple)) else outputs).cpu())
    grads = {w: g.float().cpu().numpy().astype(np.float64) for w, g in trainer._engine.grads.items()}
    errors = {"loss": abs(loss - loss64) / abs(loss64), **{n: _relative(grads[n], g) for n, g in grads64.items()}}
    bound = {None: FLOAT32_BOUND, "float16": HALF_BOUND, "bfloat16": BFLOAT16_BOUND}[half]
    record_property("worst", max(errors.values()))
    for name, error in errors.items():
        check(error, bound, (half, name))
    nodes = sorted(n.op_type for n in trainer._graphs.gradient.graph.node if n.domain == DOMAIN)
    assert nodes == sorted(sum((_nodes(option, case, half) for option in OPTIONS), [])), nodes


def test_a_bias_added_before_a_safe_softmax_is_added_by_its_kernel():
    """``_safe_softmax(h + bias)`` with a trainable bias broadcast to h (as attention's mask is, which is not
    trained): one ``BiasSafeSoftmax`` node, no Add, and the bias's gradient (summed over the broadcast dims) too
    within FLOAT32_BOUND of float64 PyTorch's; a sum also read elsewhere stays an Add before a ``SafeSoftmax``."""
    class Biased(torch.nn.Module):
        def __init__(self, reread: bool):
            super().__init__()
            self.up = torch.nn.Linear(5, 5)
            self.bias = torch.nn.Parameter(torch.randn(6, 5) * 2)  # (one along a row would have zero gradient)
            self.reread = reread

        def forward(self, x, y):
            scores = self.up(x) + self.bias
            p = torch.ops.aten._safe_softmax(scores, -1)
            return torch.nn.functional.mse_loss(p * scores if self.reread else p, y)

    desc = {"inputs": [("x", [3, 6, 5]), ("y", [3, 6, 5])], "outputs": [("loss", [], True)]}
    gen = torch.Generator().manual_seed(3)
    batch = (torch.randn(3, 6, 5, generator=gen), torch.rand(3, 6, 5, generator=gen))
    for reread, expected in ((False, "BiasSafeSoftmax"), (True, "SafeSoftmax")):
        torch.manual_seed(0)
        model = Biased(reread)
        double = copy.deepcopy(model).double()
        double(*(t.double() for t in batch)).backward()
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                             options={"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
                                      "graph_optimizations": {"fused_safe_softmax": True}})
        trainer.train_step(*batch)
        nodes = trainer._graphs.gradient.graph.node
        assert [n.op_type for n in nodes if n.domain == DOMAIN] == [expected], [n.op_type for n in nodes]
        forward = next(i for i, n in enumerate(nodes) if n.domain == DOMAIN)
        assert sum(n.op_type == "Add" for n in nodes[:forward]) == reread  # (the Linear's bias is its Gemm's)
        for name, parameter in double.named_parameters():
            check(_relative(trainer._engine.grads[name].numpy().astype(np.float64), parameter.grad.numpy()),
                  FLOAT32_BOUND, (reread, name))


def test_a_softmax_over_another_axis_keeps_torchs_arithmetic():
    """Softmaxes and safe softmaxes over axis 1 of [3, 6, 5] beside ones over the last axis: the last-axis ones'
    backwards and safe softmax are the kernels', the others torch's own arithmetic (the joint trace left them all
    undecomposed); one float32 step equals float64 PyTorch's within FLOAT32_BOUND, the options on and off."""
    class TwoSoftmaxes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(5, 5)

        def forward(self, x, y):
            h = self.up(x)
            safe = torch.ops.aten._safe_softmax(h, 1) * torch.ops.aten._safe_softmax(h, -1)
            return torch.nn.functional.mse_loss(torch.softmax(h, dim=1) * torch.softmax(h, dim=-1) * safe, y)

    desc = {"inputs": [("x", [3, 6, 5]), ("y", [3, 6, 5])], "outputs": [("loss", [], True)]}
    gen = torch.Generator().manual_seed(2)
    batch = (torch.randn(3, 6, 5, generator=gen), torch.rand(3, 6, 5, generator=gen))
    torch.manual_seed(0)
    model = TwoSoftmaxes()
    double = copy.deepcopy(model).double()
    double(*(t.double() for t in batch)).backward()
    for on in (True, False):
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                             options={"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False},
                                      "graph_optimizations": {"fused_softmax_gradient": on,
                                                              "fused_safe_softmax": on}})
        trainer.train_step(*batch)
        kernels = [n.op_type for n in trainer._graphs.gradient.graph.node if n.domain == DOMAIN]
        assert sorted(kernels) == (["SafeSoftmax", "SoftmaxGrad", "SoftmaxGrad"] if on else []), kernels
        for name, parameter in double.named_parameters():
            check(_relative(trainer._engine.grads[name].numpy().astype(np.float64), parameter.grad.numpy()),
                  FLOAT32_BOUND, (on, name))
