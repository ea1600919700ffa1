"""torch losses whose Python code checks the batch's values before computing: the same arithmetic, with the check
traced where it passes (as ``validations.py`` traces a model's own checks).

The export guard sees a torch function as one call (its torch-function mode is off inside it), so a check inside,
``F.gaussian_nll_loss``'s ``if torch.any(var < 0): raise``, reaches ``torch.export`` as a value read from the data
and stops the trace. The guard has such a call compute the function here instead (``guard.ExportGuard.handle``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .validations import warn_traced_check


def gaussian_nll_loss(input: torch.Tensor, target: torch.Tensor, var: torch.Tensor | float, full: bool = False,
                      eps: float = 1e-6, reduction: str = "mean") -> torch.Tensor:
    """``F.gaussian_nll_loss``: 0.5 · (log(max(var, eps)) + (input - target)² / max(var, eps)), plus 0.5 · log(2π)
    where ``full``, reduced; the clamp passes the gradient through unchanged (torch clamps a copy under no_grad).
    ``var`` is the input's shape, one dimension short of it, or broadcast to it along one dimension of size 1.
    PyTorch's check that no variance is negative is not made for each batch (a negative one is clamped to eps)."""
    if isinstance(var, float):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = torch.full_like(input, var)
    else:
        warn_traced_check("F.gaussian_nll_loss checks that no variance is negative")
    if var.size() != input.size():
        if input.size()[:-1] == var.size():
            var = var.unsqueeze(-1)
        elif not (input.dim() == var.dim() and sum(v for i, v in zip(input.size(), var.size()) if i != v) == 1):
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    clamped = var + (var.clamp(min=eps) - var).detach()  # max(var, eps), the gradient of var itself
    loss = 0.5 * (torch.log(clamped) + (input - target) ** 2 / clamped)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


REPLACEMENTS = {F.gaussian_nll_loss: gaussian_nll_loss}


__all__ = ["REPLACEMENTS", "gaussian_nll_loss"]
