"""Attention masks of ``nn.Transformer`` and its encoder and decoder taken as given within a trace.

``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` ask ``_detect_is_causal_mask`` whether a mask they are given
(``tgt_mask=nn.Transformer.generate_square_subsequent_mask(n)``, as every seq2seq tutorial passes it) is the causal
one: ``bool((mask == causal).all())``, a read of the mask's values into Python, which an export cannot make
(torch.export stopped with "Could not guard on data-dependent expression"). The answer only picks a faster kernel
for the same values: the mask is applied either way. Within a trace a mask not declared causal (``tgt_is_causal``,
``is_causal``) is taken as a general one.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from torch.nn.modules import transformer as _transformer


@contextlib.contextmanager
def taken_as_given() -> Iterator[None]:
    """Around one trace: on the tracing thread, a mask is causal where the caller says so, never from its values."""
    original, thread = _transformer._detect_is_causal_mask, threading.get_ident()

    def detect(mask, is_causal=None, size=None):
        if threading.get_ident() != thread:
            return original(mask, is_causal, size)
        return is_causal is True

    _transformer._detect_is_causal_mask = detect
    try:
        yield
    finally:
        _transformer._detect_is_causal_mask = original


__all__ = ["taken_as_given"]
