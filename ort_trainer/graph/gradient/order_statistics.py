"""The k-th smallest value and the median along a dimension (``kthvalue``, ``median``, ``nanmedian``), which torch's
ONNX exporter cannot translate, written with a sort (ONNX ``TopK``) and a gather.

``kthvalue(x, k, dim)`` is the k-th entry of ``x`` sorted along ``dim`` (of equal values, the first in ONNX);
``median`` the lower median, the ``(n + 1) // 2``-th, or NaN (and the index of the first NaN) where the row holds
one; ``nanmedian`` the lower median of the row's values that are not NaN (sorted before the NaNs), NaN where all
are. Autograd's formulas are torch's own: the gradient goes to the index returned (where values tie, torch's
kernels may return another of the tied indices, and give it the gradient), and ``median()`` of a whole tensor
shares its gradient among the elements equal to it.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _reduced(values: torch.Tensor, indices: torch.Tensor, dim: int, keepdim: bool) -> tuple:
    return (values, indices) if keepdim else (values.squeeze(dim), indices.squeeze(dim))


def _at(x: torch.Tensor, dim: int, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of ``x`` sorted along ``dim`` at ``position`` (keepdim's shape), and their original indices."""
    ordered, order = torch.sort(x, dim=dim)  # (ONNX TopK: of equal values, the lower index first)
    return ordered.gather(dim, position), order.gather(dim, position)


def kthvalue(self: torch.Tensor, k: int, dim: int = -1, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-th smallest entry along ``dim`` and its index (module docstring)."""
    if self.dim() == 0:
        return self.clone(), torch.zeros((), dtype=torch.long, device=self.device)
    dim = dim % self.dim()
    position = torch.full([*self.shape[:dim], 1, *self.shape[dim + 1:]], k - 1, dtype=torch.long, device=self.device)
    return _reduced(*_at(self, dim, position), dim, keepdim)


def median_dim(self: torch.Tensor, dim: int, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower median along ``dim`` and its index; NaN and the first NaN's index where the row holds one."""
    if self.dim() == 0:
        return self.clone(), torch.zeros((), dtype=torch.long, device=self.device)
    dim = dim % self.dim()
    values, indices = kthvalue(self, (self.shape[dim] + 1) // 2, dim, keepdim=True)
    nan = torch.isnan(self)
    has_nan = nan.any(dim, keepdim=True)
    first_nan = torch.argmax(nan.to(torch.int32), dim=dim, keepdim=True)
    values = torch.where(has_nan, torch.full_like(values, float("nan")), values)
    return _reduced(values, torch.where(has_nan, first_nan, indices), dim, keepdim)


def nanmedian_dim(self: torch.Tensor, dim: int, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower median along ``dim`` of the values that are not NaN, and its index (NaN where all are)."""
    if self.dim() == 0:
        return self.clone(), torch.zeros((), dtype=torch.long, device=self.device)
    dim = dim % self.dim()
    count = (~torch.isnan(self)).sum(dim, keepdim=True)
    return _reduced(*_at(self, dim, ((count - 1) // 2).clamp(min=0)), dim, keepdim)


def median(self: torch.Tensor) -> torch.Tensor:
    """The lower median of all of ``self``'s entries (NaN where one is NaN)."""
    return median_dim(self.reshape(-1), 0)[0]


def nanmedian(self: torch.Tensor) -> torch.Tensor:
    """The lower median of ``self``'s entries that are not NaN."""
    return nanmedian_dim(self.reshape(-1), 0)[0]


DECOMPOSITIONS = {aten.kthvalue.default: kthvalue, aten.median.dim: median_dim, aten.nanmedian.dim: nanmedian_dim,
                  aten.median.default: median, aten.nanmedian.default: nanmedian}

__all__ = ["DECOMPOSITIONS", "kthvalue", "median", "median_dim", "nanmedian", "nanmedian_dim"]
