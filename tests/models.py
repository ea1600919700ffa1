"""Small models used across the tests, with their model descriptions and reference training loops."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

VOCAB = 50
HIDDEN = 32


class MLP(torch.nn.Module):
    """784-style classifier, shrunk: in_features -> hidden -> classes."""

    def __init__(self, in_features: int = 20, hidden: int = 32, classes: int = 5):
        super().__init__()
        self.fc1 = torch.nn.Linear(in_features, hidden)
        self.fc2 = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class MLPWithLoss(torch.nn.Module):
    """The MLP with its cross-entropy inside: ``forward(x, label)`` returns ``(loss, logits)``."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x, label):
        logits = self.mlp(x)
        return torch.nn.functional.cross_entropy(logits, label), logits


MLP_DESC = {
    "inputs": [("x", ["batch", 20]), ("label", ["batch"])],
    "outputs": [("loss", [], True), ("logits", ["batch", 5])],
}


class EncoderLayer(torch.nn.Module):
    """Post-LN transformer layer: multi-head self-attention and a GELU feed-forward block.

    The key projection has no bias: a key bias shifts every score of a row equally, so its true
    gradient is zero and Adam would amplify rounding noise in it, in PyTorch and ONNX Runtime alike.
    """

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.query = torch.nn.Linear(hidden, hidden)
        self.key = torch.nn.Linear(hidden, hidden, bias=False)
        self.value = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.ff1 = torch.nn.Linear(hidden, 2 * hidden)
        self.ff2 = torch.nn.Linear(2 * hidden, hidden)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.dropout = torch.nn.Dropout(dropout)

    def _split(self, x):
        batch, seq, hidden = x.shape
        return x.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hidden // self.heads)
        attention = self.dropout(torch.softmax(scores, dim=-1)) @ v
        x = self.norm1(x + self.dropout(self.out(attention.transpose(1, 2).reshape(batch, seq, hidden))))
        return self.norm2(x + self.dropout(self.ff2(F.gelu(self.ff1(x)))))


class TinyEncoder(torch.nn.Module):
    """Token + position embeddings, post-LN encoder layers, final LayerNorm and an LM head."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = 2, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.position = torch.nn.Embedding(64, hidden)
        self.layers = torch.nn.ModuleList(EncoderLayer(hidden, heads, dropout) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.embed(ids) + self.position(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def mlm_loss(logits, labels):
    """Masked-LM loss: cross-entropy over positions whose label is not -100."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


ENCODER_DESC = {
    "inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
    "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])],
}


def mlm_batch(generator: torch.Generator, batch: int = 4, seq: int = 12):
    """Random token ids; labels are the ids themselves with ~70% of positions ignored (-100)."""
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels = ids.clone()
    mask = torch.rand(batch, seq, generator=generator) < 0.7
    labels[mask] = -100
    return ids, labels


_TEACHER = torch.randn(20, 5, generator=torch.Generator().manual_seed(1234))


def mlp_batch(generator: torch.Generator, batch: int = 8):
    """Random features labelled by a fixed linear teacher, so the task is learnable."""
    x = torch.randn(batch, 20, generator=generator)
    return x, (x @ _TEACHER).argmax(dim=1)


def classified_batches(count: int, rows: int, features: int, seed: int, classes: int = 3) -> list:
    """``count`` batches of ``rows`` standard normal feature vectors and class labels below ``classes``, drawn in
    turn from one generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, features, generator=generator),
             torch.randint(0, classes, (rows,), generator=generator)) for _ in range(count)]


def clone(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy with identical initial weights."""
    return copy.deepcopy(model)


def torch_step(model, optimizer, loss_fn, inputs, label, clip: float | None):
    """One eager PyTorch training step; returns the loss."""
    optimizer.zero_grad()
    loss = loss_fn(model(*inputs), label)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.item()


def tiny_gpt2(n_layer: int = 2, dropout: float = 0.0, vocab: int = VOCAB, seq: int = 8) -> tuple:
    """A tiny Hugging Face ``GPT2LMHeadModel`` (initialised after ``torch.manual_seed(0)``) and its
    description: ``(input_ids, attention_mask, labels) -> (loss, logits)``. Skips the test when
    transformers is not installed."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=16, n_layer=n_layer, n_head=2,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
                                     eos_token_id=0, loss_type="ForCausalLM", use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config), _language_model_description(vocab)


def tiny_bert_mlm(vocab: int = VOCAB) -> tuple:
    """A tiny Hugging Face ``BertForMaskedLM`` (its head a Linear with a bias, the loss over the labelled rows;
    initialised after ``torch.manual_seed(0)``) and its description, as ``tiny_gpt2``'s."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config), _language_model_description(vocab)


