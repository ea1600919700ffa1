"""Every speed pass gives the same gradients as the graph without it, checked against float64 PyTorch."""

import copy
import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer
from ort_trainer.optim import SGDConfig

VOCAB, HIDDEN = 40, 16


class MaskedLM(torch.nn.Module):
    """Embeddings (token + position + a one-row type table), a tanh-GELU block and a tied LM head."""

    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.positions = torch.nn.Embedding(32, HIDDEN)
        self.types = torch.nn.Embedding(2, HIDDEN)
        self.dense = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.back = torch.nn.Linear(4 * HIDDEN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.bias = torch.nn.Parameter(torch.zeros(VOCAB))

    def forward(self, ids, labels):
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        x = self.tokens(ids) + self.positions(positions) + self.types(torch.zeros_like(ids))
        h = self.dense(x)  # GPT-2's tanh GELU, written out: ONNX Runtime fuses it into FastGelu
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        x = self.norm(x + self.back(h))
        logits = x @ self.tokens.weight.T + self.bias
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return loss, logits


DESC = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])]}


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 12), generator=gen)
    ids[:, :3] = 7  # repeated rows: the embedding gradient must add them all up
    labels = ids.clone()
    labels[torch.rand(4, 12, generator=gen) < 0.7] = -100
    return ids, labels


def _reference_grads(model, batch):
    double = copy.deepcopy(model).double()
    loss, _ = double(*batch)
    loss.backward()
    return {name: p.grad.numpy() for name, p in double.named_parameters()}


def _ort_grads(model, batch, fetch_loss_only=False, **passes):
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.0), options={"graph_optimizations": passes})
    if fetch_loss_only:
        trainer._train_step_info.fetches = ["loss"]
    trainer.train_step(*batch)
    grads = {w: g.numpy().copy() for w, g in trainer._engine.grads.items()}
    return trainer, grads


def _assert_close(got, expected, rtol=1e-5):
    for name, value in expected.items():
        error = np.linalg.norm(got[name] - value) / max(np.linalg.norm(value), 1e-12)
        assert error < rtol, f"{name}: relative error {error:.2e}"


def _ops(trainer):
    """Operator types of the trainer's (symbolic, all-outputs) gradient graph."""
    return {n.op_type for n in trainer._graphs.gradient.graph.node}


ALL_OFF = {"shape_specialization": False, "sparse_labels": False, "cross_entropy": False,
           "embedding_gradient": False, "fast_gelu_gradient": False}


@pytest.mark.parametrize("name, present, absent", [
    ("cross_entropy", {"LogSoftmax", "GatherElements"}, {"SoftmaxCrossEntropyLoss", "LogSoftmaxGrad"}),
    ("embedding_gradient", {"ScatterElements"}, {"GatherGrad"}),
    ("fast_gelu_gradient", {"Tanh"}, {"FastGeluGrad"}),
])
def test_each_gradient_pass_matches_float64_pytorch(name, present, absent):
    model, batch = MaskedLM(), _batch()
    expected = _reference_grads(model, batch)
    off_trainer, without = _ort_grads(copy.deepcopy(model), batch, **ALL_OFF)
    on_trainer, with_pass = _ort_grads(copy.deepcopy(model), batch, **{**ALL_OFF, name: True})
    ops_on, ops_off = _ops(on_trainer), _ops(off_trainer)
    assert present <= ops_on and not (absent & ops_on), ops_on
    assert absent & ops_off  # the pass really changed the graph
    _assert_close(without, expected)
    _assert_close(with_pass, expected)


def test_sparse_labels_only_when_logits_are_not_fetched():
    model, batch = MaskedLM(), _batch(1)
    expected = _reference_grads(model, batch)
    trainer, grads = _ort_grads(copy.deepcopy(model), batch, fetch_loss_only=True, **{**ALL_OFF, "sparse_labels": True})
    _assert_close(grads, expected)
    (sparse_session,) = [s for key, s in trainer._engine._session_sets.items() if key is not None]
    assert sparse_session.output_names == ["loss"]
    ops = {n.op_type for n in onnx.load_from_string(_graph_bytes(trainer, key=(None, ()))).graph.node}
    assert "NonZero" in ops  # the projection runs on the labelled rows only
    loss_only = trainer.train_step(*batch)
    trainer._train_step_info.fetches = []
    loss, logits = trainer.train_step(*batch)  # all outputs: the full graph again
    assert tuple(logits.shape) == (4, 12, VOCAB) and loss.item() == pytest.approx(loss_only.item(), rel=1e-6)


def _graph_bytes(trainer, key):
    gradient, _ = trainer._graphs_for(key)
    return gradient.SerializeToString()


def test_all_passes_on_match_float64_pytorch():
    model, batch = MaskedLM(), _batch(2)
    expected = _reference_grads(model, batch)
    _, grads = _ort_grads(copy.deepcopy(model), batch, fetch_loss_only=True)  # defaults: everything on
    _assert_close(grads, expected)


def test_fast_gelu_gradient_formula_at_extreme_inputs():
    """The closed form stays finite and exact where tanh saturates."""
    x = torch.tensor([-30.0, -5.0, -1e-3, 0.0, 1e-3, 2.0, 30.0], dtype=torch.float64, requires_grad=True)
    F.gelu(x, approximate="tanh").sum().backward()
    k, c = math.sqrt(2 / math.pi), 0.044715
    t = torch.tanh(k * (x + c * x ** 3))
    formula = 0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * k * (1 + 3 * c * x ** 2)
    torch.testing.assert_close(formula, x.grad)


@pytest.mark.parametrize("embedding_gradient", [False, True])
def test_embedding_padding_idx_gets_no_gradient_like_pytorch(embedding_gradient):
    """nn.Embedding(padding_idx=...) never updates that row from the lookup; the export must agree."""

    class Padded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
            self.out = torch.nn.Linear(HIDDEN, VOCAB)

        def forward(self, ids, labels):
            logits = self.out(self.embed(ids))
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits

    model = Padded()
    ids, labels = _batch(3)
    ids[:, -4:] = 0  # padding positions
    labels = ids.clone()
    expected = _reference_grads(model, (ids, labels))
    assert np.abs(expected["embed.weight"][0]).sum() == 0
    _, grads = _ort_grads(copy.deepcopy(model), (ids, labels), **{**ALL_OFF, "embedding_gradient": embedding_gradient})
    assert np.abs(grads["embed.weight"][0]).sum() == 0
    _assert_close(grads, expected)
