"""Hugging Face's SpecAugment (wav2vec2's ``mask_time_prob`` / ``mask_feature_prob``) is drawn in the graph at every
step (``graph/export/spec_augment.py``) with the distribution of Hugging Face's NumPy ``_compute_mask_indices``."""

import copy

import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.graph.export.spec_augment import span_mask
from ort_trainer.optim import SGDConfig
from models import OwnLoss, sgd_steps_as_pytorch
from tolerances import check, relative_error, steps_bound

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices  # noqa: E402

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")
TORCH = {"graph": {"gradient_source": "torch"}}


def test_spans_of_one_frame_are_as_many_as_hugging_faces():
    """prob · length / span whole: the count does not depend on the draw, and spans of one frame never overlap."""
    lengths = torch.tensor([16, 8, 4, 16])
    for seed in range(20):
        torch.manual_seed(seed)
        mask = span_mask(4, 16, 0.25, 1, 0, lengths, torch.device("cpu"))
        np.random.seed(seed)
        attention = (torch.arange(16) < lengths[:, None]).long()
        theirs = _compute_mask_indices((4, 16), 0.25, 1, attention_mask=attention)
        assert mask.sum(1).tolist() == theirs.sum(1).tolist() == [4, 2, 1, 4]
        assert not (mask & (torch.arange(16) >= lengths[:, None])).any()  # within each row's length


def test_the_minimum_and_rows_without_spans_as_hugging_face():
    """min_masks 2 at a tiny probability; a row too short for a span gets its last frame masked, as Hugging Face's
    padding of its span list does."""
    lengths = torch.tensor([12, 2])
    torch.manual_seed(0)
    mask = span_mask(2, 12, 1e-6, 3, 2, lengths, torch.device("cpu"))
    theirs = _compute_mask_indices((2, 12), 1e-6, 3, attention_mask=(torch.arange(12) < lengths[:, None]).long(),
                                   min_masks=2)
    assert mask[1].tolist() == theirs[1].tolist() == [False] * 11 + [True]
    assert 3 <= int(mask[0].sum()) <= 6 and 3 <= int(theirs[0].sum()) <= 6  # two spans of 3, overlapping or not


def test_each_frame_is_masked_as_often_as_by_hugging_face():
    """Over 4000 draws each, every frame's masked fraction: spans of 3 at 0.3 over rows of 20 and 11 frames. The
    fractions of independent draws differ by a binomial error of at most sqrt(2 · 0.25 / 4000) = 0.011 (σ);
    bound 5σ. Observed (2-core Intel Xeon): 0.018."""
    draws, lengths = 4000, torch.tensor([20, 11])
    attention = (torch.arange(20) < lengths[:, None]).long()
    torch.manual_seed(1)
    ours = torch.stack([span_mask(2, 20, 0.3, 3, 0, lengths, torch.device("cpu")) for _ in range(draws)])
    np.random.seed(1)
    theirs = np.stack([_compute_mask_indices((2, 20), 0.3, 3, attention_mask=attention) for _ in range(draws)])
    ours, theirs = ours.double().mean(0).numpy(), theirs.mean(0)
    check(float(np.abs(ours - theirs).max()), 5 * np.sqrt(2 * 0.25 / draws), "masked fractions")
    assert ours[1, 11:].max() == theirs[1, 11:].max() == 0.0  # never past a row's length


def _wav2vec2(mask_time_prob: float, mask_feature_prob: float = 0.0):
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
        vocab_size=12, pad_token_id=0, layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, ctc_loss_reduction="mean",
        mask_time_prob=mask_time_prob, mask_time_length=2, mask_feature_prob=mask_feature_prob,
        mask_feature_length=4)
    return transformers.Wav2Vec2ForCTC(config).train()


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 1600, generator=g), torch.randint(1, 12, (2, 5), generator=g)


DESC = {"inputs": [("audio", ["batch", "samples"]), ("labels", ["batch", "len"])], "outputs": [("loss", [], True)]}


def test_wav2vec2_draws_new_masks_every_step():
    """At a learning rate of 0 the same batch gives another loss at each step (the masks are drawn anew), and the
    model in eval mode, which masks nothing, evaluates as PyTorch."""
    torch.manual_seed(19)
    model = OwnLoss(_wav2vec2(0.5, 0.2), "input_values")
    reference = copy.deepcopy(model).eval()
    trainer = ORTTrainer(model, DESC, SGDConfig(lr=0.0), options=TORCH)
    losses = {round(float(trainer.train_step(*_batch())), 6) for _ in range(4)}
    assert len(losses) >= 3, losses
    with torch.no_grad():
        want = float(reference(*_batch()))
    # the encoder's longest sums are 64 terms (steps_bound's length), one evaluation
    check(relative_error(float(trainer.eval_step(*_batch())), want), steps_bound(1), "eval")


class _GivenMask(torch.nn.Module):
    """wav2vec2's encoder with the frames to mask given (its ``mask_time_indices`` argument), and a loss."""

    def __init__(self):
        super().__init__()
        self.model = transformers.Wav2Vec2Model(_wav2vec2(0.5).config).train()
        self.head = torch.nn.Linear(32, 3)

    def forward(self, audio, masked, labels):
        hidden = self.model(input_values=audio, mask_time_indices=masked).last_hidden_state
        return torch.nn.functional.cross_entropy(self.head(hidden).mean(1), labels)


def test_given_frames_are_masked_as_by_hugging_face():
    """With the frames given, no draw: three SGD steps equal PyTorch's, masked_spec_embed trained through them."""
    torch.manual_seed(23)
    model = _GivenMask()
    desc = {"inputs": [("audio", ["batch", "samples"]), ("masked", ["batch", "frames"]), ("labels", ["batch"])],
            "outputs": [("loss", [], True)]}
    audio = _batch()[0]
    frames = int(model.model._get_feat_extract_output_lengths(audio.shape[1]))
    batches = ((audio, torch.rand(2, frames, generator=torch.Generator().manual_seed(step)) < 0.5,
                torch.tensor([step % 3, (step + 1) % 3])) for step in range(3))
    # the encoder's sums of up to 64 terms (steps_bound's length); observed <= 0.003 of the bound
    trainer, reference = sgd_steps_as_pytorch(model, desc, batches, 0.1, lambda step: steps_bound(step + 1), TORCH)
    trainer.update_torch_model()
    embed, want = model.model.masked_spec_embed.detach(), reference.model.masked_spec_embed.detach()
    assert not torch.equal(want, _GivenMask().model.masked_spec_embed)  # (it was trained)
    check(relative_error(embed.numpy(), want.numpy()), steps_bound(3), "masked_spec_embed")
