"""The k-th smallest value and the median along a dimension (``kthvalue``, ``median``, ``nanmedian``), and the running
maximum and minimum (``cummax``, ``cummin``), which torch's ONNX exporter cannot translate: the first written with
a sort (ONNX ``TopK``) and a gather, the running ones with a comparison of every position with every earlier one
(a ``[length, length]`` triangle per row along the dim, as ``cumprod``'s decomposition) and a gather.

``kthvalue(x, k, dim)`` is the k-th entry of ``x`` sorted along ``dim`` (of equal values, the first in ONNX);
``median`` the lower median, the ``(n + 1) // 2``-th, or NaN (and the index of the first NaN) where the row holds
one; ``nanmedian`` the lower median of the row's values that are not NaN (sorted before the NaNs), NaN where all
are. ``cummax`` at each position is the row's largest value up to it, with the index of its last occurrence
(torch's kernel takes a later equal value), NaN and the last NaN's index once a NaN came; ``cummin`` likewise.
Autograd's formulas are torch's own: the gradient goes to the index returned (where values tie, torch's
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


def _running(self: torch.Tensor, dim: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The running maximum (``largest``) or minimum along ``dim`` and its indices (module docstring): the indices
    found on the values without gradient, the values gathered at them (the gradient goes to them, as torch's)."""
    if self.dim() == 0:
        return self.clone(), torch.zeros((), dtype=torch.int64, device=self.device)
    dim = dim % self.dim()
    positions = torch.arange(self.shape[dim], device=self.device)
    earlier = positions.unsqueeze(1) <= positions  # [source, target]: the source at or before the target
    source = positions.unsqueeze(1)
    for _ in range(self.dim() - dim - 1):
        earlier, source = earlier.unsqueeze(-1), source.unsqueeze(-1)
    values = self.detach().unsqueeze(dim + 1)  # the sources along dim, the targets along dim + 1
    nan = torch.isnan(values)
    if self.is_floating_point():
        bound = float("-inf") if largest else float("inf")
    else:
        bound = torch.iinfo(self.dtype).min if largest else torch.iinfo(self.dtype).max
    candidates = torch.where(earlier & ~nan, values, bound)
    best = (candidates.amax if largest else candidates.amin)(dim, keepdim=True)
    came = (earlier & nan).any(dim, keepdim=True)  # a NaN at or before the target
    hit = earlier & ((came & nan) | (~came & (values == best)))  # (ONNX Runtime has no Where of booleans)
    indices = torch.where(hit, source, -1).amax(dim)
    return self.gather(dim, indices), indices


def cummax(self: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running maximum along ``dim`` and its indices (module docstring)."""
    return _running(self, dim, largest=True)


def cummin(self: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running minimum along ``dim`` and its indices (module docstring)."""
    return _running(self, dim, largest=False)


DECOMPOSITIONS = {aten.kthvalue.default: kthvalue, aten.median.dim: median_dim, aten.nanmedian.dim: nanmedian_dim,
                  aten.median.default: median, aten.nanmedian.default: nanmedian, aten.cummax.default: cummax,
                  aten.cummin.default: cummin}

__all__ = ["DECOMPOSITIONS", "cummax", "cummin", "kthvalue", "median", "median_dim", "nanmedian", "nanmedian_dim"]
