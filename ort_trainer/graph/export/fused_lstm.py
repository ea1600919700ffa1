"""``nn.LSTM`` as one operator per layer and direction on the ``torch`` route: oneDNN's LSTM kernels, the ones eager
PyTorch trains an ``nn.LSTM`` with on the CPU (``graph_optimizations.fused_lstm``).

``torch.export`` unrolls ``torch.lstm`` over the sequence: every step's gate products and activations, forward and
backward, become nodes of the graph (about 120 per step and layer direction), so the graph is built again for each
sequence length, takes a minute to build at 50 steps, and runs step by step. During the export (the guard's
``handle``) ``torch.lstm`` of a padded (not packed) float32 batch without projections (``proj_size=0``) is computed
here instead, as ATen's oneDNN path computes it (``lstm_mkldnn_stub`` in ``aten/src/ATen/native/mkldnn/RNN.cpp``):
each layer and direction is one ``ort_trainer::lstm_layer`` (``aten.mkldnn_rnn_layer``), a reverse direction reads
the sequence from its end, a bidirectional layer's output is both directions' concatenated, and dropout (in
training) follows every layer but the last. Its registered autograd is ``ort_trainer::lstm_layer_grad``
(``aten.mkldnn_rnn_layer_backward``), which reads the forward's oneDNN workspace: tens of MB, kept by torch between
the two and named by a key the forward outputs (the eval program keeps none). The exporter translates them into
``LSTMLayer`` and ``LSTMLayerGrad`` nodes of ``kernels.TORCH_OPS_DOMAIN`` (``kernels/csrc/torch_rnn.h``): on the CPU
the values are eager PyTorch's, bit for bit. ``save_as_onnx`` writes ONNX's own ``LSTM`` operator instead
(``kernels/standard_lstm.py``). The sequence length may stay symbolic: one graph serves every length.

A packed batch (``packed_sequences``: the padded batch and its ``[steps, batch]`` mask) takes the same layers
through ``masked_direction``: each sequence's steps come first in the kernel's input (a reverse direction reads
each sequence reversed within its own length), the outputs past its end are dropped, ``h_n`` is the output at its
last step, and ``c_n`` is summed in closed form from the gates (``_final_cell``).

Everything else runs ``torch.lstm`` as before (unrolled): projections, other dtypes, mixed precision (CPU
autocast), a device other than the CPU (the switch is off there), and a torch without oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_aten = torch.ops.aten
_LSTM = 2  # ideep::rnn_kind::LSTM: the ``mode`` ATen's oneDNN RNN kernels take for an LSTM


_WORKSPACES: dict[int, torch.Tensor] = {}  # this process's own runs of lstm_layer_op (ONNX Runtime's: torch_rnn.h)


@torch.library.custom_op("ort_trainer::lstm_layer", mutates_args=())
def lstm_layer_op(input: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor, b_hh: torch.Tensor,
                  hx: torch.Tensor, cx: torch.Tensor, reverse: bool,
                  train: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LSTM layer in one direction over ``input [steps, batch, features]`` from the states ``hx``, ``cx``
    ``[batch, hidden]``: ``(output [steps, batch, hidden], h_n, c_n, key)``, ``aten.mkldnn_rnn_layer``'s. With
    ``train`` the kernel's workspace is kept for ``lstm_layer_grad_op``, which ``key`` (int64 ``[1]``) names and
    which releases it (0: none kept)."""
    with torch.enable_grad():  # the kernel keeps its workspace only where autograd may ask for it
        output, hy, cy, workspace = _aten.mkldnn_rnn_layer(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, [], _LSTM,
                                                           w_hh.shape[1], 1, True, False, False, train)
    key = 0
    if train and workspace is not None:
        key = max(_WORKSPACES, default=0) + 1
        _WORKSPACES[key] = workspace
    return output, hy, cy, torch.tensor([key], dtype=torch.int64)


@lstm_layer_op.register_fake
def _lstm_layer_fake(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, train):
    return (input.new_empty(input.shape[0], input.shape[1], w_hh.shape[1]), hx.new_empty(hx.shape),
            cx.new_empty(cx.shape), input.new_empty(1, dtype=torch.int64))


