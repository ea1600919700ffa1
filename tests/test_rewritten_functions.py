"""torch functions the export computes with other operators (``graph/export/rewritten_functions.py``): ``F.bilinear``
(``nn.Bilinear``, ATen's ``_trilinear``, which torch's exporter cannot translate) as an ``einsum``,
``F.embedding(sparse=True)`` with a dense gradient, and ``torch.combinations`` as a gather. (``fill_diagonal_`` is
tested with the other diagonals, ``test_diagonals.py``.)"""

import pytest
import torch
import torch.nn.functional as F

from ort_trainer import _runtime
from ort_trainer.graph.export.rewritten_functions import bilinear, combinations
from models import classified_batches, sgd_steps_as_pytorch
from tolerances import FLOAT64, check, relative_error, steps_bound


@pytest.mark.parametrize("batch", [(), (5,), (2, 3)], ids=["unbatched", "batch", "two batch dims"])
@pytest.mark.parametrize("bias", [True, False])
def test_bilinear_values_and_gradients_are_torchs_in_float64(batch, bias):
    """Sums of in1 · in2 = 12 products each way, in another order: 12 · 2^-53 of the terms' magnitude, x10."""
    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=generator)  # noqa: E731
    inputs = [make(*batch, 3), make(*batch, 4), make(2, 3, 4), make(2) if bias else None]
    ours = [t.clone().requires_grad_() if t is not None else None for t in inputs]
    theirs = [t.clone().requires_grad_() if t is not None else None for t in inputs]
    got, want = bilinear(*ours), F.bilinear(*theirs)
    weights = make(*want.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    check(relative_error(got.detach(), want.detach()), 10 * 12 * FLOAT64, "values")
    for mine, torchs, name in zip(ours, theirs, ("input1", "input2", "weight", "bias")):
        if mine is not None:
            check(relative_error(mine.grad, torchs.grad), 10 * 12 * FLOAT64, f"gradient of {name}")


class Biaffine(torch.nn.Module):
    """A biaffine scorer (dependency parsers, link prediction): nn.Bilinear of two projections of the input."""

    def __init__(self):
        super().__init__()
        self.head, self.dependent = torch.nn.Linear(6, 5), torch.nn.Linear(6, 4)
        self.score = torch.nn.Bilinear(5, 4, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.score(torch.tanh(self.head(x)), torch.tanh(self.dependent(x))), y)


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the torch route exports with onnxscript")
def test_nn_bilinear_trains_as_pytorch():
    torch.manual_seed(0)
    batches = classified_batches(3, rows=6, features=6, seed=1)
    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    # float32 sums of at most 20 terms (the bilinear form's 5 · 4 products), carried through the weights
    sgd_steps_as_pytorch(Biaffine(), desc, batches, 0.1, lambda step: steps_bound(step + 1, length=20),
                         {"graph": {"gradient_source": "torch"}})


class SparseBag(torch.nn.Module):
    """A recommender's tables with sparse gradients (``nn.Embedding(sparse=True)``; one with a padding row)."""

    def __init__(self):
        super().__init__()
        self.users = torch.nn.Embedding(10, 4, sparse=True)
        self.items = torch.nn.Embedding(12, 4, padding_idx=0, sparse=True)

    def forward(self, user, item, rating):
        return F.mse_loss((self.users(user) * self.items(item)).sum(-1), rating)


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the torch route exports with onnxscript")
def test_sparse_embedding_gradients_train_as_pytorchs_sparse_sgd():
    """The graph's gradient is dense: torch.optim.SGD's sparse step moves the same rows by the same amounts.
    (torch's own sparse gradient stopped the export: no translation for aten._sparse_coo_tensor_with_dims...)"""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 10, (8,), generator=generator), torch.randint(0, 12, (8,), generator=generator),
                torch.rand(8, generator=generator)) for _ in range(3)]
    desc = {"inputs": [("user", ["batch"]), ("item", ["batch"]), ("rating", ["batch"])],
            "outputs": [("loss", [], True)]}
    # float32 sums of at most 8 terms (the batch's mean; a row's gradient sums its repeats), through the weights
    sgd_steps_as_pytorch(SparseBag(), desc, batches, 0.5, lambda step: steps_bound(step + 1, length=8),
                         {"graph": {"gradient_source": "torch"}})


