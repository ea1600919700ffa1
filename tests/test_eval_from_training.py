"""The eval graph of a model that computes the same in both modes, Dropouts aside, is the training
graph's forward part with its Dropouts removed.

The operator record (``op_record.record``) runs the forward in training and in eval mode; when eval
mode runs the very operators training mode runs with each Dropout taken for the identity (no
BatchNorm, no ``self.training`` branch that changes anything else, no Dropout that also draws in
eval mode), the eval graph is the gradient graph's forward part with each Dropout the identity
(``onnx_graph.eval_part``): the first ``eval_step`` after a cold build traces and translates nothing
more (GPT-2 small: ~1 s instead of 4-8 s). Models that compute otherwise in eval mode keep their
eval-mode trace (``test_op_record.py``, ``test_batchnorm.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import MLP, MLP_DESC, mlp_batch, tiny_gpt2
from ort_trainer import ORTTrainer
from ort_trainer.graph.export import op_record
from ort_trainer.graph.names import GRAD_SUFFIX, LOSS_SCALE_INPUT
from ort_trainer.model_desc import parse_model_desc
from ort_trainer.optim import SGDConfig
from test_op_record import _BatchNormed, _ExportCalls
from tolerances import FLOAT32, check, relative_error

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class _Dropped(MLP):
    def __init__(self, p: float):
        super().__init__()
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class _FeatureDropped(MLP):
    """A feature dropout (whole rows): its mask is drawn otherwise, so the record keeps it."""

    def forward(self, x):
        return self.fc2(F.dropout1d(torch.relu(self.fc1(x)), 0.5, self.training))


class _AlwaysDropped(MLP):
    """A dropout that draws in eval mode too (Monte Carlo dropout): eval mode is not training's
    minus its Dropouts."""

    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.5, training=True))


class _Branches(MLP):
    """An ``if self.training`` branch: tanh in training, sigmoid in eval."""

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.tanh(h) if self.training else torch.sigmoid(h))


CASES = {
    "plain MLP": (MLP, True),
    "Dropout(p=0)": (lambda: _Dropped(0.0), True),
    "Dropout(p=0.5)": (lambda: _Dropped(0.5), True),
    "feature dropout": (_FeatureDropped, False),
    "dropout in eval mode too": (_AlwaysDropped, False),
    "BatchNorm": (_BatchNormed, False),
    "self.training branch": (_Branches, False),
}


@pytest.mark.parametrize("on_fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_record_says_whether_eval_mode_runs_what_training_mode_runs(case, on_fake):
    factory, same = case
    x, y = mlp_batch(torch.Generator().manual_seed(0))
    record = op_record.record(factory(), F.cross_entropy, parse_model_desc(MLP_DESC), [x.numpy(), y.numpy()],
                              op_record.exporting_flags, on_fake=on_fake)
    assert record is not None and record.eval_is_training is same


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of the test's own (the record is taken only where there is a cache)."""
    pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / "cache"))


def _gpt2_batch():
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask, ids


def _mlp(dropout: float = 0.0):
    torch.manual_seed(0)
    return _Dropped(dropout), MLP_DESC, F.cross_entropy, mlp_batch(torch.Generator().manual_seed(1))


def _gpt2(dropout: float = 0.0):
    model, desc = tiny_gpt2(dropout=dropout)  # the embedding's, the attention's and the residual dropouts
    return model, desc, None, _gpt2_batch()


# ONNX Runtime's float32 eval forward against float64 PyTorch in eval mode, each sum within n·u of
# its terms' magnitude (Higham), adding up along the chain:
# - the MLP: fc1 (20 terms), fc2 (32), the log-sum-exp (5 classes) and the mean (8 rows): ≈ 65u;
#   bound 640u, a 10x margin.
# - the 2-layer GPT-2 of width 16: ≈ 370u for the logits (test_eval_passes.py's GPT2_LOGITS_BOUND
#   derivation), ≈ 440u with the loss's log-sum-exp over 50 classes and mean over 16 positions;
#   bound 4400u, a 10x margin.
BOUNDS = {"mlp": 640 * FLOAT32, "gpt2": 4400 * FLOAT32}


MODELS = {"mlp": (_mlp, 0.0, True), "gpt2": (_gpt2, 0.0, True),
          "mlp, Dropout(0.5)": (_mlp, 0.5, True), "gpt2, dropout 0.1": (_gpt2, 0.1, True),
          "gpt2, dropout 0.1, ONNX Dropout nodes": (_gpt2, 0.1, False)}


