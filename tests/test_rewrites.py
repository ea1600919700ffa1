"""Every speed pass gives the same gradients as the graph without it, checked against float64 PyTorch."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.optim import SGDConfig
from tolerances import FLOAT64, check

VOCAB, HIDDEN = 40, 16
# Gradients in float32 (one step of ONNX Runtime, with or without a pass) against float64 PyTorch:
# the difference is the float32 rounding (float64's is 2^-29 times smaller). A gradient ends a chain
# of sums, the forward's and then the backward's, and the errors along a chain add (Higham's bound:
# a sum of n terms is off by ≤ n·u of their magnitudes). MaskedLM's forward adds ≈ 230 terms in
# sequence (embeddings 3, dense 17, the GELU's 8 operations, back 65, LayerNorm 2·16, head 17,
# log-softmax 40, mean ≤ 48), its backward as many: ≈ 2·230·u = 2.7e-5 of the gradient's magnitude
# (‖Δ‖/‖g‖) in the worst case; the value kept is below it. Observed at 1 and 2 threads: ≤ 4.4e-7,
# 23x under.
GRAD_BOUND = 1e-5


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


ONNXRUNTIME = pytest.param("onnxruntime", marks=pytest.mark.skipif(
    not _runtime.has_training_build(), reason="the 'onnxruntime' gradient source needs onnxruntime-training 1.19.2"))
TORCH = pytest.param("torch", marks=pytest.mark.skipif(
    not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript"))
SOURCES = [ONNXRUNTIME, TORCH]


def _ort_grads(model, batch, fetch_loss_only=False, source="auto", **passes):
    options = {"graph_optimizations": passes, "graph": {"gradient_source": source}}
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.0), options=options)
    if fetch_loss_only:
        trainer._train_step_info.fetches = ["loss"]
    trainer.train_step(*batch)
    grads = {w: g.numpy().copy() for w, g in trainer._engine.grads.items()}
    return trainer, grads


def _assert_close(got, expected, rtol=GRAD_BOUND):
    for name, value in expected.items():
        error = np.linalg.norm(got[name] - value) / max(np.linalg.norm(value), 1e-12)
        check(error, rtol, f"{name}: relative error")


def _ops(trainer):
    """Operator types of the trainer's (symbolic, all-outputs) gradient graph."""
    return {n.op_type for n in trainer._graphs.gradient.graph.node}


ALL_OFF = {"shape_specialization": False, "sparse_labels": False, "cross_entropy": False,
           "embedding_gradient": False, "fast_gelu_gradient": False, "integer_powers": False, "gelu": False,
           "tied_embedding_gradient": False}  # (it drops identity Transposes too)


def _one_hot_scatters(trainer):
    """ScatterElements nodes without a reduction: the torch decomposition's one-hot of the labels."""
    return [n for n in trainer._graphs.gradient.graph.node if n.op_type == "ScatterElements"
            and all(a.s in (b"", b"none") for a in n.attribute if a.name == "reduction")]


def _scatter_adds(trainer):
    return [n for n in trainer._graphs.gradient.graph.node if n.op_type == "ScatterElements"
            and any(a.name == "reduction" and a.s == b"add" for a in n.attribute)]


# (source, pass, operator types present with the pass on, absent with it on but present with it off)
PASS_CASES = [
    ("onnxruntime", "cross_entropy", {"LogSoftmax", "GatherElements"}, {"SoftmaxCrossEntropyLoss", "LogSoftmaxGrad"}),
    ("onnxruntime", "embedding_gradient", {"ScatterElements"}, {"GatherGrad"}),
    ("onnxruntime", "fast_gelu_gradient", {"Tanh"}, {"FastGeluGrad"}),
    ("torch", "integer_powers", {"Tanh", "Mul"}, {"Pow"}),
]


@pytest.mark.parametrize("source, name, present, absent", [
    pytest.param(*case, marks=(ONNXRUNTIME if case[0] == "onnxruntime" else TORCH).marks, id=f"{case[0]}-{case[1]}")
    for case in PASS_CASES])
def test_each_gradient_pass_matches_float64_pytorch(source, name, present, absent):
    model, batch = MaskedLM(), _batch()
    expected = _reference_grads(model, batch)
    off_trainer, without = _ort_grads(copy.deepcopy(model), batch, source=source, **ALL_OFF)
    on_trainer, with_pass = _ort_grads(copy.deepcopy(model), batch, source=source, **{**ALL_OFF, name: True})
    ops_on, ops_off = _ops(on_trainer), _ops(off_trainer)
    assert present <= ops_on and not (absent & ops_on), ops_on
    assert absent & ops_off  # the pass really changed the graph
    _assert_close(without, expected)
    _assert_close(with_pass, expected)


