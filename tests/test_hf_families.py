"""More Hugging Face architectures train through ORTTrainer like PyTorch: an encoder-decoder (BART, whose
``shift_tokens_right`` assigns the start token into a slice), a mixture of experts (Mixtral with its
``batched_mm`` experts; the default ``grouped_mm`` is refused, naming the switch) and an audio encoder with
weight normalisation (wav2vec2's positional convolution), DeBERTa's attention (SEW-D: its masked softmax and
dropout are Functions whose backward is their forward's derivative), a ceil-mode average pool (Funnel) and GPT-2 with
reentrant gradient checkpointing (traced as the plain calls PyTorch's backward recomputes), BLOOM, whose GELU is
a custom autograd Function with its derivative written out as its backward, and RWKV, whose recurrence writes each
step into a tensor of zeros."""

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from ort_trainer import ORTTrainer  # noqa: E402
from ort_trainer.graph.export.torchscript import ExportError  # noqa: E402
from ort_trainer.optim import SGDConfig  # noqa: E402
from models import OwnLoss, sgd_steps_as_pytorch  # noqa: E402
from tolerances import check, relative_error, steps_bound  # noqa: E402

VOCAB, STEPS = 64, 3
# ONNX Runtime against eager PyTorch for STEPS SGD steps on the same float32 arithmetic, each sum added in
# its own order: <= length·u of its magnitude per step (Higham), carried through the weights once a step.
# The longest sums are the feed-forward's 128 terms: steps_bound(3, length=128) = 2.3e-5 relative.
# Observed (2-core Intel Xeon, 2 threads): <= 1.2e-7, 190x under.
LOSS_BOUND = steps_bound(STEPS, length=128)


def _bart():
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0)
    return OwnLoss(transformers.BartForConditionalGeneration(config), "input_ids"), "tokens"


def _mixtral(experts: str = "batched_mm"):
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_local_experts=4,
                                        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.MixtralForCausalLM(config)
    model.set_experts_implementation(experts)
    return OwnLoss(model, "input_ids"), "tokens"


def _wav2vec2():
    config = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                                         num_conv_pos_embedding_groups=4, num_labels=3, hidden_dropout=0.0,
                                         attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                                         final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0)
    return OwnLoss(transformers.Wav2Vec2ForSequenceClassification(config), "input_values"), "audio"


def _sew_d():
    """DeBERTa's attention in a speech encoder: its masked softmax (a Function taken for its forward) zeroes its
    softmax's output in place (graph/gradient/out_of_place.py)."""
    config = transformers.SEWDConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     squeeze_factor=2, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                     num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, position_buckets=8,
                                     num_labels=3, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                     feat_proj_dropout=0.0, final_dropout=0.0, mask_time_prob=0.0)
    return OwnLoss(transformers.SEWDForSequenceClassification(config), "input_values"), "audio"


def _funnel():
    config = transformers.FunnelConfig(vocab_size=VOCAB, d_model=32, n_head=2, d_head=16, d_inner=64,
                                       block_sizes=[1, 1, 1], num_labels=3, hidden_dropout=0.0,
                                       attention_dropout=0.0, activation_dropout=0.0)
    return OwnLoss(transformers.FunnelForSequenceClassification(config), "input_ids"), "classes"


def _gpt2_reentrant_checkpointing():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return OwnLoss(model, "input_ids"), "tokens"


def _bloom():
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2, hidden_dropout=0.0,
                                      attention_dropout=0.0)
    return OwnLoss(transformers.BloomForCausalLM(config), "input_ids"), "tokens"


def _rwkv():
    """Its CPU recurrence writes each step into a tensor of zeros (``out[:, t] = ...``): the key, value and time
    weights reach the loss only through those writes. ``rescale_every=0``: RWKV otherwise rescales weights in place
    when the model changes mode, which the export refuses as a forward that changes its weights."""
    config = transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                     intermediate_size=64, context_length=32, rescale_every=0)
    return OwnLoss(transformers.RwkvForCausalLM(config), "input_ids"), "tokens"


def _batch(kind: str, step: int):
    gen = torch.Generator().manual_seed(step)
    if kind == "audio":
        return torch.randn(2, 400, generator=gen), torch.randint(0, 3, (2,), generator=gen)
    ids = torch.randint(3, VOCAB, (2, 12), generator=gen)
    if kind == "classes":
        return ids, torch.randint(0, 3, (2,), generator=gen)
    return ids, torch.randint(3, VOCAB, (2, 12), generator=gen)


@pytest.mark.parametrize("make", [_bart, _mixtral, _wav2vec2, _sew_d, _funnel, _gpt2_reentrant_checkpointing,
                                  _bloom, _rwkv],
                         ids=["bart", "mixtral", "wav2vec2", "sew_d", "funnel", "gpt2_reentrant_checkpointing",
                              "bloom", "rwkv"])