@pytest.mark.parametrize("name", MODELS)
def test_eval_after_training_takes_the_training_graphs_forward_part_with_no_trace(name, cache, monkeypatch):
    """With dropout, the training graph's Dropouts are ``x · m`` with ``m`` a mask the host draws
    (``host_dropout_masks``, the CPU's default) or ONNX ``Dropout`` nodes (the GPU's): the eval graph
    has neither, and computes what PyTorch computes in eval mode."""
    factory, dropout, host_masks = MODELS[name]
    model, desc, loss_fn, batch = factory(dropout)
    trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1), loss_fn=loss_fn,
                         options={"graph": {"gradient_source": "torch"},
                                  "graph_optimizations": {"host_dropout_masks": host_masks}})
    trainer.train_step(*batch)
    gradient_ops = [node.op_type for node in trainer._graphs.gradient.graph.node]
    assert (dropout > 0 and not host_masks) == ("Dropout" in gradient_ops)
    exports = _ExportCalls(monkeypatch)
    got = [np.asarray(o) for o in trainer.eval_step(*batch)]
    assert exports.calls == 0  # no eval-mode trace
    graphs = trainer._graphs
    assert graphs.eval_is_training
    eval_graph = graphs.eval
    inputs = {i.name for i in eval_graph.graph.input}
    assert LOSS_SCALE_INPUT not in inputs and inputs <= {*graphs.meta["weights"], *trainer.model_desc.input_names}
    assert [o.name for o in eval_graph.graph.output] == graphs.meta["outputs"]
    assert not any(n.endswith(GRAD_SUFFIX) for node in eval_graph.graph.node for n in node.output)
    eval_ops = {node.op_type for node in eval_graph.graph.node}
    assert "Dropout" not in eval_ops
    if name.startswith("gpt2"):  # the training form of its GELU (``gelu`` pass) as one kernel
        assert "FastGelu" in eval_ops and "Sigmoid" not in eval_ops
    # against float64 PyTorch in eval mode, with the weights the training step left
    reference = model.double().eval()
    names = trainer.model_desc.input_names
    with torch.no_grad():
        if loss_fn is None:
            out = reference(**dict(zip(names, batch)))
            expected = [out.loss, out.logits]
        else:
            logits = reference(batch[0].double())
            expected = [loss_fn(logits, batch[1]), logits]
    for what, value, want in zip(("loss", "logits"), got, expected):
        check(relative_error(value, want.numpy()), BOUNDS[factory.__name__[1:]], f"{name} {what}")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_forward_part_computes_what_the_eval_mode_trace_computes(dropout, tmp_path, monkeypatch):
    """The same model and step evaluated through the eval-mode trace's graph (the record's verdict
    turned off, in a cache of its own) and through the forward part: both float32 within the bound
    of float64 PyTorch, so within twice that of each other. With dropout the step's masks are the
    same in both runs (the trainer's seed), so the weights after it are too."""
    pytest.importorskip("onnxscript", reason="the torch gradient source exports with onnxscript")
    real = op_record.record
    results = []
    for derive in (True, False):
        monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path / f"cache-{derive}"))
        if not derive:
            monkeypatch.setattr(op_record, "record", lambda *args, **kwargs: _not_same(real(*args, **kwargs)))
        model, desc, _, batch = _gpt2(dropout)
        trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1), options={"graph": {"gradient_source": "torch"}})
        trainer.train_step(*batch)
        results.append([np.asarray(o) for o in trainer.eval_step(*batch)])
        assert trainer._graphs.eval_is_training is derive
    for what, derived, traced in zip(("loss", "logits"), *results):
        check(relative_error(derived, traced), 2 * BOUNDS["gpt2"], what)


def _not_same(record):
    """``record`` as if eval mode ran other operators."""
    return None if record is None else type(record)(record.key, eval_is_training=False)


def test_evaluating_other_outputs_than_training_fetched_builds_no_gradient_graph(cache, monkeypatch):
    """A loop that trains fetching the loss alone and then evaluates every output: the first gradient
    graph computes the logits the loss reads, so the eval graph of every output is its forward part
    (the record's verdict holds at the same sizes); that signature builds no gradient graph and makes
    no gradient session until it is trained on."""
    model, desc, _, batch = _gpt2()
    trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1), options={"graph": {"gradient_source": "torch"}})
    trainer._train_step_info.fetches = ["loss"]
    trainer.train_step(*batch)
    trainer._train_step_info.fetches = []
    exports = _ExportCalls(monkeypatch)
    loss, logits = (np.asarray(o) for o in trainer.eval_step(*batch))
    assert exports.calls == 0
    (key,) = [key for key in trainer._engine._session_sets if key[1] is None]
    assert trainer._engine._session_sets[key].training is None and key not in trainer._shapes._by_signature
    _check_against_float64(model, trainer, batch, loss, logits, BOUNDS["gpt2"])
    trainer.train_step(*batch)  # training on that signature builds its graphs and session then
    assert trainer._engine._session_sets[key].training is not None and key in trainer._shapes._by_signature


