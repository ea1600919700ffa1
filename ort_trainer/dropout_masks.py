"""Dropout masks drawn on the host for graphs whose Dropouts read them as inputs.

The ``host_dropout_masks`` graph pass (``graph/passes/``) turns each static-shape
Dropout ``y = Dropout(x)`` of a CPU training graph into ``y = x · m``; ``HostDropoutMasks`` fills
every ``m`` before each run with a scaled keep mask: ``1 / keep`` where kept, 0 where dropped.

A step's masks are a function of its seed alone (the trainer's ``(seed, rank, step)``), drawn
from NumPy's PCG64: a resumed run draws what an uninterrupted one would. Each element compares
16 random bits with ``round((1 - p) · 2**16)`` when that puts the drop probability within 1e-4
(relative) of ``p`` (p = 0.1, 0.2, 0.3, 0.5...), else 32 bits (p = 0.01); the scale is the reciprocal of
the probability actually drawn, so the expected output is exactly the input, as in PyTorch. The
buffers are allocated once per graph and written in place each step.

A graph whose Dropouts are ``SeededDropout`` nodes (the ``seeded_dropout`` pass: a GPU step that is captured or
recomputes its sublayers) draws on the device from one seed input, ``DROPOUT_SEED_INPUT``; ``draw`` gives it the
step's seed.
"""

from __future__ import annotations

import numpy as np
import onnx

from .graph.passes.dropout import DROPOUT_SEED_INPUT, host_mask_inputs

__all__ = ["HostDropoutMasks", "keep_threshold"]


def keep_threshold(p: float) -> tuple[int, int]:
    """``(bits, threshold)``: keep an element where a draw of ``bits`` random bits is below
    ``threshold``; the keep probability is ``threshold / 2**bits``."""
    for bits in (16, 32):
        threshold = min(max(round((1.0 - p) * 2.0 ** bits), 1), 2 ** bits)
        if abs(1.0 - threshold / 2.0 ** bits - p) <= 1e-4 * p:  # the drop probability within 1e-4 of p
            break
    return bits, threshold


class HostDropoutMasks:
    """The mask inputs of one graph (``HOST_DROPOUT_MASKS`` in its metadata) and their buffers, and its
    ``SeededDropout`` nodes' seed input.

    Args:
        model: a training graph (none of whose inputs need be masks).
    """

    #: elements drawn at a time: the scratch (random words and keep flags, 3 MB) does not grow with
    #: the largest mask (the draw took 5.7-6.1 ms for the GPT-2-like step's 4.46 M elements with
    #: chunks of 2**16 to 2**23 elements)
    CHUNK = 1 << 20

    def __init__(self, model: onnx.ModelProto):
        shapes = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in model.graph.input}
        self._masks = [(name, np.empty(shapes[name], np.float32), *keep_threshold(p))
                       for name, p in host_mask_inputs(model).items()]
        self._keep = np.empty(self.CHUNK, np.bool_) if self._masks else None
        self._seeded = DROPOUT_SEED_INPUT in shapes

    def __bool__(self) -> bool:
        return bool(self._masks) or self._seeded

    def draw(self, seed: int) -> dict[str, np.ndarray]:
        """Fill every mask for a run seeded ``seed``; returns ``{input name: mask}`` (the buffers are rewritten
        by the next call: bind them for one run), with the seed input's ``[seed mod 2**63]`` too."""
        generator = np.random.PCG64(seed)
        out = {DROPOUT_SEED_INPUT: np.array([seed % 2**63], np.int64)} if self._seeded else {}
        for name, buffer, bits, threshold in self._masks:
            out[name] = buffer
            flat = buffer.reshape(-1)
            if threshold >= 2 ** bits:  # p = 0: every element kept
                flat.fill(1.0)
                continue
            scale, per_word = np.float32(2.0 ** bits / threshold), 64 // bits
            draw_type = np.uint16 if bits == 16 else np.uint32
            for begin in range(0, flat.size, self.CHUNK):
                part = flat[begin:begin + self.CHUNK]
                keep = self._keep[:part.size]
                draws = generator.random_raw(-(-part.size // per_word)).view(draw_type)[:part.size]
                np.less(draws, threshold, out=keep)
                np.multiply(keep, scale, out=part)
        return out
