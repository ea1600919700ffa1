"""CTC loss (``F.ctc_loss``, ``nn.CTCLoss``) as an operator ``torch.export`` can trace: torch's own CTC kernels.

``torch.export`` cannot trace ``F.ctc_loss``: its kernel ``aten._ctc_loss`` also returns the alignment table
``log_alpha``, ``[batch, frames, 2 · longest target + 1]``, whose size comes from the target lengths' values, and
torch's fake tensors cannot size it before the step. On the ``torch`` route the export guard
(``guard.ExportGuard.handle``) has each call compute :func:`ctc_loss` instead: the per-sequence negative
log-likelihoods as ``ort_trainer::ctc_loss``, whose registered autograd is ``ort_trainer::ctc_loss_grad``; the
reduction, ``zero_infinity``'s zeros and the dtypes around them are torch's own arithmetic, as ATen's
``ctc_loss`` writes them. Neither operator has a table among its outputs (the backward computes the forward's
again: CTC's cost is small beside the model's). The exporter translates them into ``CTCLoss`` and ``CTCLossGrad``
nodes of ``kernels.TORCH_OPS_DOMAIN``, which run ``aten._ctc_loss`` and ``aten._ctc_loss_backward`` inside ONNX
Runtime (``kernels/csrc/torch_ops.cc``): the gradients are PyTorch's, bit for bit on the same device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_aten = torch.ops.aten
FUNCTIONS = (F.ctc_loss, torch.ctc_loss)  # what the guard retargets
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # torch.ctc_loss's enum (torch.nn._reduction)


@torch.library.custom_op("ort_trainer::ctc_loss", mutates_args=())
def ctc_loss_op(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                target_lengths: torch.Tensor, blank: int, zero_infinity: bool) -> torch.Tensor:
    """The negative log-likelihood of each sequence's target (``[batch]``, log_probs' dtype; infinite where no
    alignment exists) from log_probs ``[frames, batch, classes]``, targets (``[batch, longest]`` padded, or every
    target concatenated) and int64 lengths ``[batch]``: ``aten._ctc_loss``'s first output. ``zero_infinity`` is
    the backward's (as ``aten._ctc_loss`` takes it)."""
    return _aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)[0]


@ctc_loss_op.register_fake
def _ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return log_probs.new_empty(log_probs.shape[1])


@torch.library.custom_op("ort_trainer::ctc_loss_grad", mutates_args=())
def ctc_loss_grad_op(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                     target_lengths: torch.Tensor, blank: int, zero_infinity: bool) -> torch.Tensor:
    """``ctc_loss_op``'s gradient with respect to log_probs, given ``grad`` of its ``[batch]`` output:
    ``aten._ctc_loss_backward`` after the forward's kernel (its alignment table is not kept between them); with
    ``zero_infinity``, zeros for a sequence whose loss is infinite."""
    nll, log_alpha = _aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    return _aten._ctc_loss_backward.Tensor(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha,
                                           blank, zero_infinity)


@ctc_loss_grad_op.register_fake
def _ctc_loss_grad_fake(grad, log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return torch.empty_like(log_probs)


def _setup(ctx, inputs, output):
    log_probs, targets, input_lengths, target_lengths, blank, zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths)
    ctx.blank, ctx.zero_infinity = blank, zero_infinity


def _backward(ctx, grad):
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    grad_log_probs = torch.ops.ort_trainer.ctc_loss_grad(grad, log_probs, targets, input_lengths, target_lengths,
                                                        ctx.blank, ctx.zero_infinity)
    return grad_log_probs, None, None, None, None, None


ctc_loss_op.register_autograd(_backward, setup_context=_setup)
FORWARD, BACKWARD = torch.ops.ort_trainer.ctc_loss.default, torch.ops.ort_trainer.ctc_loss_grad.default


def _lengths(lengths: Any, device: torch.device) -> torch.Tensor:
    """Lengths given as a tensor, a sequence of ints or one int, as int64 ``[batch]`` on ``device``."""
    if isinstance(lengths, torch.Tensor):
        return lengths.to(device=device, dtype=torch.long).reshape(-1)
    return torch.tensor(lengths, dtype=torch.long, device=device).reshape(-1)


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any, target_lengths: Any, blank: int = 0,
             reduction: str | int = "mean", zero_infinity: bool = False) -> torch.Tensor:
    """``F.ctc_loss`` (and ``torch.ctc_loss``, whose ``reduction`` is torch's enum) over ``ctc_loss_op``, as ATen's
    ``ctc_loss`` computes it: unbatched ``[frames, classes]`` log-probabilities as a batch of one; half-precision
    ones in float32 (the dtype autocast gives ``ctc_loss``; torch's CTC kernels have no half one); infinite losses
    zeroed with ``zero_infinity``; ``"mean"``: each loss divided by its target's length (at least 1), then averaged;
    ``"sum"``; ``"none"``: each sequence's."""
    reduction = _REDUCTIONS.get(reduction, reduction) if isinstance(reduction, int) else reduction
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    batched = log_probs.dim() == 3
    if not batched:
        log_probs = log_probs.unsqueeze(1)
        if targets.dim() == 1 and isinstance(target_lengths, torch.Tensor) and target_lengths.dim() == 0:
            targets = targets.unsqueeze(0)
    if log_probs.dtype in (torch.float16, torch.bfloat16):
        log_probs = log_probs.float()
    device = log_probs.device
    lengths = _lengths(target_lengths, device)
    losses = torch.ops.ort_trainer.ctc_loss(log_probs, targets.to(device=device, dtype=torch.long),
                                            _lengths(input_lengths, device), lengths, int(blank), bool(zero_infinity))
    if zero_infinity:
        losses = torch.where(losses == float("inf"), torch.zeros((), dtype=losses.dtype, device=device), losses)
    if reduction == "mean":
        return (losses / lengths.to(losses.dtype).clamp_min(1)).mean()
    if reduction == "sum":
        return losses.sum()
    return losses if batched else losses.squeeze(0)


__all__ = ["BACKWARD", "FORWARD", "FUNCTIONS", "ctc_loss", "ctc_loss_grad_op", "ctc_loss_op"]
