"""Hugging Face models (BertForMaskedLM, GPT2LMHeadModel) train through ORTTrainer like PyTorch."""

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from ort_trainer import ORTTrainer  # noqa: E402
from ort_trainer.optim import AdamConfig  # noqa: E402

VOCAB, SEQ = 100, 16
DESC = {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("labels", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])]}


def _bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, loss_type="ForCausalLM", use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def _batch(step, masked):
    """Runs of consecutive ids (learnable from context) starting at random places."""
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(1, VOCAB - SEQ, (4, 1), generator=gen)
    ids = starts + torch.arange(SEQ).unsqueeze(0)
    labels = ids.clone()
    if masked:
        chosen = torch.rand(4, SEQ, generator=gen) < 0.3
        labels[~chosen] = -100
        ids = torch.where(chosen, torch.zeros_like(ids), ids)
    return ids, torch.ones_like(ids), labels


@pytest.mark.parametrize("make, masked", [(_bert, True), (_gpt2, False)], ids=["bert", "gpt2"])
def test_hugging_face_model_trains_like_eager(make, masked):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, AdamConfig(lr=3e-3))  # the model computes its own loss
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.0)
    ort_losses, torch_losses = [], []
    for step in range(10):
        ids, mask, labels = _batch(step, masked)
        ort_losses.append(trainer.train_step(ids, mask, labels)[0].item())
        optimizer.zero_grad()
        loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        torch_losses.append(loss.item())
    np.testing.assert_allclose(ort_losses, torch_losses, rtol=1e-3)
    assert np.mean(ort_losses[-3:]) < np.mean(ort_losses[:3])
    state = trainer.state_dict(pytorch_format=True)
    reference_state = reference.state_dict()
    for key in ("lm_head.weight" if not masked else "cls.predictions.bias",):
        torch.testing.assert_close(state[key], reference_state[key], rtol=1e-3, atol=1e-4)
