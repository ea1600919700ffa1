"""A CNN's convolutions, ReLU gradients and training-mode batch norms as torch's kernels on the ``torch`` gradient
source (``graph_optimizations.torch_convolutions`` and ``torch_batch_norm``, ``ort_trainer/graph/gradient/conv_ops.py``
and ``batch_norm_ops.py``): ``Conv`` / ``BiasConv`` and ``ConvGrad`` / ``ConvWeightGrad`` nodes run
``aten::convolution`` and ``aten::convolution_backward`` (oneDNN's on the CPU), ``ThresholdGrad`` nodes
``aten::threshold_backward``, ``BatchNormTraining`` and ``BatchNormGrad`` nodes ``aten::native_batch_norm`` and its
backward inside ONNX Runtime, checked against float64 gradients and running statistics; where one convolution or
batch norm is one they do not take, every one of its kind stays ONNX's. Transposed convolutions (the model's, and
those of an average pool's gradient) run the same kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTTrainer
from ort_trainer._runtime import has_onnxscript
from ort_trainer.kernels import TORCH_OPS_DOMAIN
from ort_trainer.optim import SGDConfig
from tolerances import FLOAT32, check, relative_error

pytestmark = pytest.mark.skipif(not has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")

# Gradients of float32 ONNX Runtime against float64 autograd: each is a sum of at most 2 x 12 x 12 = 288 terms (the
# first transposed convolution's bias, over the batch and its 12 x 12 outputs; a weight's sums at most the batch x
# 6 x 6 positions = 72, an input's 6 channels x 9 taps = 54), carried back through at most 5 convolutions: 5 x 288
# roundings of float32, with a 10x margin for tanh's own and for reading a gradient off one SGD step (w0 - w1 cancels
# |w| / |g| <= ~30x u): 8.6e-4. Observed: <= 4.4e-7.
GRADIENT_BOUND = 10 * 5 * 288 * FLOAT32
_TORCH_ROUTE = {"graph": {"gradient_source": "torch"}}
_DESC = {"inputs": [("x", ["batch", 3, 12, 12]), ("target", ["batch"])], "outputs": [("loss", [], True)]}


class _Convs(torch.nn.Module):
    """A strided, dilated first convolution (its input needs no gradient), a grouped one without bias, a depthwise
    one, and 1-d and 3-d convolutions of their output; ``transposed`` adds transposed convolutions of theirs (strided,
    padded, with an output padding, grouped, dilated; 2-d and 1-d) and an average pool."""

    def __init__(self, transposed: bool = False):
        super().__init__()
        self.first = torch.nn.Conv2d(3, 4, 3, stride=2, dilation=2, padding=2)
        self.grouped = torch.nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False)
        self.depthwise = torch.nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.line = torch.nn.Conv1d(6, 4, 3, stride=2)
        self.volume = torch.nn.Conv3d(6, 2, (1, 3, 3))
        self.transposed = torch.nn.Sequential(
            torch.nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=1),
            torch.nn.Tanh(), torch.nn.AvgPool2d(2), torch.nn.ConvTranspose2d(4, 2, 2, stride=2, bias=False),
        ) if transposed else None
        self.transposed_line = torch.nn.ConvTranspose1d(6, 3, 3, stride=3, dilation=2) if transposed else None

    def forward(self, x, target):
        h = torch.tanh(self.depthwise(torch.tanh(self.grouped(torch.tanh(self.first(x))))))
        total = self.line(h.flatten(2)).sum((1, 2)) + self.volume(h.unsqueeze(2)).sum((1, 2, 3, 4))
        if self.transposed is not None:
            total = total + self.transposed(h).sum((1, 2, 3)) + self.transposed_line(h.flatten(2)).sum((1, 2))
        return torch.nn.functional.mse_loss(total, target)


def _gradients(model: torch.nn.Module, options: dict, float64: torch.nn.Module | None = None,
               size: int = 2) -> tuple[dict, dict, ORTTrainer]:
    """One SGD step of ``model`` (lr 1) on a batch of ``size`` in ORTTrainer: each weight's gradient ``w0 - w1``,
    float64 autograd's of the same batch (by ``float64``, a float64 copy made before the step where not given), and
    the trainer."""
    generator = torch.Generator().manual_seed(1)
    batch = torch.randn(size, 3, 12, 12, generator=generator), torch.randn(size, generator=generator)
    float64 = copy.deepcopy(model).double() if float64 is None else float64
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    trainer = ORTTrainer(model, _DESC, SGDConfig(lr=1.0), options={**_TORCH_ROUTE, **options})
    trainer.train_step(*batch)
    after = trainer.state_dict(pytorch_format=True)
    got = {name: (value - after[name]).double() for name, value in before.items()}
    loss = float64(*(t.double() for t in batch))
    expected = dict(zip(before, torch.autograd.grad(loss, list(float64.parameters()))))
    return got, expected, trainer


def _check_gradients(got: dict, expected: dict, bound: float, case: str = "") -> None:
    for name in expected:
        check(relative_error(got[name].numpy(), expected[name].numpy()), bound, f"{case}{name}")


def _node_types(trainer: ORTTrainer) -> list[str]:
    """The gradient graph's node types, a torch kernel's as ``torch.Name``."""
    return [("torch." if node.domain == TORCH_OPS_DOMAIN else "") + node.op_type
            for node in trainer._graphs.gradient.graph.node]


@pytest.mark.parametrize("transposed", [False, True], ids=["convolutions", "with transposed ones"])
def test_each_convolutions_backward_is_one_node_of_torchs_kernels_with_autograds_gradients(transposed):
    torch.manual_seed(0)
    got, expected, trainer = _gradients(_Convs(transposed), {})
    _check_gradients(got, expected, GRADIENT_BOUND)
    types = _node_types(trainer)
    # the first convolution's input is the data: its weight's gradient alone; 3 more backwards of transposed ones
    assert types.count("torch.ConvWeightGrad") == 1 and types.count("torch.ConvGrad") == 4 + 3 * transposed
    # the forward's, torch's too (the grouped one and a transposed one have no bias; the average pool's gradient, a
    # transposed convolution, neither); none of ONNX's
    assert types.count("torch.Conv") == 1 + 2 * transposed and types.count("torch.BiasConv") == 4 + 2 * transposed
    assert "ConvTranspose" not in types and "Conv" not in types


def test_switched_off_every_convolutions_backward_stays_onnxs():
    """Switched off, the gradients are ONNX convolutions, autograd's all the same."""
    torch.manual_seed(0)
    got, expected, trainer = _gradients(_Convs(transposed=True), {"graph_optimizations": {"torch_convolutions": False}})
    _check_gradients(got, expected, GRADIENT_BOUND, "switched off: ")
    types = _node_types(trainer)
    assert not any(t.startswith("torch.") for t in types) and "ConvTranspose" in types and "Conv" in types


