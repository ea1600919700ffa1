"""Layer drop (Hugging Face's ``layerdrop``: each layer skipped in training with probability p, drawn with
``torch.rand``, or NumPy in wav2vec2's adapter, and read into Python) is decided in the graph at every step
(``graph/export/layer_drop.py``).

The draws differ from PyTorch's, so the steps are compared with PyTorch given the same decisions: a layer whose
weights a step leaves unchanged (SGD, lr > 0) was dropped, and PyTorch's ``torch.rand`` is made to return values
that drop the same layers."""

import contextlib
import copy
import logging
from typing import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer, _logging, _runtime
from ort_trainer.optim import SGDConfig
from models import OwnLoss, classified_batches, sgd_steps_as_pytorch
from tolerances import check, relative_error, steps_bound

ROUTES = [pytest.param("torch", marks=pytest.mark.skipif(not _runtime.has_onnxscript(), reason="needs onnxscript")),
          pytest.param("onnxruntime", marks=pytest.mark.skipif(not _runtime.has_training_build(),
                                                               reason="needs the 1.19.2 training build"))]
LAYERS = ["encoder.layers.0.", "encoder.layers.1.", "encoder.layers.2."]
DESC = {"inputs": [("x", ["b", 4]), ("y", ["b"])], "outputs": [("loss", [], True)]}


class _Layers(torch.nn.Module):
    def __init__(self, p: float, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                          for _ in range(layers))
        self.layerdrop = p


class BartStyle(_Layers):
    """Hugging Face's two ways of writing a layer drop: BART's decoder (``if draw < p: continue``)..."""

    def forward(self, hidden_states):
        for layer in self.layers:
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            hidden_states = layer(hidden_states)
        return hidden_states


class Wav2Vec2Style(_Layers):
    """... and wav2vec2's (``skip_the_layer = draw < p``, then ``if not skip_the_layer``)."""

    def forward(self, hidden_states):
        for layer in self.layers:
            skip_the_layer = False
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                skip_the_layer = dropout_probability < self.layerdrop
            if not skip_the_layer:
                hidden_states = layer(hidden_states)
        return hidden_states


class AdapterStyle(_Layers):
    """... and wav2vec2's adapter's: a NumPy draw, the layer kept where it exceeds p."""

    def forward(self, hidden_states):
        for layer in self.layers:
            layerdrop_prob = np.random.random()
            if not self.training or (layerdrop_prob > self.layerdrop):
                hidden_states = layer(hidden_states)
        return hidden_states


STYLES = {"bart": BartStyle, "wav2vec2": Wav2Vec2Style, "adapter": AdapterStyle}


class Classifier(torch.nn.Module):
    def __init__(self, p: float, style: str, layers: int = 3):
        super().__init__()
        self.encoder = STYLES[style](p, layers)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.encoder(x)), y)


@contextlib.contextmanager
def _scripted_draws(monkeypatch, decisions: list[bool]) -> Iterator[list[bool]]:
    """Within: ``torch.rand([])`` and ``np.random.random()`` draw 0 (below any p: dropped) or 0.999 (kept) for the
    decisions in the order given; yields what is left of them."""
    queue, original = list(decisions), torch.rand

    def rand(*size, **kwargs):
        if size in (([],), ((),)) and not kwargs:
            return torch.tensor(0.0 if queue.pop(0) else 0.999)
        return original(*size, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "rand", rand)
        patch.setattr(np.random, "random", lambda: 0.0 if queue.pop(0) else 0.999)
        yield queue


def _steps_as_pytorch_with_its_decisions(model, desc, batches, layers: list[str], options: dict, monkeypatch,
                                         lr: float = 0.1, length: int = 64) -> list[list[bool]]:
    """SGD steps of ``model`` in the trainer and in PyTorch, PyTorch dropping the layers each step of the trainer
    left unchanged (``layers``: the droppable layers' name prefixes, in the order the forward draws for them):
    losses within steps_bound (sums of ``length`` terms; observed on a 2-core Intel Xeon: <= 0.02 of it). Returns
    each step's decisions."""
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, desc, SGDConfig(lr=lr), options=options)
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    everything = []
    for step, batch in enumerate(batches):
        before = trainer.state_dict(pytorch_format=True)
        loss = float(trainer.train_step(*batch))
        after = trainer.state_dict(pytorch_format=True)
        decisions = [all(torch.equal(before[k], after[k]) for k in before if k.startswith(prefix))
                     for prefix in layers]
        everything.append(decisions)
        optimizer.zero_grad()
        with _scripted_draws(monkeypatch, decisions) as queue:
            want = reference(*batch)
        want = want[0] if isinstance(want, tuple) else want
        want.backward()
        optimizer.step()
        assert not queue, "PyTorch drew for fewer layers than the trainer decided"
        # float32 sums of at most ``length`` terms per step, carried through the weights
        check(relative_error(loss, float(want.detach())), steps_bound(step + 1, length=length), f"step {step}")
    return everything