@pytest.mark.parametrize("repeat", range(3))
@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
def test_torch_cross_entropy_backward_is_one_scatter_add(repeat):
    """The decomposed log-softmax + NLL backward (a one-hot over the vocabulary, five passes) becomes
    exp(Y)·w with -w added at the label; ignored rows (w = 0) stay zero. Repeated: ScatterElements
    runs on 2 threads, and a racy scatter would show up as a wrong gradient now and then."""
    model, batch = MaskedLM(), _batch(repeat)
    expected = _reference_grads(model, batch)
    off_trainer, without = _ort_grads(copy.deepcopy(model), batch, source="torch", **ALL_OFF)
    on_trainer, with_pass = _ort_grads(copy.deepcopy(model), batch, source="torch",
                                       **{**ALL_OFF, "cross_entropy": True})
    assert len(_one_hot_scatters(off_trainer)) == 1 and not _one_hot_scatters(on_trainer)
    assert len(_scatter_adds(on_trainer)) == len(_scatter_adds(off_trainer)) + 1
    assert sum(n.op_type == "Sub" for n in on_trainer._graphs.gradient.graph.node) < \
        sum(n.op_type == "Sub" for n in off_trainer._graphs.gradient.graph.node)
    _assert_close(without, expected)
    _assert_close(with_pass, expected)


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
@pytest.mark.parametrize("reduction, ignore_index, weighted", [
    ("mean", -100, False), ("sum", -100, False), ("mean", 3, False), ("mean", -100, True)])
def test_torch_cross_entropy_backward_per_reduction(reduction, ignore_index, weighted):
    """Each spelling of the loss (mean, sum, an ignored class that occurs) gets the rewrite and keeps
    the gradients of float64 PyTorch; with class weights the weight is one per class, not per row,
    so the pass leaves that graph alone."""
    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
            self.out = torch.nn.Linear(HIDDEN, VOCAB)
            self.register_buffer("class_weight", torch.linspace(0.5, 2.0, VOCAB), persistent=False)

        def forward(self, ids, labels):
            logits = self.out(self.embed(ids))
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=ignore_index,
                                   reduction=reduction, weight=self.class_weight if weighted else None)
            return loss, logits

    model = Classifier()
    ids, labels = _batch(4)
    labels = ids.clone()
    labels[0, :5] = 3 if ignore_index == 3 else labels[0, :5]
    expected = _reference_grads(model, (ids, labels))
    trainer, grads = _ort_grads(copy.deepcopy(model), (ids, labels), source="torch",
                                **{**ALL_OFF, "cross_entropy": True})
    assert bool(_one_hot_scatters(trainer)) == weighted
    _assert_close(grads, expected)


def _identity_transposes(trainer):
    return [n for n in trainer._graphs.gradient.graph.node if n.op_type == "Transpose"
            and list(n.attribute[0].ints) == list(range(len(n.attribute[0].ints)))]


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with onnxscript")
def test_torch_embedding_gradient_drops_identity_transposes():
    """On the torch source the embedding gradient is ScatterElements(add) with or without the pass
    (the exporter's ScatterND(add) races on 2 threads, so it is rewritten for correctness); the pass
    drops the identity Transposes that the index / index_put decompositions put around it."""
    model, batch = MaskedLM(), _batch(5)
    expected = _reference_grads(model, batch)
    found = {}
    for flag in (False, True):
        trainer, grads = _ort_grads(copy.deepcopy(model), batch, source="torch",
                                    **{**ALL_OFF, "embedding_gradient": flag})
        ops = _ops(trainer)
        assert "ScatterElements" in ops and "ScatterND" not in ops
        found[flag] = len(_identity_transposes(trainer))
        _assert_close(grads, expected)
    assert found[False] > 0 and found[True] == 0, found


@pytest.mark.parametrize("source", SOURCES)
def test_all_passes_on_match_float64_pytorch(source):
    model, batch = MaskedLM(), _batch(2)
    expected = _reference_grads(model, batch)
    _, grads = _ort_grads(copy.deepcopy(model), batch, fetch_loss_only=True, source=source)  # defaults: all on
    _assert_close(grads, expected)


def test_fast_gelu_gradient_formula_at_extreme_inputs():
    """The closed form stays finite and exact where tanh saturates."""
    x = torch.tensor([-30.0, -5.0, -1e-3, 0.0, 1e-3, 2.0, 30.0], dtype=torch.float64, requires_grad=True)
    F.gelu(x, approximate="tanh").sum().backward()
    k, c = math.sqrt(2 / math.pi), 0.044715
    t = torch.tanh(k * (x + c * x ** 3))
    formula = 0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * k * (1 + 3 * c * x ** 2)
    # both in float64, ≈ 20 operations each: ≤ 20·u64 of the terms' magnitudes (≤ 1.1) each. Where
    # tanh saturates 1 − t² keeps only t's last bits: t within an ulp of 1 (u64), 1 − t² within
    # 2·u64, times 0.5·x·k·(1 + 3c·x²) ≤ 9 at |x| = 5: ≤ 18·u64 (the value is ≈ 1 at x = 5, ≈ 0 at
    # x = −5). Two sides: ≤ 2·(22 + 18)·u64 = 80·u64 at x = 5, 36·u64 at x = −5, within
    # 64·u64·(1 + |value|). Observed: 3.0e-16 (2.7·u64), 24x under.
    torch.testing.assert_close(formula, x.grad, rtol=64 * FLOAT64, atol=64 * FLOAT64)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("embedding_gradient", [False, True])
def test_embedding_padding_idx_gets_no_gradient_like_pytorch(embedding_gradient, source):
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
    _, grads = _ort_grads(copy.deepcopy(model), (ids, labels), source=source,
                          **{**ALL_OFF, "embedding_gradient": embedding_gradient})
    assert np.abs(grads["embed.weight"][0]).sum() == 0
    _assert_close(grads, expected)
