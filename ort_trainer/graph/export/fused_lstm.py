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

Everything else runs ``torch.lstm`` as before (unrolled): packed batches (``packed_sequences``), projections,
other dtypes, mixed precision (CPU autocast), a device other than the CPU (the switch is off there), and a torch
without oneDNN.
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


def _fused(workspaces, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """``torch.lstm`` (unpacked) with each layer and direction one ``lstm_layer_op`` (keeping its workspace for a
    backward where ``workspaces``), or None where it does not apply (module docstring)."""
    directions = 2 if bidirectional else 1
    per_direction = 4 if has_biases else 2
    tensors = [input, *hx, *params]
    if (not available() or len(params) != num_layers * directions * per_direction or input.dim() != 3
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors)
            or torch.is_autocast_enabled("cpu")):
        return None
    hidden = params[1].shape[1]
    needs_workspace = workspaces and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
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


__all__ = ["BACKWARD", "FORWARD", "available", "lstm_layer_grad_op", "lstm_layer_op", "replacements"]