def test_hugging_face_family_trains_like_eager(make):
    torch.manual_seed(0)
    model, kind = make()
    reference = copy.deepcopy(model)
    x, y = _batch(kind, 0)
    desc = {"inputs": [("x", ["batch", *(f"x{i}" for i in range(1, x.dim()))]),
                       ("y", ["batch", *(f"y{i}" for i in range(1, y.dim()))])],
            "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ours, theirs = [], []
    for step in range(STEPS):
        x, y = _batch(kind, step)
        ours.append(float(trainer.train_step(x, y)))
        optimizer.zero_grad()
        loss = reference(x, y)
        loss.backward()
        optimizer.step()
        theirs.append(float(loss))
    error = float(np.max(np.abs(np.subtract(ours, theirs)) / np.abs(theirs)))
    check(error, LOSS_BOUND, f"losses {ours} against {theirs}")


def test_grouped_mm_experts_are_refused_naming_the_experts_implementation_that_trains():
    torch.manual_seed(0)
    model, _ = _mixtral("grouped_mm")
    desc = {"inputs": [("x", ["batch", "seq"]), ("y", ["batch", "seq"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1))
    with pytest.raises(ExportError) as refused:
        trainer.train_step(*_batch("tokens", 0))
    message = str(refused.value)
    assert "grouped_mm mixture-of-experts layer in module model.model.layers.0.mlp.experts" in message
    assert 'model.set_experts_implementation("batched_mm")' in message


class _Context:
    """What a Function's forward may call on its ``ctx``, run outside ``apply`` (autograd then records its
    operations)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


# each Function's arguments after x (1-D): a mask for the masked softmax (one element in five dropped), the
# probability for the dropout (whose mask, drawn in its forward, is the same for both calls: the same seed)
_ARGUMENTS = {"XSoftmax": lambda x: ((torch.arange(x.numel()) % 5 != 0).int(), -1), "XDropout": lambda x: (0.3,)}


def test_the_functions_taken_for_their_forward_have_its_derivative_for_backward():
    """``guard.DERIVATIVE_BACKWARDS``: autograd of the traced forward stands for the Function's own backward, so the
    two must be the same function. Compared in float64 over [-8, 8] with random output gradients in [-1, 1]. BLOOM's
    GELU backward writes sqrt(2/pi)·3·0.044715 as 0.1070322243 (10 digits: off by <= 5e-11), a term multiplied by
    x³/2 <= 256: <= 1.3e-8 between the two, relative to gradients of ~1; float64's roundings add ~1e-14 (the
    softmax's sums of 4001 terms: ~1e-12). Bound 1e-7, relative to the largest gradient."""
    import importlib

    from ort_trainer.graph.export.guard import DERIVATIVE_BACKWARDS

    for name in DERIVATIVE_BACKWARDS:
        module, _, function = name.rpartition(".")
        cls = getattr(importlib.import_module(module), function)
        x = torch.linspace(-8, 8, 4001, dtype=torch.float64, requires_grad=True)
        grad = torch.rand(4001, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 2 - 1
        arguments = _ARGUMENTS.get(function, lambda x: ())(x)
        torch.manual_seed(1)
        (theirs,) = torch.autograd.grad(cls.apply(x, *arguments), x, grad)
        torch.manual_seed(1)
        # as traced: functional (XSoftmax zeroes its softmax's output in place, which eager autograd refuses)
        traced_forward = torch.func.functionalize(lambda x: cls.forward(_Context(), x, *arguments))
        (traced,) = torch.autograd.grad(traced_forward(x), x, grad)
        assert theirs.abs().max() > 0, f"{name}: a gradient to compare"
        check(relative_error(traced, theirs), 1e-7, f"{name}: its backward against autograd of its forward")


def test_bigbird_block_sparse_attention_trains_like_eager(caplog):
    """BigBird's block-sparse attention draws its random blocks with NumPy after seeding it with the layer's
    index at every forward: the same blocks at every step, which the trace keeps (with a warning that a changing
    seed would not be followed). Sequences of 64 tokens in blocks of 4 (block-sparse from 36 tokens on)."""
    import logging

    config = transformers.BigBirdConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=64, block_size=4,
                                        num_random_blocks=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = OwnLoss(transformers.BigBirdForMaskedLM(config), "input_ids")
    assert model.model.config.attention_type == "block_sparse"
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(3, VOCAB, (2, 64), generator=generator),) * 2 for _ in range(STEPS)]
    desc = {"inputs": [("x", ["batch", "seq"]), ("y", ["batch", "seq"])], "outputs": [("loss", [], True)]}
    with caplog.at_level(logging.WARNING, logger="ort_trainer"):
        # the longest float32 sums: the feed-forward's 64 terms
        sgd_steps_as_pytorch(model, desc, batches, 0.1, lambda step: steps_bound(step + 1, length=64))
    assert "np.random.seed(seed)" in caplog.text and "A seed that changes from step to step" in caplog.text
