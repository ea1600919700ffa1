"""``Tensor.uniform_(a, b)`` in the forward (noise drawn into a new tensor; ``torch.distributions.Laplace.rsample``),
whose reference ``prims.uniform`` torch's exporter cannot translate, is a uniform draw of the graph scaled to
[a, b) (``graph/gradient/backward_decompositions.py``): drawn anew at each step, as PyTorch's."""

import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.optim import SGDConfig
from tolerances import check

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")


class Noisy(torch.nn.Module):
    """Returns the noise it adds (drawn with ``uniform_(-0.5, 1.5)``) and a Laplace sample of its weight."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(64))

    def forward(self, x):
        noise = x.new_empty(x.shape).uniform_(-0.5, 1.5)
        sample = torch.distributions.Laplace(self.weight, 1.0).rsample()
        return ((x + noise).sum() + sample.sum()) * 0.0, noise, sample


def test_uniform_draws_span_their_interval_anew_at_each_step():
    """20 steps of 64 × 64 draws: all in [-0.5, 1.5), their mean 0.5 within 5σ = 5 · 2/sqrt(12) / sqrt(81920)
    (0.01), no two steps alike; the Laplace samples' mean absolute value 1 within 5σ = 5 · 1 / sqrt(1280)."""
    torch.manual_seed(0)
    trainer = ORTTrainer(Noisy(), {"inputs": [("x", [64, 64])], "outputs": [("loss", [], True), ("noise", [64, 64]),
                                                                           ("sample", [64])]},
                         SGDConfig(lr=0.0), options={"graph": {"gradient_source": "torch"}})
    x = torch.zeros(64, 64)
    draws = [trainer.train_step(x) for _ in range(20)]
    noise = np.stack([np.asarray(d[1]) for d in draws])
    samples = np.stack([np.asarray(d[2]) for d in draws])
    assert noise.min() >= -0.5 and noise.max() < 1.5
    check(abs(noise.mean() - 0.5), 5 * (2 / np.sqrt(12)) / np.sqrt(noise.size), "uniform mean")
    assert len({d.tobytes() for d in noise}) == 20
    check(abs(np.abs(samples).mean() - 1.0), 5 / np.sqrt(samples.size), "Laplace mean |sample|")
