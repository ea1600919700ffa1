"""``nn.AdaptiveLogSoftmaxWithLoss`` without PyTorch's Python branch on the batch's targets
(``ort_trainer/graph/export/adaptive_softmax.py``): the forward against PyTorch's in float64, and training against
eager PyTorch on both gradient sources, from a first batch in which a cluster has no target (PyTorch's forward
skips it in Python: a trace would have kept that outcome for every step)."""

from __future__ import annotations

import pytest
import torch

from ort_trainer import _runtime
from ort_trainer.graph.export import adaptive_softmax
from models import sgd_steps_as_pytorch
from tolerances import FLOAT64, check, relative_error, steps_bound

_CUTOFFS = [10, 30]  # head: 10 classes and 2 clusters; tails: 20 and 20 classes


def _targets_without_the_last_cluster(generator, batch):
    return torch.randint(0, 30, (batch,), generator=generator)


@pytest.mark.parametrize("targets", ["every cluster", "an empty cluster", "unbatched"])
def test_the_forward_is_pytorchs_in_float64(targets):
    """Output, loss and every gradient: the same arithmetic in the same order, up to the tails' products over a
    subset of rows (24 terms): 24 · u with a 10x margin."""
    torch.manual_seed(0)
    module = torch.nn.AdaptiveLogSoftmaxWithLoss(24, 50, _CUTOFFS, div_value=2.0).double()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(7, 24, dtype=torch.double, generator=generator, requires_grad=True)
    target = {"every cluster": torch.tensor([0, 12, 45, 3, 31, 29, 49]),
              "an empty cluster": _targets_without_the_last_cluster(generator, 7),
              "unbatched": torch.tensor(33)}[targets]
    if targets == "unbatched":
        x = x[0]
    results = []
    for compute in (type(module).forward, adaptive_softmax.forward):
        out = compute(module, x, target)
        gradients = torch.autograd.grad(out.loss + (out.output * torch.arange(1.0, out.output.numel() + 1,
                                                    dtype=torch.double).reshape(out.output.shape)).sum(),
                                        [x, *module.parameters()], allow_unused=True)
        # PyTorch's forward skips an empty cluster (no gradient for its tail): zeros here
        results.append([out.output, out.loss, *[torch.zeros_like(p) if g is None else g
                                                 for g, p in zip(gradients, [x, *module.parameters()])]])
    for got, expected in zip(results[1], results[0]):
        check(relative_error(got.detach().numpy(), expected.detach().numpy()), 10 * 24 * FLOAT64, targets)


class _LanguageModelHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.softmax = torch.nn.AdaptiveLogSoftmaxWithLoss(16, 50, _CUTOFFS, div_value=2.0)

    def forward(self, x, target):
        return self.softmax(torch.tanh(self.hidden(x)), target).loss


@pytest.mark.parametrize("source", ["torch", "onnxruntime"])
def test_adaptive_softmax_trains_as_pytorch_when_a_cluster_is_empty_in_the_traced_batch(source):
    if source == "onnxruntime" and not _runtime.has_training_build():
        pytest.skip("the 'onnxruntime' gradient source needs the onnxruntime-training 1.19.2 build")
    if source == "torch" and not _runtime.has_onnxscript():
        pytest.skip("the 'torch' gradient source exports with onnxscript")
    torch.manual_seed(0)
    desc = {"inputs": [("x", ["batch", 8]), ("target", ["batch"])], "outputs": [("loss", [], True)]}
    generator = torch.Generator().manual_seed(2)
    # the first (traced) batch leaves the last cluster empty; the later ones fill it
    batches = [(torch.randn(6, 8, generator=generator), _targets_without_the_last_cluster(generator, 6))]
    batches += [(torch.randn(6, 8, generator=generator), torch.randint(0, 50, (6,), generator=generator))
                for _ in range(3)]
    assert all((batch[1] >= 30).any() for batch in batches[1:])
    # float32 sums of at most 16 terms (the projections), carried through the weights
    sgd_steps_as_pytorch(_LanguageModelHead(), desc, batches, 0.5, lambda step: steps_bound(step + 1, length=16),
                         {"graph": {"gradient_source": source}})
