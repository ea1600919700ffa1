"""The benchmark models, their batches and their model descriptions.

- ``mlp``: 784-500-10 MLP, batch 64, cross-entropy.
- ``bert``: Hugging Face ``BertForMaskedLM`` (vocab 8000, hidden 256, 4 layers, 4 heads, sequence
  128, batch 8, dropout 0.1), 15% of the positions labelled, loss inside the model.
- ``gpt2``: Hugging Face ``GPT2LMHeadModel`` with the same sizes, causal LM loss inside the model.

Random initial weights, random tokens: nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 8000, 256, 4, 4, 128, 8


@dataclass
class Workload:
    """A model factory, a batch, and how ORTTrainer and PyTorch compute its loss."""

    name: str
    make_model: Callable[[], torch.nn.Module]
    batch: tuple
    desc: dict
    loss_fn: Callable | None  # for ORTTrainer; None: the model returns (loss, ...)
    fetches: list[str]  # what the training loop reads back from train_step

    def torch_loss(self, model: torch.nn.Module) -> torch.Tensor:
        """The loss PyTorch computes for this batch."""
        if self.loss_fn is None:
            return model(*self.batch)[0]
        return self.loss_fn(model(*self.batch[:-1]), self.batch[-1])


class _LossFirst(torch.nn.Module):
    """Wraps a Hugging Face LM so forward(ids, mask, labels) returns (loss, logits)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return out.loss, out.logits


def _lm_batch(masked: bool, generator: torch.Generator) -> tuple:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    labels = ids.clone()
    if masked:
        labels[torch.rand(BATCH, SEQ, generator=generator) >= 0.15] = -100
    return ids, mask, labels


_LM_DESC = {
    "inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("labels", ["batch", "seq"])],
    "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])],
}


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=4 * HIDDEN, max_position_embeddings=SEQ, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    return _LossFirst(BertForMaskedLM(config))


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
                        loss_type="ForCausalLM")
    return _LossFirst(GPT2LMHeadModel(config))


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(784, 500), torch.nn.ReLU(), torch.nn.Linear(500, 10))


def workload(name: str, seed: int = 0) -> Workload:
    """The named workload with a fixed batch."""
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        batch = (torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen))
        desc = {"inputs": [("x", ["batch", 784]), ("label", ["batch"])],
                "outputs": [("loss", [], True), ("logits", ["batch", 10])]}
        return Workload("mlp", _mlp, batch, desc, torch.nn.functional.cross_entropy, ["loss"])
    if name == "bert":
        return Workload("bert", _bert, _lm_batch(True, gen), _LM_DESC, None, ["loss"])
    if name == "gpt2":
        return Workload("gpt2", _gpt2, _lm_batch(False, gen), _LM_DESC, None, ["loss"])
    raise ValueError(f"unknown workload {name!r}; choose mlp, bert or gpt2")


WORKLOADS = ("mlp", "bert", "gpt2")