@torch.library.custom_op("ort_trainer::lstm_layer_grad", mutates_args=())
def lstm_layer_grad_op(input: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor,
                       b_hh: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor, output: torch.Tensor, hy: torch.Tensor,
                       cy: torch.Tensor, key: torch.Tensor, grad_output: torch.Tensor, grad_hy: torch.Tensor,
                       grad_cy: torch.Tensor, reverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    """The gradients of ``lstm_layer_op``'s input, weights, biases and initial states given its inputs, outputs
    (``key``: its workspace's) and the gradients of its three outputs: ``aten.mkldnn_rnn_layer_backward``'s."""
    workspace = _WORKSPACES.pop(int(key[0]), None)
    if workspace is None:
        raise RuntimeError("ort_trainer::lstm_layer_grad: the forward kept no workspace for this backward (it ran "
                           "with train=False, or another backward took it)")
    with torch.enable_grad():
        grads = _aten.mkldnn_rnn_layer_backward(input, w_ih, w_hh, b_ih, b_hh, hx, cx, output, hy, cy, grad_output,
                                                grad_hy, grad_cy, reverse, _LSTM, w_hh.shape[1], 1, True, True, False,
                                                [], False, workspace)
    return tuple(grad.clone() if i == 4 else grad for i, grad in enumerate(grads))  # (both biases' is one tensor)


@lstm_layer_grad_op.register_fake
def _lstm_layer_grad_fake(input, w_ih, w_hh, b_ih, b_hh, hx, cx, *_):
    return tuple(torch.empty_like(t) for t in (input, w_ih, w_hh, b_ih, b_hh, hx, cx))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7], *output)
    ctx.reverse = inputs[7]


def _backward(ctx, grad_output, grad_hy, grad_cy, _):
    saved = ctx.saved_tensors
    grads = [torch.zeros_like(value) if grad is None else grad
             for grad, value in zip((grad_output, grad_hy, grad_cy), saved[7:10])]
    return (*torch.ops.ort_trainer.lstm_layer_grad(*saved, *grads, ctx.reverse), None, None)


lstm_layer_op.register_autograd(_backward, setup_context=_setup)
FORWARD, BACKWARD = torch.ops.ort_trainer.lstm_layer.default, torch.ops.ort_trainer.lstm_layer_grad.default


def available() -> bool:
    """Whether this torch has oneDNN's RNN kernels (``torch.backends.mkldnn``)."""
    return torch.backends.mkldnn.is_available()


def _applies(tensors: list[torch.Tensor]) -> bool:
    """Whether oneDNN's kernels take these tensors: float32 on the CPU, outside CPU autocast, oneDNN present."""
    return (available() and not torch.is_autocast_enabled("cpu")
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors))


