"""Packed sequences (``nn.utils.rnn.pack_padded_sequence`` into ``nn.RNN``/``nn.LSTM``/``nn.GRU``) on the
``torch.export`` route, as padded batches whose recurrence is masked by the lengths.

A real packed batch has ``sum(lengths)`` rows, a size read from the lengths' values, which no trace can follow
(the export would fix the traced batch's lengths). The same arithmetic fits the padded batch's shape: the packed
sequence here keeps every padded row (``data`` is the padded ``[T, B, ...]`` batch in time-major order, flattened
to ``[T * B, ...]`` as a packed batch's rows are), with the ``[T, B]`` mask ``t < lengths[b]`` kept aside for its
``batch_sizes``. The recurrent layers step through all ``T`` steps and move each sequence's state only where the
mask is set, so every sequence's state stops at its own last step (a reverse direction starts from there, from the
initial state, as PyTorch's packed kernel does) and the output past a sequence's end is zero.
``pad_packed_sequence`` then returns exactly PyTorch's values, ``padding_value`` past each end, and the lengths.

One difference is in the shape: PyTorch's padded output has ``max(lengths)`` steps (``total_length`` where given),
this one the input batch's ``T`` (``total_length`` where given), the same where each batch is padded to its longest
sequence (``pad_sequence``, ``pack_sequence``). Without ``total_length`` a warning says so once. The rows of a
packed batch's ``.data`` include the padding here, so an operation on ``.data`` outside ``nn.utils.rnn`` is refused
(``data_use``) rather than let padding rows reach a loss.

The gate arithmetic is PyTorch's (``aten/src/ATen/native/RNN.cpp``): LSTM ``i, f, g, o`` with an optional
projection ``h = W_hr h``, GRU ``r, z, n`` with ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``, Elman RNN with
``tanh`` or ``relu``; dropout on every layer's output but the last, in training. An LSTM layer without projections
runs oneDNN's kernels instead where the trace asks for them (``graph_optimizations.fused_lstm``:
``fused_lstm.masked_direction``, the same values to roundoff, one node per layer and direction).
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence

from ..._logging import warn_once
from . import validations
from .trace_tools import TensorSet, methods_replaced

_SKIPPED_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__))  # not the user's frames
_RNN_FILE = os.path.abspath(sys.modules[PackedSequence.__module__].__file__)
READERS = (_RNN_FILE, os.path.abspath(__file__))  # code that may read a packed batch's rows: torch's, this module
_MASKS: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(batch_sizes) -> (batch_sizes, the [T, B] mask)
_DATA = TensorSet()  # the packed batches' data: padding rows included
_CLASSES = (torch.nn.RNN, torch.nn.LSTM, torch.nn.GRU)


def _mask_of(batch_sizes: Any) -> torch.Tensor | None:
    entry = _MASKS.get(id(batch_sizes))
    return entry[1] if entry is not None and entry[0]() is batch_sizes else None


def pack(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``_VF._pack_padded_sequence``: the padded batch's rows, time-major, and per step the sequences still running."""
    padded = input.transpose(0, 1) if batch_first else input
    steps, batch = padded.shape[:2]
    running = torch.arange(steps, device=lengths.device)[:, None] < lengths[None, :]
    batch_sizes = running.sum(1)
    data = padded.reshape(steps * batch, *padded.shape[2:])
    _MASKS[id(batch_sizes)] = (weakref.ref(batch_sizes), running.to(padded.device))
    _DATA.add(data)
    return data, batch_sizes