# MaskedLM (test_rewrites_sparse_labels.py) evaluated in float32 against float64 PyTorch: its forward
# adds ≈ 200 terms along its longest chain (that file's derivation): 200u; the attention of the
# variants below adds ≈ 50 more (scores over 16 features, softmax over 12 positions, the weighted sum
# of 12): 250u; bound 2000u, an 8x margin.
MLM_BOUND = 2000 * FLOAT32


class _Attending(torch.nn.Module):
    """A Dropout and an attention whose ``dropout_p`` is on in training mode only."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        heads = F.dropout(self.linear(x), 0.3, self.training).unsqueeze(1)  # (batch, 1 head, seq, features)
        return F.scaled_dot_product_attention(heads, heads, heads, dropout_p=0.2 if self.training else 0.0)[:, 0]


def _masked_lm(dropouts: bool):
    """MaskedLM, or with ``_Attending`` (a Dropout, an attention's dropout) after its embeddings."""
    from test_rewrites_sparse_labels import MaskedLM, VOCAB

    class Attending(MaskedLM):
        def __init__(self):
            super().__init__()
            self.attention = _Attending()

        def forward(self, ids, labels):
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]).unsqueeze(0))
            x = x + self.attention(x)
            x = self.norm(x + self.back(F.gelu(self.dense(x))))
            logits = x @ self.tokens.weight.T + self.bias
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100), logits

    torch.manual_seed(0)
    return Attending() if dropouts else MaskedLM()


def test_the_training_program_in_eval_mode_has_its_dropouts_off():
    """``training_in_eval_mode``: a copy of the training program with the Dropout's ``train`` and the
    attention's ``dropout_p`` off computes what eval mode computes (float64: the same operators in
    the same order, so equal to 1e-12), and leaves the training program as it was; a program that
    draws random numbers otherwise gets None (only an eval-mode trace says what eval mode does)."""
    from ort_trainer.graph.gradient import eval_program

    torch.manual_seed(0)
    model = _Attending().double().train()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    program = torch.export.export(model, (x,))
    before = str(program.graph)
    converted = eval_program.training_in_eval_mode(program)
    assert str(program.graph) == before and "True" in before and "0.2" in before
    with torch.no_grad():
        expected = model.eval()(x)
    check(relative_error(converted.module()(x).detach(), expected.numpy()), 1e-12, "eval-mode output")

    class Noisy(torch.nn.Module):
        def forward(self, x):
            return x * torch.bernoulli(torch.full_like(x, 0.5))

    assert eval_program.training_in_eval_mode(torch.export.export(Noisy().train(), (x,))) is None


@pytest.mark.parametrize("dropouts", [False, True], ids=["MaskedLM", "with dropouts"])
def test_every_output_after_a_sparse_labels_loop_builds_the_eval_graph_alone(dropouts, cache, monkeypatch):
    """With ``sparse_labels`` the loss-only gradient graph projects the labelled rows alone: it has
    no logits to give. The every-output eval graph is then built alone (no gradient graph of that
    signature), from the training trace with its Dropouts and the attention's ``dropout_p`` turned
    off (``eval_program.training_in_eval_mode``), kept before the gradient build edited it: no
    eval-mode trace."""
    from test_rewrites_sparse_labels import DESC, _batch

    model = _masked_lm(dropouts)
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.1), options={"graph": {"gradient_source": "torch"}})
    trainer._train_step_info.fetches = ["loss"]
    batch = _batch()
    trainer.train_step(*batch)
    assert trainer._shapes.first.eval_is_training
    assert "logits" not in {o for node in trainer._shapes.first.gradient.graph.node for o in node.output}
    trainer._train_step_info.fetches = []
    calls, built, make = _ExportCalls(monkeypatch), [], trainer._shapes._eval_graph
    monkeypatch.setattr(trainer._shapes, "_eval_graph", lambda signature: built.append(make(signature)) or built[-1])
    loss, logits = (np.asarray(o) for o in trainer.eval_step(*batch))
    assert calls.calls == 0
    (key,) = [key for key in trainer._engine._session_sets if key[1] is None]
    assert key not in trainer._shapes._by_signature
    (eval_graph,) = built
    assert LOSS_SCALE_INPUT not in {i.name for i in eval_graph.graph.input}
    assert not {"Dropout", "RandomUniformLike", "Bernoulli"} & {n.op_type for n in eval_graph.graph.node}
    reference = model.double().eval()
    with torch.no_grad():
        expected = reference(*batch)
    check(relative_error(loss, expected[0].numpy()), MLM_BOUND, "loss")
    check(relative_error(logits, expected[1].numpy()), MLM_BOUND, "logits")