def _batches(steps: int, seed: int = 0):
    return classified_batches(steps, rows=6, features=4, seed=seed)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("style", list(STYLES))
def test_steps_equal_pytorch_dropping_the_same_layers(route, style, monkeypatch, caplog):
    torch.manual_seed(0)
    monkeypatch.setattr(_logging, "_LOGGED", set())  # warned once per line and process
    with caplog.at_level(logging.WARNING, logger="ort_trainer"):
        decisions = _steps_as_pytorch_with_its_decisions(Classifier(0.5, style), DESC, _batches(8), LAYERS,
                                                         {"graph": {"gradient_source": route}}, monkeypatch)
    flat = [d for step in decisions for d in step]
    assert any(flat) and not all(flat), f"8 steps of 3 layers at p 0.5 dropped {sum(flat)} of 24"
    assert len({tuple(step) for step in decisions}) > 1  # decided anew at each step
    assert "layer drop, drawn in the graph" in caplog.text and "zero gradient" in caplog.text


@pytest.mark.parametrize("route", ROUTES)
def test_each_layer_is_dropped_with_its_probability_and_never_in_eval(route, monkeypatch):
    """One layer at p 0.3, lr 0: each step's loss is the loss with the layer or the one without (PyTorch's, given
    each decision), the dropped fraction over 300 steps within 5σ = 5·sqrt(0.3·0.7/300) = 0.13 of 0.3."""
    torch.manual_seed(1)
    model = Classifier(0.3, "wav2vec2", layers=1)
    x, y = _batches(1)[0]
    with_layer, without = [], []
    for dropped, values in ((False, with_layer), (True, without)):
        with _scripted_draws(monkeypatch, [dropped]):
            values.append(float(model(x, y).detach()))
    model.eval()
    evaluated = float(model(x, y).detach())
    model.train()
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.0), options={"graph": {"gradient_source": route}})
    losses = np.array([float(trainer.train_step(x, y)) for _ in range(300)])
    bound = steps_bound(1, length=64)  # one step's float32 sums of at most 64 terms
    near_without = np.abs(losses - without[0]) <= bound * abs(without[0])
    near_with = np.abs(losses - with_layer[0]) <= bound * abs(with_layer[0])
    assert (near_with | near_without).all() and not (near_with & near_without).any()
    check(abs(near_without.mean() - 0.3), 5 * np.sqrt(0.3 * 0.7 / 300), "dropped fraction")
    check(relative_error(float(trainer.eval_step(x, y)), evaluated), bound, "eval, no layer dropped")


def test_a_python_draw_never_reuses_the_graph_of_a_model_that_made_no_draw(monkeypatch, tmp_path):
    """A record of one eager forward cannot key a forward that draws in Python: at p 0.5 a record that drew "keep"
    for every layer equals the record at p 0 (the comparison happens in Python), and the cached p-0 graph, which
    never drops, was reused. 20 steps of 3 layers at p 0.5 keep all 60 with probability 2^-60."""
    if not _runtime.has_onnxscript():
        pytest.skip("needs onnxscript")
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    options = {"graph": {"gradient_source": "torch"}}
    batches = _batches(20)
    torch.manual_seed(0)
    ORTTrainer(Classifier(0.0, "adapter"), DESC, SGDConfig(lr=0.1), options=options).train_step(*batches[0])
    monkeypatch.setattr(np.random, "random", lambda: 0.999)  # the record's eager forward keeps every layer
    trainer = ORTTrainer(Classifier(0.5, "adapter"), DESC, SGDConfig(lr=0.1), options=options)
    dropped = 0
    for batch in batches:
        before = trainer.state_dict(pytorch_format=True)
        trainer.train_step(*batch)
        after = trainer.state_dict(pytorch_format=True)
        dropped += sum(all(torch.equal(before[k], after[k]) for k in before if k.startswith(prefix))
                       for prefix in LAYERS)
    assert dropped, "60 layer steps at p 0.5 dropped none: the graph of p 0 was reused"