def pad(data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool, padding_value: float,
        total_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_VF._pad_packed_sequence`` of a batch ``pack`` made (else torch's own)."""
    running = _mask_of(batch_sizes)
    if running is None:
        return torch._pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length)
    steps, batch = running.shape
    padded = data.reshape(steps, batch, *data.shape[1:])
    padded = torch.where(running.reshape(steps, batch, *[1] * (data.dim() - 1)), padded, padding_value)
    if total_length > steps:
        padded = torch.cat([padded, padded.new_full((total_length - steps, *padded.shape[1:]), padding_value)])
    if _caller_total_length() is None:
        line = _user_line()
        warn_once(("pad_packed_sequence", line),
                  "pad_packed_sequence without total_length at %s: the output has the padded input's %d steps; "
                  "PyTorch's has max(lengths) steps, which is the same only where each batch is padded to its longest "
                  "sequence (pad_sequence does that); pass total_length to have the same shape either way",
                  line, steps)
    return (padded.transpose(0, 1) if batch_first else padded), running.sum(0).cpu()


@contextlib.contextmanager
def masked_recurrences(lstm_direction: Callable | None = None) -> Iterator[None]:
    """Around one trace: ``nn.RNN``/``nn.LSTM``/``nn.GRU`` run a packed batch of ``pack`` as a masked recurrence.
    ``lstm_direction``: computes one direction of an LSTM layer without projections instead, where it returns
    anything but None (``fused_lstm.masked_direction``'s arguments after the first)."""
    def forward(original, module, input, hx=None):
        if isinstance(input, PackedSequence) and _mask_of(input.batch_sizes) is not None:
            return _packed_forward(module, input, hx, lstm_direction)
        return original(module, input, hx)

    try:
        with methods_replaced({cls: {"forward": forward} for cls in _CLASSES}):
            yield
    finally:
        _MASKS.clear()
        _DATA.clear()


def data_use(name: str, tensors: list[torch.Tensor]) -> str | None:
    """The problem where ``name`` reads a packed batch's ``.data``, padding rows included (unless called from one of
    ``READERS``: the caller checks)."""
    if not _DATA.any_of(tensors):
        return None
    return (f"{name}() on a PackedSequence's .data in module {{modules}} at {{where}}: packed batches train as padded "
            "batches masked by their lengths, so .data holds the padding rows too; unpack it first "
            "(nn.utils.rnn.pad_packed_sequence) and mask the padding, or compute on the RNN's final state")


def _packed_forward(module: torch.nn.RNNBase, packed: PackedSequence, hx: Any,
                    lstm_direction: Callable | None = None) -> tuple[PackedSequence, Any]:
    running = _mask_of(packed.batch_sizes)
    steps, batch = running.shape
    directions = 2 if module.bidirectional else 1
    out_size = module.proj_size or module.hidden_size
    x = packed.data.reshape(steps, batch, -1)
    lstm = module.mode == "LSTM"
    if hx is None:
        h0 = x.new_zeros(module.num_layers * directions, batch, out_size)
        hx = (h0, x.new_zeros(module.num_layers * directions, batch, module.hidden_size)) if lstm else h0
    else:
        hx = module.permute_hidden(hx, packed.sorted_indices)
    h0, c0 = hx if lstm else (hx, None)
    finals_h, finals_c = [], []
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            computed = None
            if lstm_direction is not None and lstm and not module.proj_size:
                weights = [_weight(module, kind, layer, direction) for kind in ("weight_ih", "weight_hh", "bias_ih",
                                                                                "bias_hh")]
                computed = lstm_direction(x, running, *weights, h0[index], c0[index], direction == 1)
            out, h, c = computed or _direction(module, layer, direction, x, running, h0[index],
                                               None if c0 is None else c0[index])
            outputs.append(out)
            finals_h.append(h)
            finals_c.append(c)
        x = torch.cat(outputs, -1) if directions == 2 else outputs[0]
        if module.dropout and module.training and layer < module.num_layers - 1:
            x = F.dropout(x, module.dropout, True)
    hidden = (torch.stack(finals_h), torch.stack(finals_c)) if lstm else torch.stack(finals_h)
    data = x.reshape(steps * batch, -1)
    _DATA.add(data)
    output = PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    return output, module.permute_hidden(hidden, packed.unsorted_indices)


def _weight(module: torch.nn.RNNBase, kind: str, layer: int, direction: int) -> torch.Tensor | None:
    """The module's ``kind`` (``weight_ih``, ``bias_hh``, ``weight_hr``...) of one layer and direction (None: none)."""
    return getattr(module, f"{kind}_l{layer}" + ("_reverse" if direction else ""), None)


def _direction(module: torch.nn.RNNBase, layer: int, direction: int, x: torch.Tensor, running: torch.Tensor,
               h: torch.Tensor, c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One layer's one direction over all steps: the outputs (zero past each end) and the final states."""
    weight = lambda kind: _weight(module, kind, layer, direction)  # noqa: E731
    # every step's input term in one product, split by unbind (whose gradient is one stack: indexing each step's
    # would add a zero-padded copy of the whole sequence per step)
    inputs = F.linear(x, weight("weight_ih"), weight("bias_ih")).unbind(0)
    # transposed once: F.linear at every step would add a transpose, and one of its gradient, per step
    w_hh, b_hh, w_hr = weight("weight_hh").t(), weight("bias_hh"), weight("weight_hr")
    w_hr = None if w_hr is None else w_hr.t()
    outputs: list[torch.Tensor | None] = [None] * len(inputs)
    running = running.unbind(0)
    for step in (reversed(range(len(inputs))) if direction else range(len(inputs))):
        recurrent = h @ w_hh if b_hh is None else torch.addmm(b_hh, h, w_hh)
        if module.mode == "LSTM":
            i, f, g, o = (inputs[step] + recurrent).chunk(4, -1)
            c_next = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h_next = torch.sigmoid(o) * torch.tanh(c_next)
            if w_hr is not None:
                h_next = h_next @ w_hr
        elif module.mode == "GRU":
            x_r, x_z, x_n = inputs[step].chunk(3, -1)
            h_r, h_z, h_n = recurrent.chunk(3, -1)
            r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
            n = torch.tanh(x_n + r * h_n)
            h_next, c_next = (1 - z) * n + z * h, None
        else:
            h_next = (torch.tanh if module.mode == "RNN_TANH" else torch.relu)(inputs[step] + recurrent)
            c_next = None
        keep = running[step][:, None]
        h = torch.where(keep, h_next, h)
        if c is not None:
            c = torch.where(keep, c_next, c)
        outputs[step] = torch.where(keep, h_next, 0.0)
    return torch.stack(outputs), h, c


def _caller_total_length() -> Any:
    """``total_length`` as the user passed it to ``pad_packed_sequence`` (its frame is torch's, above this call)."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "pad_packed_sequence" and
                                     frame.f_code.co_filename == _RNN_FILE):
        frame = frame.f_back
    return None if frame is None else frame.f_locals.get("total_length")


def _user_line() -> str:
    return validations.frame_line(validations.caller_outside(lambda filename: filename.startswith(_SKIPPED_DIRS)))


REPLACEMENTS = {torch._pack_padded_sequence: pack, torch._pad_packed_sequence: pad}

__all__ = ["REPLACEMENTS", "data_use", "masked_recurrences", "pack", "pad"]