def _check_against_float64(model, trainer, batch, loss, logits, bound):
    reference = model.double().eval()
    with torch.no_grad():
        out = reference(**dict(zip(trainer.model_desc.input_names, batch)))
    check(relative_error(loss, out.loss.numpy()), bound, "loss")
    check(relative_error(logits, out.logits.numpy()), bound, "logits")


def test_a_loss_only_evaluation_at_other_sizes_builds_the_eval_graph_alone(cache, monkeypatch):
    """A loss-only loop whose evaluation batches have another size (the CLI's held-out batches): a
    signature of other sizes, only evaluated, built alone from a static eval-mode trace (which has no
    training program for ``sparse_labels`` to look at: its graph computes every output and drops the
    logits)."""
    from test_rewrites_sparse_labels import DESC, MaskedLM, _batch

    torch.manual_seed(0)
    model = MaskedLM()
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.1), options={"graph": {"gradient_source": "torch"}})
    trainer._train_step_info.fetches = ["loss"]
    trainer.train_step(*_batch())
    ids, labels = (t[:3, :7] for t in _batch(seed=1))
    exports = _ExportCalls(monkeypatch)
    loss = np.asarray(trainer.eval_step(ids, labels))
    assert exports.calls == 1  # the eval-mode trace alone
    (key,) = [key for key in trainer._engine._session_sets if key[0] != trainer._shapes._first_signature[0]]
    assert key not in trainer._shapes._by_signature and trainer._engine._session_sets[key].training is None
    with torch.no_grad():
        expected = model.double().eval()(ids, labels)[0]
    check(relative_error(loss, expected.numpy()), MLM_BOUND, "loss")


def test_the_training_forms_gelu_becomes_one_fast_gelu_with_the_same_values():
    """The joint ``gelu`` pass writes the tanh GELU's forward as ``x · sigmoid(x · (A·x² + B))`` and
    keeps its intermediates for the backward; an eval graph taken from that forward has no backward,
    and ``sigmoid_gelu_forward`` makes it one ``FastGelu``. Both graphs against float64
    ``½x(1 + tanh(√(2/π)(x + 0.044715x³)))`` on x ~ N(0, 3²): the sigmoid form rounds six times
    (≈ 6u of the largest |y|, the terms being at most |y|-sized), ONNX Runtime's FastGelu a few
    times in its tanh: bound 64u, a 10x margin."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ort_trainer.graph.passes.forward import _GELU_A, _GELU_B, sigmoid_gelu_forward

    nodes = [helper.make_node("Mul", ["x", "x"], ["x2"]), helper.make_node("Mul", ["x2", "a"], ["ax2"]),
             helper.make_node("Add", ["ax2", "b"], ["poly"]), helper.make_node("Mul", ["x", "poly"], ["inner"]),
             helper.make_node("Sigmoid", ["inner"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])],
                              [helper.make_tensor("a", TensorProto.FLOAT, [], [_GELU_A]),
                               helper.make_tensor("b", TensorProto.FLOAT, [], [_GELU_B])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert sigmoid_gelu_forward(rewritten) == 1
    assert [(n.op_type, n.domain) for n in rewritten.graph.node] == [("FastGelu", "com.microsoft")]
    x = np.random.default_rng(0).normal(0.0, 3.0, (64, 256)).astype(np.float32)
    x64 = x.astype(np.float64)
    expected = 0.5 * x64 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x64 + 0.044715 * x64 ** 3)))
    for graph_model in (model, rewritten):
        session = ort.InferenceSession(graph_model.SerializeToString(), providers=["CPUExecutionProvider"])
        check(relative_error(session.run(None, {"x": x})[0], expected), 64 * FLOAT32, graph_model.graph.node[0].op_type)
