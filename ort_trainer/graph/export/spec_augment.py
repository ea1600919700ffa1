"""SpecAugment of Hugging Face's speech encoders drawn in the graph, for every step.

wav2vec2 and its relatives (HuBERT, WavLM, Data2VecAudio, UniSpeech, SEW...) mask spans of frames (and of
features) in training: ``_mask_hidden_states`` draws the spans with NumPy (``_compute_mask_indices``), which a trace
would freeze (``python_draws.py`` refuses it). While a model is exported, each such method whose code is the one
this module knows (the same names read: ``_KNOWN_NAMES``) is swapped for :func:`mask_hidden_states`, which draws
the same distribution with torch (``torch.rand``: random operators of the graph, drawn anew at each step):

- the number of spans of a row of ``length`` frames: ``floor(prob · length / span + ε)`` (ε one uniform draw per
  call, shared by the rows), at least ``min_masks``, at most ``sequence // span``, at most ``length - span + 1``
  (where a row has no span and another has some, its last frame is masked, as Hugging Face's padding of the span
  list does);
- their starts: that many distinct positions among the row's ``length - span + 1``, uniformly (the smallest of a
  uniform draw per position);
- the frames from each start on ``span`` positions: set to the trained ``masked_spec_embed``; the features' spans
  (over the hidden size, the same for every frame of a row) set to 0.

The draws are not NumPy's: a step masks other frames than PyTorch's step would, with the same probabilities.
A method that differs from the known one keeps Hugging Face's code, and its NumPy draws are refused.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

# the names the known _mask_hidden_states reads (its code's co_names)
_KNOWN_NAMES = frozenset({
    "_compute_mask_indices", "bool", "config", "device", "dtype", "expand", "getattr", "mask_feature_length",
    "mask_feature_min_masks", "mask_feature_prob", "mask_time_length", "mask_time_min_masks", "mask_time_prob",
    "masked_spec_embed", "size", "tensor", "to", "torch", "training"})


def span_mask(batch: int, sequence: Any, prob: float, span: int, min_masks: int, lengths: torch.Tensor | None,
              device: torch.device) -> torch.Tensor:
    """A boolean ``[batch, sequence]`` mask of random spans (module docstring); ``lengths``: each row's valid
    positions (int64 ``[batch]``), None for all of them."""
    if isinstance(sequence, int) and span > sequence:
        raise ValueError(f"`mask_length` has to be smaller than `sequence_length`, but got `mask_length`: {span} and "
                         f"`sequence_length`: {sequence}`")
    epsilon = torch.rand((), device=device)
    full = torch.full((batch,), sequence, dtype=torch.long, device=device)
    lengths = full if lengths is None else lengths.to(torch.long)

    def spans(length: torch.Tensor) -> torch.Tensor:
        count = torch.floor(prob * length / span + epsilon).long().clamp(min=min_masks)
        count = torch.where(count * span > full, full // span, count)
        room = length - (span - 1)
        return torch.where(room < count, room.clamp(min=0), count)

    count, most = spans(lengths), spans(full)
    positions = torch.arange(sequence, device=device).expand(batch, -1)
    draws = torch.where(positions < (lengths - (span - 1))[:, None], torch.rand(batch, sequence, device=device), 2.0)
    ordered = torch.sort(draws, dim=1).values
    threshold = ordered.gather(1, (count - 1).clamp(min=0)[:, None])
    starts = (draws <= threshold) & (count > 0)[:, None] & (draws < 2.0)
    # a frame is masked where a span started within the span's length before it (counts of starts, differenced)
    started = starts.long().cumsum(1)
    before = torch.cat([torch.zeros(batch, span, dtype=torch.long, device=device), started], 1)[:, :sequence]
    mask = started - before > 0
    padded = (count == 0) & (most > 0)  # a row without spans among rows with some: its last frame
    return mask | ((positions == sequence - 1) & padded[:, None])


def mask_hidden_states(self, hidden_states: torch.Tensor, mask_time_indices: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Hugging Face's ``_mask_hidden_states`` with its spans drawn by :func:`span_mask` (module docstring)."""
    config = self.config
    if not getattr(config, "apply_spec_augment", True):
        return hidden_states
    batch, sequence, hidden = hidden_states.size()
    embed = self.masked_spec_embed.to(hidden_states.dtype) if hasattr(self, "masked_spec_embed") else None
    if mask_time_indices is None and config.mask_time_prob > 0 and self.training:
        lengths = None if attention_mask is None else attention_mask.sum(-1)
        mask_time_indices = span_mask(batch, sequence, config.mask_time_prob, config.mask_time_length,
                                      config.mask_time_min_masks, lengths, hidden_states.device)
    if mask_time_indices is not None:
        hidden_states = torch.where(mask_time_indices.bool()[..., None], embed, hidden_states)
    if config.mask_feature_prob > 0 and self.training:
        features = span_mask(batch, hidden, config.mask_feature_prob, config.mask_feature_length,
                             config.mask_feature_min_masks, None, hidden_states.device)
        hidden_states = hidden_states.masked_fill(features[:, None, :], 0.0)
    return hidden_states


def _known(method: Any) -> bool:
    code = getattr(method, "__code__", None)
    return code is not None and frozenset(code.co_names) == _KNOWN_NAMES


@contextlib.contextmanager
def drawn_in_the_graph(model: torch.nn.Module) -> Iterator[None]:
    """Within: the known ``_mask_hidden_states`` of ``model``'s Hugging Face modules is :func:`mask_hidden_states`."""
    classes = {type(m) for m in model.modules()
               if type(m).__module__.startswith("transformers.") and _known(getattr(type(m), "_mask_hidden_states",
                                                                                     None))}
    swapped = [(cls, cls.__dict__.get("_mask_hidden_states")) for cls in classes]
    try:
        for cls, _ in swapped:
            cls._mask_hidden_states = mask_hidden_states
        yield
    finally:
        for cls, original in swapped:
            if original is None:
                del cls._mask_hidden_states
            else:
                cls._mask_hidden_states = original


__all__ = ["drawn_in_the_graph", "mask_hidden_states", "span_mask"]