# A batch norm's gradients against float64, on a batch of 8 (of 2, BatchNorm1d's two normalised values are +-1
# whatever its input, whose gradient is then a cancellation: 5e-4 from float64 with either implementation): its
# statistics and backward sum over the batch and the positions (at most 8 x 12 x 12 = 1152 terms), through 3 batch
# norms and their convolutions: 3 x 1152 roundings of float32, with a 10x margin (reading a gradient off one SGD step,
# above): 2.1e-3. Observed: <= 1.2e-6. Running statistics: one update of float32 means and variances of 1152 terms,
# 6.9e-4 with the same margin. Observed: <= 1.8e-7.
NORM_BOUND = 10 * 3 * 8 * 12 * 12 * FLOAT32
STATISTICS_BOUND = 10 * 8 * 12 * 12 * FLOAT32


class _Normalized(torch.nn.Module):
    """Convolutions, each with a batch norm (2-d, then 1-d after a linear layer), in training; ``instance_norm``:
    beside them, an instance norm of another convolution of the input (a batch norm of the reshaped input, without
    weight or running statistics; after a batch norm, that one's weight, and a bias before it, get no gradient)."""

    def __init__(self, affine: bool = True, instance_norm: bool = False):
        super().__init__()
        self.instance_norm = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3, bias=False), torch.nn.InstanceNorm2d(2)) \
            if instance_norm else None
        self.conv1 = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.conv2 = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(6, momentum=0.3, affine=affine)
        self.linear = torch.nn.Linear(6 * 6 * 6, 5, bias=False)
        self.bn3 = torch.nn.BatchNorm1d(5)

    def forward(self, x, target):
        h = torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
        total = self.bn3(self.linear(h.flatten(1))).sum(1)
        if self.instance_norm is not None:
            total = total + torch.sin(self.instance_norm(x)).sum((1, 2, 3))
        return torch.nn.functional.mse_loss(total, target)


