"""``torch.searchsorted`` and ``Tensor.index_reduce``, which torch's exporter cannot translate, are written out
before autograd and in the eval graph (``graph/gradient/backward_decompositions.py``): a count of the sorted values below each value, and the
``scatter_reduce`` that ``index_reduce`` is. Checked against torch's own kernels (values exactly, gradients in
float64) and in training against PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from ort_trainer import _runtime
from ort_trainer.graph.gradient.backward_decompositions import index_reduce as _index_reduce
from ort_trainer.graph.gradient.backward_decompositions import searchsorted as _searchsorted
from models import sgd_steps_as_pytorch
from tolerances import FLOAT64, check, relative_error, steps_bound

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")


def test_searchsorted_counts_as_torchs_kernel_finds():
    """300 random cases: 1-d or batched sequences with ties, values between, on and past them or NaN, left and
    right (by ``right`` or ``side``), a ``sorter``, ``out_int32``, a scalar value: equal to torch's indices."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        n, m = torch.randint(1, 7, (2,), generator=generator).tolist()
        lead = [2, 3][: trial % 3]
        sequence = torch.randint(0, 5, (*lead, n), generator=generator).double().sort(-1).values
        values = torch.randint(-1, 6, (*lead, m), generator=generator).double()
        values += (torch.rand(values.shape, generator=generator) < 0.3) * 0.5
        if trial % 5 == 0:
            values[..., 0] = float("nan")
        for options in ({}, {"right": True}, {"side": "left"}, {"side": "right"}):
            assert torch.equal(_searchsorted(sequence, values, **options), torch.searchsorted(sequence, values,
                                                                                              **options))
        unsorted = torch.rand(n, generator=generator)
        order = unsorted.argsort()
        ours = _searchsorted(unsorted, values.flatten(), sorter=order, out_int32=True)
        theirs = torch.searchsorted(unsorted, values.flatten(), sorter=order, out_int32=True)
        assert torch.equal(ours, theirs) and ours.dtype == theirs.dtype == torch.int32
        assert torch.equal(_searchsorted(unsorted.sort().values, 0.5), torch.searchsorted(unsorted.sort().values,
                                                                                           0.5))


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce_values_and_float64_gradients_are_torchs(reduce, include_self):
    """Rows reduced into 4 slots along dim 1 (one slot empty, one hit three times; ties among the maxima): the
    values equal, the gradients of input and source within 10·2^-53 of torch's kernels' (a product of at most 4
    factors and its quotients)."""
    generator = torch.Generator().manual_seed(1)
    index = torch.tensor([0, 2, 0, 3, 0])
    source = torch.randn(3, 5, 2, dtype=torch.float64, generator=generator).round(decimals=1).requires_grad_()
    start = torch.randn(3, 4, 2, dtype=torch.float64, generator=generator).requires_grad_()
    weights = torch.randn(3, 4, 2, dtype=torch.float64, generator=generator)
    ours = _index_reduce(start, 1, index, source, reduce, include_self=include_self)
    theirs = start.index_reduce(1, index, source, reduce, include_self=include_self)
    assert torch.equal(ours, theirs)
    got = torch.autograd.grad((ours * weights).sum(), (start, source))
    want = torch.autograd.grad((theirs * weights).sum(), (start, source))
    for name, a, b in zip(("input", "source"), got, want):
        check(relative_error(a, b), 10 * FLOAT64, f"{reduce} gradient of the {name}")


class Bucketed(torch.nn.Module):
    """Features bucketed by learned boundaries (``searchsorted``) and pooled per group (``index_reduce``)."""

    def __init__(self):
        super().__init__()
        self.project, self.embed, self.head = torch.nn.Linear(4, 4), torch.nn.Embedding(5, 4), torch.nn.Linear(8, 3)
        self.register_buffer("edges", torch.tensor([-1.0, -0.3, 0.3, 1.0]))

    def forward(self, x, groups, y):
        h = torch.tanh(self.project(x))
        buckets = torch.searchsorted(self.edges, h[:, 0].detach().contiguous())
        pooled = torch.zeros(3, 4).index_reduce(0, groups, h, "amax", include_self=False)
        return F.cross_entropy(self.head(torch.cat([self.embed(buckets), pooled[groups]], 1)), y)


def test_a_model_bucketing_and_pooling_trains_and_evaluates_as_pytorch():
    """Trained, then evaluated at another batch size (an eval graph of its own, from the eval-mode trace): the eval
    graph writes both out too (it had neither: "no translation for aten.searchsorted.Tensor")."""
    torch.manual_seed(2)
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(6, 4, generator=generator), torch.tensor([0, 1, 0, 2, 1, 0]),
                torch.randint(0, 3, (6,), generator=generator)) for _ in range(3)]
    desc = {"inputs": [("x", ["b", 4]), ("groups", ["b"]), ("y", ["b"])], "outputs": [("loss", [], True)]}
    # float32 sums of at most 8 terms per step, carried through the weights
    trainer, reference = sgd_steps_as_pytorch(Bucketed(), desc, batches, 0.1,
                                              lambda step: steps_bound(step + 1, length=8),
                                              {"graph": {"gradient_source": "torch"}})
    evaluated = [t[:4] for t in batches[0]]
    with torch.no_grad():
        want = float(reference.eval()(*evaluated))
    check(relative_error(float(trainer.eval_step(*evaluated)), want), steps_bound(4, length=8), "eval_step")
