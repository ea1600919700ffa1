"""RReLU (``nn.RReLU``), which torch's ONNX exporter has no translation for, trains on the ``torch`` route as torch's
kernel computes it (``graph/gradient/backward_decompositions.py``): slopes drawn in the graph at every step."""


import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.optim import SGDConfig
from models import sgd_steps_as_pytorch
from tolerances import FLOAT32, check, relative_error, steps_bound

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")
TORCH = {"graph": {"gradient_source": "torch"}}


class Classifier(torch.nn.Module):
    def __init__(self, lower: float, upper: float):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.RReLU(lower, upper), torch.nn.Linear(8, 3))

    def forward(self, x, y):
        out = self.body(x)
        return torch.nn.functional.cross_entropy(out, y), out


DESC = {"inputs": [("x", ["b", 6]), ("y", ["b"])], "outputs": [("loss", [], True), ("out", ["b", 3])]}


def test_rrelu_of_one_slope_trains_and_evaluates_as_pytorch():
    """lower == upper: the slope drawn is known, so the losses are PyTorch's; eval mode is a leaky ReLU."""
    torch.manual_seed(29)
    # the same float32 arithmetic, sums of at most 8 terms in other orders; observed <= 0.03 of the bound
    trainer, reference = sgd_steps_as_pytorch(Classifier(0.1, 0.1), DESC,
                                              ((torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)),
                                              0.2, lambda step: steps_bound(step + 1), TORCH)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    reference.eval()
    with torch.no_grad():
        want = reference(x, y)[1]
    check(relative_error(np.asarray(trainer.eval_step(x, y)[1]), want.numpy()), steps_bound(4), "eval")


class Slopes(torch.nn.Module):
    """RReLU of the input times a trained scale of 1: its output over its input is each element's slope."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.rrelu = torch.nn.RReLU(0.1, 0.3)

    def forward(self, x):
        out = self.rrelu(x * self.scale)
        return out.square().mean(), out


def test_rrelu_draws_slopes_in_its_range_at_every_step():
    """At a learning rate of 0: the negative inputs' slopes lie in [0.1, 0.3], differ between elements and steps,
    and average 0.2 (over ~1000 draws of a uniform of standard deviation 0.2 / sqrt(12) = 0.058 each: a standard
    error of 0.0018; bound 5 of them); positive inputs pass unchanged."""
    desc = {"inputs": [("x", ["b", 64])], "outputs": [("loss", [], True), ("out", ["b", 64])]}
    trainer = ORTTrainer(Slopes(), desc, SGDConfig(lr=0.0), options=TORCH)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(31))
    negative = (x < 0).numpy()
    slopes = []
    for _ in range(2):
        out = np.asarray(trainer.train_step(x)[1])
        assert np.array_equal(out[~negative], x.numpy()[~negative])
        slopes.append(out[negative] / x.numpy()[negative])
    for drawn in slopes:
        assert drawn.min() >= 0.1 - 1e-6 and drawn.max() <= 0.3 + 1e-6 and len(np.unique(drawn)) > 100
        check(abs(float(drawn.mean()) - 0.2), 5 * 0.2 / np.sqrt(12) / np.sqrt(drawn.size), "mean slope")
    assert not np.array_equal(slopes[0], slopes[1])  # drawn anew


def test_the_gradient_multiplies_by_the_slopes_the_forward_drew():
    """d(mean of RReLU(x · s)²)/ds at s = 1 is 2 · mean(out²) if the backward reads the forward's slopes (other
    slopes move it by ~10%): one SGD step of 2^-10 moves the scale by it. The new scale is rounded to 2^-24, g read
    back to 2^-14 absolute; the graph's float32 sum of 2048 terms to 2048 · 2^-24 relative; bound 4x both (observed
    0.02 of it)."""
    model = Slopes()
    trainer = ORTTrainer(model, {"inputs": [("x", ["b", 64])], "outputs": [("loss", [], True), ("out", ["b", 64])]},
                         SGDConfig(lr=2.0 ** -10), options=TORCH)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(37))
    out = np.asarray(trainer.train_step(x)[1]).astype(np.float64)
    trainer.update_torch_model()
    gradient = (1.0 - float(model.scale.detach())) * 2.0 ** 10
    expected = 2.0 * (out * out).sum() / out.size  # d(mean(out²))/ds = 2·mean(out · out/s) at s = 1
    check(abs(gradient - expected) / abs(expected), 4 * (2.0 ** -14 / abs(expected) + 2048 * FLOAT32), "gradient")