def _language_model_description(vocab: int) -> dict:
    """``(input_ids, attention_mask, labels) -> (loss, logits)`` of a Hugging Face language model."""
    return {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]),
                       ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", vocab])]}


def save_tiny_pretrained(directory, task: str = "causal-lm"):
    """Save a tiny Hugging Face model for ``task`` (``causal-lm``: GPT-2, ``masked-lm``: BERT,
    ``sequence-classification``: GPT-2 with 3 classes named neg, neutral, pos; 2 layers of
    width 32, 32 positions) and a byte-level BPE tokenizer of 300 tokens trained on the spot on a slice
    of the bundled corpus, both with ``save_pretrained`` into ``directory``: what ``model.type=hf``
    loads, built offline. Returns ``directory``. Skips the test without transformers."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    tokenizers = pytest.importorskip("tokenizers")
    from ort_trainer.text import stdlib_corpus

    special = ["[UNK]"] + (["[MASK]"] if task == "masked-lm" else [])
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator([stdlib_corpus(60000)], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="[UNK]",
                                                     **({"mask_token": "[MASK]"} if task == "masked-lm" else {}))
    torch.manual_seed(0)
    gpt2 = dict(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    if task == "causal-lm":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2))
    elif task == "sequence-classification":
        names = ["neg", "neutral", "pos"]
        model = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
            **gpt2, num_labels=3, id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)}))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def eager_training(job, config: dict) -> tuple[torch.nn.Module, list[float]]:
    """A copy of a command-line job's Hugging Face model trained in eager PyTorch as the command line trains
    it with ``optimizer.lambda_coef=0`` and no schedule (AdamW, the gradient norm clipped at 1), on the job's
    batches for ``train.max_steps`` steps: ``(model, losses)``."""
    eager = copy.deepcopy(job.model)
    optimizer = torch.optim.AdamW(eager.parameters(), lr=config["optimizer"]["lr"], weight_decay=0.0)
    losses = []
    for step in range(config["train"]["max_steps"]):
        ids, mask, labels = (torch.from_numpy(a) for a in job.train_batch(step))
        optimizer.zero_grad()
        loss = eager(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    return eager, losses


def assert_float32_untouched(model, desc, batch, switch: str, loss_fn=None) -> None:
    """One float32 SGD step (lr 0, torch gradient source) with ``graph_optimizations[switch]`` on and off:
    a mixed-precision pass must leave float32 training alone, the same graph nodes and bitwise the same
    gradients."""
    import numpy as np

    from ort_trainer import ORTTrainer
    from ort_trainer.optim import SGDConfig

    graphs, grads = [], []
    for on in (True, False):
        trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0), loss_fn=loss_fn,
                             options={"graph": {"gradient_source": "torch"}, "graph_optimizations": {switch: on}})
        trainer.train_step(*batch)
        graphs.append([n.op_type for n in trainer._graphs.gradient.graph.node])
        grads.append({w: g.numpy().copy() for w, g in trainer._engine.grads.items()})
    assert graphs[0] == graphs[1]
    for name, grad in grads[0].items():
        np.testing.assert_array_equal(grad, grads[1][name])


class OwnLoss(torch.nn.Module):
    """A Hugging Face model's own loss of ``(x, y)``: ``x`` passed by the name its forward takes the input by
    (``input_ids``, ``input_values``), ``y`` as its labels."""

    def __init__(self, model: torch.nn.Module, input_name: str):
        super().__init__()
        self.model, self.input_name = model, input_name

    def forward(self, x, y):
        return self.model(**{self.input_name: x, "labels": y}).loss


def sgd_steps_as_pytorch(model: torch.nn.Module, desc: dict, batches, lr: float, bound, options: dict | None = None):
    """SGD steps of ``model`` in ORTTrainer (``options``) and of a copy in eager PyTorch, one per batch of
    ``batches`` (an iterable, read as the steps run): each step's loss (the first output where the model returns
    several) within ``bound(step)`` of PyTorch's, relative. Returns ``(trainer, the PyTorch copy)``."""
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import SGDConfig
    from tolerances import check, relative_error

    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, desc, SGDConfig(lr=lr), options=options)
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for step, batch in enumerate(batches):
        out = trainer.train_step(*batch)
        loss = float(out[0] if isinstance(out, (list, tuple)) else out)
        optimizer.zero_grad()
        want = reference(*batch)
        want = want[0] if isinstance(want, tuple) else want
        want.backward()
        optimizer.step()
        check(relative_error(loss, float(want.detach())), bound(step), f"step {step}")
    return trainer, reference
