"""Diagonals train: the gradient of ``torch.diagonal`` (``torch.diag``, ``Tensor.diagonal``) and writes into a
diagonal (``x.diagonal().add_(...)``, ``torch.diagonal_scatter``, ``fill_diagonal_``), which stopped the ``torch``
route's joint trace (torch's reference of ``diagonal_scatter`` writes into a view) or its translation
(``fill_diagonal_``'s ``as_strided_scatter``): ``graph/gradient/diagonals.py``, ``graph/export/rewritten_functions.py``.
The rewrites against torch's own functions (exactly: they move values, no arithmetic), and self-supervised losses
built on diagonals trained against PyTorch."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from ort_trainer import _runtime
from ort_trainer.graph.export.rewritten_functions import fill_diagonal_
from ort_trainer.graph.gradient.diagonals import diagonal_backward, diagonal_scatter
from models import sgd_steps_as_pytorch
from tolerances import steps_bound



@pytest.mark.parametrize("shape", [(4, 6), (6, 4), (5, 5), (3, 4, 5), (2, 3, 4, 5)], ids=str)
def test_diagonal_scatter_and_backward_equal_torchs_for_every_dim_pair_and_offset(shape):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, generator=generator)
    for dim1, dim2 in itertools.permutations(range(-len(shape), len(shape)), 2):
        if dim1 % len(shape) == dim2 % len(shape):
            continue
        for offset in range(-max(shape) - 1, max(shape) + 2):
            src = torch.randn(torch.diagonal(x, offset, dim1, dim2).shape, dtype=x.dtype, generator=generator)
            case = f"dims {dim1}, {dim2}, offset {offset}"
            assert torch.equal(diagonal_scatter(x, src, offset, dim1, dim2),
                               torch.diagonal_scatter(x, src, offset, dim1, dim2)), case
            assert torch.equal(diagonal_backward(src, list(shape), offset, dim1, dim2),
                               torch.ops.aten.diagonal_backward(src, list(shape), offset, dim1, dim2)), case


@pytest.mark.parametrize("shape", [(4, 4), (7, 3), (3, 7), (8, 3), (1, 5), (5, 1), (3, 3, 3), (2, 2, 2, 2)], ids=str)
@pytest.mark.parametrize("wrap", [False, True])
def test_fill_diagonal_fills_torchs_positions_in_place(shape, wrap):
    ours = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    theirs = ours.clone()
    assert fill_diagonal_(ours, -7.0, wrap) is ours
    theirs.fill_diagonal_(-7.0, wrap)
    assert torch.equal(ours, theirs)


class SelfSupervised(torch.nn.Module):
    """Two views of a batch through one encoder, scored three ways: Barlow Twins (the cross-correlation's diagonal
    pulled to 1, ``torch.diagonal``, and the rest to 0), VICReg's covariance term (a diagonal zeroed in place) and
    a SimCLR-style contrastive loss (each sample's similarity with itself masked by ``fill_diagonal_``)."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))

    def forward(self, a, b):
        za, zb = self.encoder(a), self.encoder(b)
        na, nb = (za - za.mean(0)) / (za.std(0) + 1e-4), (zb - zb.mean(0)) / (zb.std(0) + 1e-4)
        correlation = na.T @ nb / a.shape[0]
        barlow = (torch.diagonal(correlation) - 1).pow(2).sum() + 0.01 * correlation.pow(2).sum()
        barlow = barlow - 0.01 * torch.diag(correlation).pow(2).sum()
        covariance = (za - za.mean(0)).T @ (za - za.mean(0)) / (a.shape[0] - 1)
        covariance.diagonal().zero_()
        vicreg = covariance.pow(2).sum() / za.shape[1]
        z = F.normalize(torch.cat([za, zb]), dim=1)
        similarity = (z @ z.T / 0.5).fill_diagonal_(float("-inf"))
        n = a.shape[0]
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
        return barlow + vicreg + F.cross_entropy(similarity, targets)


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the torch route exports with onnxscript")
def test_self_supervised_losses_on_diagonals_train_as_pytorch():
    """The ``torch`` route (the ``onnxruntime`` route's TorchScript export has no ``aten::diag``, and refuses it)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 6, generator=generator), torch.randn(8, 6, generator=generator)) for _ in range(4)]
    desc = {"inputs": [("a", [8, 6]), ("b", [8, 6])], "outputs": [("loss", [], True)]}
    # float32 sums of at most 16 terms a step (the similarities' softmax over 2·8 samples), carried through the
    # weights; the standardisation divides by standard deviations ~1
    sgd_steps_as_pytorch(SelfSupervised(), desc, batches, 0.05, lambda step: steps_bound(step + 1, length=16),
                         {"graph": {"gradient_source": "torch"}})