def _batch_norm_step(model: torch.nn.Module, options: dict) -> tuple[ORTTrainer, torch.nn.Module]:
    """``_gradients``' check for the batch norms' model (and its running statistics after the step against
    float64's); returns the trainer and the float64 model, stepped."""
    float64 = copy.deepcopy(model).double()
    got, expected, trainer = _gradients(model, options, float64, size=8)
    _check_gradients(got, expected, NORM_BOUND)
    state = trainer.state_dict(pytorch_format=True)
    for name, value in float64.state_dict().items():
        if "running" in name:
            check(relative_error(state[name].numpy(), value.numpy()), STATISTICS_BOUND, name)
    return trainer, float64


def test_each_batch_norms_backward_is_one_node_of_torchs_kernel_with_autograds_gradients():
    torch.manual_seed(0)
    trainer, _ = _batch_norm_step(_Normalized(), {})
    types = _node_types(trainer)
    assert types.count("torch.BatchNormTraining") == 3 and types.count("torch.BatchNormGrad") == 3
    assert "BatchNormalization" not in types
    assert types.count("torch.ThresholdGrad") == 2  # the ReLUs' gradients, between the convolutions'
    assert "Where" not in types and "LessOrEqual" not in types


@pytest.mark.parametrize("case", ["switched off", "a batch norm without weight and bias", "an instance norm"])
def test_otherwise_every_batch_norms_backward_stays_onnxs(case):
    torch.manual_seed(0)
    options = {"graph_optimizations": {"torch_batch_norm": False}} if case == "switched off" else {}
    model = _Normalized(affine=case != "a batch norm without weight and bias", instance_norm=case == "an instance norm")
    trainer, _ = _batch_norm_step(model, options)
    types = _node_types(trainer)
    assert "torch.BatchNormGrad" not in types and "torch.BatchNormTraining" not in types


class _Float64Relu(torch.nn.Module):
    """A ReLU of float32 convolution outputs and one of them widened to float64 (the loss in the input's dtype)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.second = torch.nn.Conv2d(4, 2, 3)

    def forward(self, x, target):
        h = self.second(torch.relu(self.conv(x)))
        return torch.nn.functional.mse_loss(torch.relu(h.double() - 0.1).sum((1, 2, 3)).to(x.dtype), target)


def test_a_relu_of_another_dtype_keeps_torchs_decomposition():
    """``ThresholdGrad`` takes float32: the float64 ReLU's gradient is the ``masked_fill`` torch decomposes it into."""
    torch.manual_seed(0)
    got, expected, trainer = _gradients(_Float64Relu(), {})
    _check_gradients(got, expected, GRADIENT_BOUND)
    types = _node_types(trainer)
    assert types.count("torch.ThresholdGrad") == 1 and "Where" in types


def test_bfloat16_on_the_cpu_is_refused_by_name_before_any_step():
    """ONNX Runtime's CPU Conv schema takes no bfloat16: the session refused the graph as invalid ("Type
    'tensor(bfloat16)' of input parameter ... of operator (Conv) ... is invalid"); the trainer says what and why, and
    no weight has moved."""
    from ort_trainer.amp.kernels import MissingKernelError

    torch.manual_seed(0)
    model = _Convs()
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    trainer = ORTTrainer(model, _DESC, SGDConfig(lr=1.0),
                         options={**_TORCH_ROUTE, "mixed_precision": {"enabled": True, "dtype": "bfloat16"}})
    with pytest.raises(MissingKernelError, match=r"no bfloat16 kernel for Conv \(node '[^']+': its schema refuses "
                                                 r"the type\); .*mixed_precision.enabled=False"):
        trainer.train_step(torch.randn(2, 3, 12, 12), torch.randn(2))
    after = trainer.state_dict(pytorch_format=True)
    assert all(torch.equal(after[name], value) for name, value in before.items())