@pytest.mark.parametrize("size, r", [(5, 2), (4, 3), (3, 1), (2, 3), (1, 2), (4, 4)])
@pytest.mark.parametrize("with_replacement", [False, True])
def test_combinations_are_torchs_in_order(size, r, with_replacement):
    values = torch.arange(10.0, 10.0 + size)
    expected = torch.combinations(values, r, with_replacement)
    got = combinations(values, r, with_replacement)
    assert got.shape == expected.shape and torch.equal(got, expected)


class PairwiseInteractions(torch.nn.Module):
    """A factorisation machine's pairwise feature interactions: every pair of 5 fields' embeddings, dotted."""

    def __init__(self):
        super().__init__()
        self.fields = torch.nn.Linear(4, 5 * 3)
        self.head = torch.nn.Linear(10, 3)

    def forward(self, x, y):
        fields = self.fields(x).view(-1, 5, 3)
        pairs = torch.combinations(torch.arange(5), 2)
        return F.cross_entropy(self.head((fields[:, pairs[:, 0]] * fields[:, pairs[:, 1]]).sum(-1)), y)


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the torch route exports with onnxscript")
def test_pairwise_interactions_from_combinations_train_as_pytorch():
    """torch's own combinations stopped the export ("Pending unbacked symbols": masked_select of a triangle)."""
    torch.manual_seed(0)
    batches = classified_batches(3, rows=6, features=4, seed=2)
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    # float32 sums of at most 10 terms (the head's 10 interactions), carried through the weights
    sgd_steps_as_pytorch(PairwiseInteractions(), desc, batches, 0.1, lambda step: steps_bound(step + 1, length=10),
                         {"graph": {"gradient_source": "torch"}})


class Seq2Seq(torch.nn.Module):
    """``nn.Transformer`` as a seq2seq tutorial writes it: a causal ``tgt_mask`` that its decoder compares with the
    causal mask (``_detect_is_causal_mask``: a read of the mask's values, which stopped the export), padding masks,
    batch first (torch 2.11's export dropped the ``contiguous()`` before a ``view`` in its attention, which the
    joint trace then failed on: ``before_autograd`` makes such views reshapes)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8, padding_idx=0)
        self.transformer = torch.nn.Transformer(8, 2, 1, 1, 16, 0.0, batch_first=True)
        self.head = torch.nn.Linear(8, 20)

    def forward(self, source, target):
        padding = source == 0
        mask = torch.nn.Transformer.generate_square_subsequent_mask(target.shape[1] - 1)
        h = self.transformer(self.embed(source), self.embed(target[:, :-1]), tgt_mask=mask,
                             src_key_padding_mask=padding, memory_key_padding_mask=padding)
        return F.cross_entropy(self.head(h).flatten(0, 1), target[:, 1:].flatten())


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the torch route exports with onnxscript")
def test_nn_transformer_with_a_causal_mask_trains_and_evaluates_as_pytorch():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)

    def batch():
        source = torch.randint(1, 20, (4, 7), generator=generator)
        target = torch.randint(1, 20, (4, 6), generator=generator)
        source[1, 4:] = 0
        return source, target

    desc = {"inputs": [("source", ["batch", 7]), ("target", ["batch", 6])], "outputs": [("loss", [], True)]}
    # float32 sums of at most 16 terms (the feed-forward width), through 2 attention blocks and the head: x10
    bound = lambda step: steps_bound(step + 1, length=16, factor=10)  # noqa: E731
    trainer, reference = sgd_steps_as_pytorch(Seq2Seq(), desc, [batch() for _ in range(3)], 0.1, bound,
                                              {"graph": {"gradient_source": "torch"}})
    source, target = batch()
    reference.eval()
    with torch.no_grad():
        expected = float(reference(source, target))
    check(relative_error(float(trainer.eval_step(source, target)), expected), bound(3), "eval_step")
