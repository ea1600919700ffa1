"""``torch.cdist`` (p-norms other than 2, and Euclidean distances between at most 25 rows) and ``F.pdist``, whose
kernels torch's ONNX exporter cannot translate, are written with differences and reductions
(``graph/gradient/distances.py``): torch's values and gradients, and models using them train as in PyTorch."""


import pytest
import torch
import torch.nn.functional as F

from ort_trainer import _runtime
from ort_trainer.graph.gradient.distances import _pairs, cdist_backward, cdist_forward, pdist_backward, pdist_forward
from models import sgd_steps_as_pytorch
from tolerances import FLOAT64, check, relative_error, steps_bound

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")
NORMS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")]
# float64 against torch's float64 kernels: the same differences, powers and sums of 4 terms in another order, and
# a root: ~10 roundings of 2^-53 of the largest value; bound 10x that. Observed <= 0.05 of it.
BOUND = 10 * 10 * FLOAT64


@pytest.mark.parametrize("p", NORMS)
def test_the_decompositions_are_torchs_kernels(p):
    torch.manual_seed(47)
    x1, x2 = torch.randn(2, 5, 4, dtype=torch.float64), torch.randn(2, 6, 4, dtype=torch.float64)
    x2[0, 1] = x1[0, 2]  # a distance of 0
    want = torch.ops.aten._cdist_forward(x1, x2, p, None)
    grad = torch.randn_like(want)
    check(relative_error(cdist_forward(x1, x2, p), want), BOUND, "cdist")
    check(relative_error(cdist_backward(grad, x1, x2, p, want),
                         torch.ops.aten._cdist_backward(grad, x1, x2, p, want)), BOUND, "cdist backward")
    x = torch.randn(7, 3, dtype=torch.float64)
    want = torch.ops.aten._pdist_forward(x, p)
    grad = torch.randn_like(want)
    check(relative_error(pdist_forward(x, p), want), BOUND, "pdist")
    check(relative_error(pdist_backward(grad, x, p, want), torch.ops.aten._pdist_backward(grad, x, p, want)), BOUND,
          "pdist backward")


def test_the_pairs_are_pdists_order():
    for n in (1, 2, 3, 8, 101, 1000):
        i, j = _pairs(n, torch.device("cpu"))
        assert torch.equal(torch.stack([i, j]), torch.triu_indices(n, n, 1)), n


class Distances(torch.nn.Module):
    """Embeddings of a batch: their Euclidean distances to 3 trained prototypes (cdist of few rows), Manhattan
    distances to them, and their pairwise distances (pdist)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(5, 4)
        self.prototypes = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x, y):
        e = self.embed(x)
        logits = -torch.cdist(e, self.prototypes) - 0.1 * torch.cdist(e, self.prototypes, p=1)
        return F.cross_entropy(logits, y) + 0.01 * F.pdist(e).mean()


def test_distance_models_train_as_pytorch():
    """Three SGD steps at batches of 6, 4 and 6 rows (the pairs of pdist follow the batch)."""
    torch.manual_seed(53)

    def batch(step, rows):
        g = torch.Generator().manual_seed(step)
        return torch.randn(rows, 5, generator=g), torch.randint(0, 3, (rows,), generator=g)

    # float32 sums of at most 5 terms in other orders; observed <= 0.05 of the bound
    desc = {"inputs": [("x", ["b", 5]), ("y", ["b"])], "outputs": [("loss", [], True)]}
    sgd_steps_as_pytorch(Distances(), desc, (batch(step, rows) for step, rows in enumerate([6, 4, 6])), 0.1,
                         lambda step: steps_bound(step + 1),
                         {"graph": {"gradient_source": "torch"}})
