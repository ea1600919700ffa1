"""Small models the command line trains: a GPT (nanoGPT-style) and an MLP classifier.

They are ordinary ``torch.nn.Module``s; ``ORTTrainer`` trains any module, these are the ones the
bundled configs name (``model.type: gpt`` / ``mlp``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class CausalSelfAttention(torch.nn.Module):
    """Multi-head self-attention with a causal mask (a buffer sliced to the sequence length)."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.qkv = torch.nn.Linear(n_embd, 3 * n_embd)
        self.proj = torch.nn.Linear(n_embd, n_embd)
        self.dropout = torch.nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size),
                             persistent=False)

    def forward(self, x):
        """[batch, seq, width] -> [batch, seq, width]; position t attends to positions <= t."""
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.n_head)
        scores = scores.masked_fill(self.mask[:, :, :seq, :seq] == 0, float("-inf"))
        attention = self.dropout(torch.softmax(scores, dim=-1)) @ v
        return self.dropout(self.proj(attention.transpose(1, 2).reshape(batch, seq, width)))


class Block(torch.nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln2 = torch.nn.LayerNorm(n_embd)
        self.fc = torch.nn.Linear(n_embd, 4 * n_embd)
        self.out = torch.nn.Linear(4 * n_embd, n_embd)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x):
        """Attention then MLP, each around a residual connection."""
        x = x + self.attn(self.ln1(x))
        return x + self.dropout(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(torch.nn.Module):
    """A small GPT: token + position embeddings, pre-LN blocks, tied LM head. Returns logits."""

    def __init__(self, vocab_size: int = 256, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0):
        super().__init__()
        self.block_size = block_size
        self.tokens = torch.nn.Embedding(vocab_size, n_embd)
        self.positions = torch.nn.Embedding(block_size, n_embd)
        self.dropout = torch.nn.Dropout(dropout)
        self.blocks = torch.nn.ModuleList(Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer))
        self.ln = torch.nn.LayerNorm(n_embd)
        self.head = torch.nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, ids):
        """Token ids [batch, seq] -> logits [batch, seq, vocab]."""
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.dropout(self.tokens(ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits, targets):
    """Next-token cross-entropy over every position (targets already shifted)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


class MLPClassifier(torch.nn.Module):
    """in_features -> hidden -> classes, ReLU and dropout."""

    def __init__(self, in_features: int = 64, hidden: int = 128, classes: int = 10, dropout: float = 0.1):
        super().__init__()
        self.hidden = torch.nn.Linear(in_features, hidden)
        self.dropout = torch.nn.Dropout(dropout)
        self.classifier = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        """Features [batch, in_features] -> logits [batch, classes]."""
        return self.classifier(self.dropout(torch.relu(self.hidden(x))))