class _WithNorm(torch.nn.Module):
    """A layer that returns its hidden states and a tensor it computes (its weight's norm)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.linear(x)), self.linear.weight.norm()


class _Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers, self.head = torch.nn.ModuleList([_WithNorm(), _WithNorm()]), torch.nn.Linear(4, 3)

    def forward(self, x, y):
        penalty = 0.0
        for layer in self.layers:
            dropout_probability = torch.rand([])
            if dropout_probability < 0.5:
                continue
            x, norm = layer(x)
            penalty = penalty + norm  # what a dropped layer adds has no stand-in the graph could pass on
        return F.cross_entropy(self.head(x), y) + 0.01 * penalty


def test_a_layer_returning_other_tensors_is_refused_with_the_fix():
    route = "torch" if _runtime.has_onnxscript() else "onnxruntime"
    trainer = ORTTrainer(_Norms(), DESC, SGDConfig(lr=0.1), options={"graph": {"gradient_source": route}})
    with pytest.raises(Exception, match="layer drop at .*test_layer_drop.py.* returns more than its hidden states.*"
                       "set the model's layer drop probability to 0"):
        trainer.train_step(*_batches(1)[0])


def _speech(transformers, family: str):
    """wav2vec2 (every layer drawn for) or WavLM (not the first: it holds the position bias), 3 layers at 0.5."""
    config = getattr(transformers, f"{family}Config")(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
        num_labels=3, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.5, mask_time_prob=0.0, num_buckets=8, max_bucket_distance=16)
    model = getattr(transformers, f"{family}ForSequenceClassification")(config)
    first = 1 if family == "WavLM" else 0
    return OwnLoss(model, "input_values"), [f"model.{family.lower()}.encoder.layers.{i}." for i in range(first, 3)]


def _bart(transformers):
    config = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.5,
                                     decoder_layerdrop=0.5)
    return (OwnLoss(transformers.BartForConditionalGeneration(config), "input_ids"),
            [f"model.model.{part}.layers.{i}." for part in ("encoder", "decoder") for i in range(2)])


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="needs onnxscript")
@pytest.mark.parametrize("family", ["Wav2Vec2", "WavLM", "Bart"])
def test_hugging_face_layer_drop_steps_equal_pytorch_dropping_the_same_layers(family, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    torch.manual_seed(0)
    model, layers = _bart(transformers) if family == "Bart" else _speech(transformers, family)
    generator = torch.Generator().manual_seed(0)
    if family == "Bart":
        batches = [(torch.randint(3, 64, (2, 12), generator=generator),) * 2 for _ in range(6)]
    else:
        batches = [(torch.randn(2, 400, generator=generator), torch.randint(0, 3, (2,), generator=generator))
                   for _ in range(6)]
    x, y = batches[0]
    desc = {"inputs": [("x", ["b", *(f"x{i}" for i in range(1, x.dim()))]), ("y", ["b", *(f"y{i}" for i in
                                                                                          range(1, y.dim()))])],
            "outputs": [("loss", [], True)]}
    # the longest float32 sums: the feed-forward's 64 terms, the vocabulary's 64
    decisions = _steps_as_pytorch_with_its_decisions(model, desc, batches, layers, {"graph": {"gradient_source":
                                                                                              "torch"}},
                                                     monkeypatch, length=64)
    flat = [d for step in decisions for d in step]
    assert any(flat) and not all(flat), f"{len(decisions)} steps dropped {sum(flat)} of {len(flat)} layers"


class _Pooled(torch.nn.Module):
    """A speech encoder's mean hidden state, classified."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.head = model, torch.nn.Linear(model.config.output_hidden_size, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.model(x).last_hidden_state.mean(1)), y)


def _adapter(transformers, layerdrop: float):
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=layerdrop,
        mask_time_prob=0.0, add_adapter=True, output_hidden_size=32, num_adapter_layers=2)
    return _Pooled(transformers.Wav2Vec2Model(config))


@pytest.mark.skipif(not _runtime.has_onnxscript(), reason="needs onnxscript")
def test_the_numpy_draws_of_wav2vec2s_adapter_train_at_layerdrop_0_and_are_refused_above():
    """At layerdrop 0 no adapter layer is dropped (one is kept where its draw exceeds 0): 3 steps as PyTorch.
    Above 0 a dropped adapter layer (a strided convolution) would change the sequence's length: refused, naming
    the fix."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 400, generator=generator), torch.randint(0, 3, (2,), generator=generator))
               for _ in range(3)]
    desc = {"inputs": [("x", ["b", "t"]), ("y", ["b"])], "outputs": [("loss", [], True)]}
    # the longest float32 sums: the feed-forward's 64 terms
    sgd_steps_as_pytorch(_adapter(transformers, 0.0), desc, batches, 0.1, lambda step: steps_bound(step + 1, length=64),
                         {"graph": {"gradient_source": "torch"}})
    trainer = ORTTrainer(_adapter(transformers, 0.1), desc, SGDConfig(lr=0.1),
                         options={"graph": {"gradient_source": "torch"}})
    with pytest.raises(Exception, match=r"layer drop at .*: the layer changes its input's shape .*adapter.* set the "
                       r"model's layer drop probability to 0 \(config.layerdrop\)"):
        trainer.train_step(*batches[0])
