"""``kthvalue``, ``median`` and ``nanmedian`` (along a dimension, or of a whole tensor), which torch's ONNX exporter
cannot translate, are written with a sort and a gather (``graph/gradient/order_statistics.py``): the same values
and indices as torch's, and models using them train and evaluate as in PyTorch on the ``torch`` route."""

import itertools

import numpy as np
import pytest
import torch

from ort_trainer import _runtime
from ort_trainer.graph.gradient.order_statistics import (cummax, cummin, kthvalue, median, median_dim, nanmedian,
                                                         nanmedian_dim)
from models import classified_batches, sgd_steps_as_pytorch
from tolerances import FLOAT64, check, relative_error, steps_bound

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))


def test_the_decompositions_are_torchs():
    """Values always; indices where no values tie (a row of NaNs: nanmedian's index is torch's own choice)."""
    torch.manual_seed(41)
    for trial in range(30):
        x = torch.randn(5, 7)
        if trial % 2:
            x[1, 2] = float("nan")
        for dim, keepdim in itertools.product((0, 1, -1), (False, True)):
            pairs = ((lambda t: kthvalue(t, 3, dim, keepdim), lambda t: torch.kthvalue(t, 3, dim, keepdim)),
                     (lambda t: median_dim(t, dim, keepdim), lambda t: torch.median(t, dim, keepdim)),
                     (lambda t: nanmedian_dim(t, dim, keepdim), lambda t: torch.nanmedian(t, dim, keepdim)))
            for ours, theirs in pairs:
                values, indices = ours(x)
                want = theirs(x)
                assert _nan_equal(values, want.values) and torch.equal(indices, want.indices), (trial, dim, keepdim)
        assert _nan_equal(median(x), torch.median(x)) and _nan_equal(nanmedian(x), torch.nanmedian(x))
        tied = x.round()
        assert _nan_equal(median_dim(tied, 1)[0], torch.median(tied, 1).values)


class Statistics(torch.nn.Module):
    """Order statistics of a layer's output plus ``shift`` (which can put a NaN in one entry), their sum the loss."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 7)

    def forward(self, x, shift):
        h = self.linear(x) + shift
        rows = torch.stack([torch.kthvalue(h, 2, dim=1).values, torch.median(h, dim=1).values,
                            torch.nanmedian(h, dim=1).values], dim=1)  # [batch, 3]
        loss = rows.sum() + torch.median(h, dim=0).values.sum() + torch.median(h) * 3
        return loss, rows


def test_order_statistics_train_and_evaluate_as_pytorch():
    """Three SGD steps; then an evaluation on a batch with a NaN (median gives NaN for its row, nanmedian not)."""
    torch.manual_seed(43)
    desc = {"inputs": [("x", ["b", 6]), ("shift", ["b", 7])], "outputs": [("loss", [], True), ("rows", ["b", 3])]}
    batches = ((torch.randn(5, 6, generator=torch.Generator().manual_seed(step)), torch.zeros(5, 7))
               for step in range(3))
    # the layer's sums of 6 terms in another order, carried by the weights; observed <= 0.07 of the bound
    trainer, reference = sgd_steps_as_pytorch(Statistics(), desc, batches, 0.05, lambda step: steps_bound(step + 1),
                                              {"graph": {"gradient_source": "torch"}})
    x, shift = torch.randn(5, 6, generator=torch.Generator().manual_seed(9)), torch.zeros(5, 7)
    shift[2, 3] = float("nan")
    with torch.no_grad():
        want = reference(x, shift)[1]
    got = torch.from_numpy(np.asarray(trainer.eval_step(x, shift)[1]))
    # row 2: median NaN; kthvalue NaN only if the NaN sorts into its place (torch: NaN is the largest); nanmedian not
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want[2, 1]) and not torch.isnan(want[2, 2])
    check(relative_error(got.nan_to_num(0).numpy(), want.nan_to_num(0).numpy()), steps_bound(4), "eval rows")


def test_the_running_maximum_and_minimum_are_torchs():
    """300 random tensors of 1 to 3 dims of small integers (ties everywhere), some with a NaN, some int64, every
    dim: values and indices equal to torch's kernels' (a tie: the later index; after a NaN: NaN and the last
    NaN's index); float64 gradients equal too (the gradient goes to the index, as torch's backward scatters it)."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        shape = torch.randint(1, 5, (trial % 3 + 1,), generator=generator).tolist()
        x = torch.randint(-3, 4, shape, generator=generator).double()
        if trial % 4 == 0:
            x.view(-1)[torch.randint(0, x.numel(), (1,), generator=generator)] = float("nan")
        if trial % 7 == 0:
            x = x.long()
        dim = int(torch.randint(-x.dim(), x.dim(), (1,), generator=generator))
        for ours, theirs in ((cummax, torch.cummax), (cummin, torch.cummin)):
            (values, indices), want = ours(x, dim), theirs(x, dim)
            assert _nan_equal(values, want.values) and values.dtype == want.values.dtype, (trial, dim)
            assert torch.equal(indices, want.indices), (trial, dim)
    x = torch.randn(5, 6, dtype=torch.float64, generator=generator).round().requires_grad_()  # ties
    weights = torch.randn(5, 6, dtype=torch.float64, generator=generator)
    for ours, theirs in ((cummax, torch.cummax), (cummin, torch.cummin)):
        got = torch.autograd.grad((ours(x, 1)[0] * weights).sum(), x)[0]
        want = torch.autograd.grad((theirs(x, 1).values * weights).sum(), x)[0]
        check(relative_error(got, want), FLOAT64, f"{ours.__name__} gradient")