def _keeps_workspace(workspaces: bool, tensors: list[torch.Tensor]) -> bool:
    return workspaces and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _fused(workspaces, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """``torch.lstm`` (unpacked) with each layer and direction one ``lstm_layer_op`` (keeping its workspace for a
    backward where ``workspaces``), or None where it does not apply (module docstring)."""
    directions = 2 if bidirectional else 1
    per_direction = 4 if has_biases else 2
    tensors = [input, *hx, *params]
    if len(params) != num_layers * directions * per_direction or input.dim() != 3 or not _applies(tensors):
        return None
    hidden = params[1].shape[1]
    needs_workspace = _keeps_workspace(workspaces, tensors)
    layer_input = (input.transpose(0, 1) if batch_first else input).contiguous()
    h0, c0 = hx
    finals_h, finals_c = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w_ih, w_hh, *biases = params[index * per_direction:(index + 1) * per_direction]
            if not biases:
                biases = [w_ih.new_zeros(4 * hidden)] * 2
            output, hy, cy, _ = torch.ops.ort_trainer.lstm_layer(layer_input, w_ih, w_hh, *biases, h0[index],
                                                                 c0[index], direction == 1, needs_workspace)
            outputs.append(output)
            finals_h.append(hy)
            finals_c.append(cy)
        layer_input = torch.cat(outputs, 2) if directions == 2 else outputs[0]
        if dropout and train and layer < num_layers - 1:
            layer_input = F.dropout(layer_input, dropout, True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(finals_h), torch.stack(finals_c)


def masked_direction(workspaces: bool, x: torch.Tensor, running: torch.Tensor, w_ih: torch.Tensor,
                     w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None, h0: torch.Tensor,
                     c0: torch.Tensor, reverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One layer and direction of a packed batch as ``packed_sequences`` holds it (``x [steps, batch, features]``,
    padded; ``running [steps, batch]``: the steps within each sequence) through one ``lstm_layer_op``: the outputs
    (zero past each sequence's end), ``h_n`` and ``c_n`` of PyTorch's packed kernel, or None where oneDNN's kernels
    do not take the tensors. A reverse direction runs forward over each sequence reversed within its own length (so
    it starts at the sequence's end, from the initial states, as PyTorch's packed kernel does). The kernel then sees
    each sequence's steps first and its padding after them: its outputs at a sequence's steps are exact, those past
    its end are dropped (their gradients are zero, which leaves the kernel's backward over the padding at zero), and
    ``h_n`` is the output at the sequence's last step. ``c_n``: ``_final_cell``."""
    tensors = [t for t in (x, w_ih, w_hh, b_ih, b_hh, h0, c0) if t is not None]
    if x.dim() != 3 or not _applies(tensors):
        return None
    hidden = w_hh.shape[1]
    if b_ih is None:
        b_ih = b_hh = w_ih.new_zeros(4 * hidden)
    lengths = running.sum(0)
    rows = _reversed_rows(running, lengths) if reverse else None
    if rows is not None:
        x = _rows(x, rows)
    out, _, _, _ = torch.ops.ort_trainer.lstm_layer(x.contiguous(), w_ih, w_hh, b_ih, b_hh, h0, c0, False,
                                                    _keeps_workspace(workspaces, tensors))
    last = (lengths - 1).clamp(min=0)[None, :, None].expand(1, -1, hidden)
    h = torch.where((lengths > 0)[:, None], out.gather(0, last)[0], h0)  # (a zero length keeps the initial state)
    c = _final_cell(x, out, running, w_ih, w_hh, b_ih, b_hh, h0, c0)
    out = torch.where(running[:, :, None], out, 0.0)
    if rows is not None:
        out = _rows(out, rows)
    return out, h, c


def _reversed_rows(running: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The rows of a ``[steps * batch, ...]`` view that reverse each sequence within its own length (padding rows
    stay): a permutation that is its own inverse. One index per row, not per element (a gather's index would be
    the tensor's size in int64, and its backward keeps it)."""
    steps, batch = running.shape
    step = torch.arange(steps, device=running.device)[:, None]
    order = torch.where(running, lengths - 1 - step, step)
    return (order * batch + torch.arange(batch, device=running.device)).reshape(-1)


def _rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).index_select(0, rows).reshape(x.shape)


def _final_cell(x, out, running, w_ih, w_hh, b_ih, b_hh, h0, c0) -> torch.Tensor:
    """The cell state at each sequence's last step (the kernel returns the padded length's last). The gates read
    only the input and the previous output, which ``out`` holds, so ``i, f, g`` are computed again for every step at
    once, and the recurrence ``c_t = f_t c_{t-1} + i_t g_t``, linear in ``c``, is summed in closed form over each
    sequence's steps: ``c_n = sum_s (prod_{k>s} f_k) i_s g_s + (prod_k f_k) c_0``, each product the exponential of a
    difference of running sums of ``log f`` in float64 (every factor at most 1: no overflow; a float64 sum of T
    logarithms keeps each product to about T·2^-53), rounded to float32 once. No loop over the steps: the length may
    stay symbolic; where nothing reads ``c_n`` the graph leaves all of it out."""
    hidden = w_hh.shape[1]
    previous = torch.cat([h0[None], out[:-1]])
    rows = slice(0, 3 * hidden)  # i, f, g (o is not needed)
    gates = F.linear(x, w_ih[rows], b_ih[rows]) + F.linear(previous, w_hh[rows], b_hh[rows])
    i, f, g = gates.double().chunk(3, -1)
    keep = running[:, :, None]
    log_f = torch.minimum(f, f.new_zeros(())) - torch.log1p(torch.exp(-f.abs()))  # log sigmoid(f), stably
    log_f = torch.where(keep, log_f, 0.0)
    update = torch.where(keep, torch.sigmoid(i) * torch.tanh(g), 0.0)
    summed = log_f.cumsum(0)
    total = summed[-1]
    return ((torch.exp(total - summed) * update).sum(0) + torch.exp(total) * c0.double()).to(c0.dtype)


def replacements(training: bool) -> dict:
    """What the export guard computes instead of ``torch.lstm``: ``_fused`` where it applies, else torch's own (a
    packed batch: the overload whose second argument is the batch sizes). ``training``: the training program's
    trace, whose layers keep their workspaces for the backward (not the eval program's)."""
    def lstm(*args, **kwargs):
        if len(args) == 9 and not kwargs and not isinstance(args[1], torch.Tensor):
            fused = _fused(training, *args)
            if fused is not None:
                return fused
        return torch.lstm(*args, **kwargs)

    return {torch.lstm: lstm}


__all__ = ["BACKWARD", "FORWARD", "available", "lstm_layer_grad_op", "lstm_layer_op", "masked_direction",
           "replacements"]