class Running(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.head = torch.nn.Linear(6, 7), torch.nn.Linear(7, 3)

    def forward(self, x, y):
        h = self.linear(x)
        return torch.nn.functional.cross_entropy(self.head(torch.cummax(h, 1).values + torch.cummin(h, 0).values), y)


def test_running_maxima_train_as_pytorch():
    torch.manual_seed(44)
    desc = {"inputs": [("x", ["b", 6]), ("y", ["b"])], "outputs": [("loss", [], True)]}
    batches = classified_batches(3, rows=5, features=6, seed=5)
    # the layers' sums of at most 7 terms in another order, carried by the weights (observed: equal)
    sgd_steps_as_pytorch(Running(), desc, batches, 0.1, lambda step: steps_bound(step + 1, length=7),
                         {"graph": {"gradient_source": "torch"}})


class StableRanks(torch.nn.Module):
    """Scores rounded to a few levels (many ties), sorted stably both ways; the sorted values weighted by rank."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(40))

    def forward(self, x):
        scores = x.round() * self.scale
        ascending = torch.sort(scores, dim=1, stable=True)
        descending = torch.sort(scores, dim=1, stable=True, descending=True)
        ranks = torch.arange(40, dtype=x.dtype)
        loss = (ascending.values * ranks).sum() + 0.5 * (descending.values * ranks).sum()
        return loss, ascending.indices, descending.indices


def test_a_stable_sort_gives_torchs_order_among_ties():
    """``aten.sort.stable`` (no translation) is ONNX TopK, whose ties go to the lower index as a stable sort's do:
    the indices of 6 rows of 40 values on ~9 levels equal torch's, ascending and descending; the loss (sums of 40
    terms) within float32's bound of torch's."""
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import SGDConfig

    x = 2 * torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    desc = {"inputs": [("x", [6, 40])], "outputs": [("loss", [], True), ("ascending", [6, 40]),
                                                    ("descending", [6, 40])]}
    trainer = ORTTrainer(StableRanks(), desc, SGDConfig(lr=0.0), options={"graph": {"gradient_source": "torch"}})
    loss, ascending, descending = trainer.train_step(x)
    want, want_ascending, want_descending = StableRanks()(x)
    assert torch.equal(torch.as_tensor(np.asarray(ascending)), want_ascending)
    assert torch.equal(torch.as_tensor(np.asarray(descending)), want_descending)
    check(relative_error(float(loss), float(want.detach())), steps_bound(1, length=40), "loss")
