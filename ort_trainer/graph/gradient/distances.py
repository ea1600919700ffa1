"""``torch.cdist``'s and ``F.pdist``'s kernels and their backwards (``_cdist_forward``, ``_cdist_backward``,
``_pdist_forward``, ``_pdist_backward``), which torch's ONNX exporter cannot translate, written with differences
and reductions (``pdist``: the pairs i < j of the rows' ``cdist``, gathered).

``torch.cdist`` runs its own kernel for p-norms other than 2 and for Euclidean distances between at most 25 rows
(larger ones are a matrix product, which translates). Here the distance of rows ``a`` of x1 and ``b`` of x2 is the
p-norm of ``a - b`` (p = 0: the count of differing entries; p = ∞: the largest difference), from a
``[..., rows1, rows2, columns]`` tensor of differences: for small sets of rows. Its gradient with respect to x1 is
torch's kernel's: ``grad · sign(d) · |d|^(p-1) / dist^(p-1)`` summed over x2's rows, 0 where the distance is 0
(and, for p < 1, where a difference is 0); for p = ∞ the gradient of the largest differences; for p = 0, none.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _differences(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    return x1.unsqueeze(-2) - x2.unsqueeze(-3)  # [..., rows1, rows2, columns]


def cdist_forward(x1: torch.Tensor, x2: torch.Tensor, p: float, compute_mode=None) -> torch.Tensor:
    """The p-norm distances between the rows of x1 and those of x2 (module docstring)."""
    d = _differences(x1, x2)
    if p == 0:
        return (d != 0).sum(-1).to(x1.dtype)
    if p == 1:
        return d.abs().sum(-1)
    if p == 2:
        return d.square().sum(-1).sqrt()
    if math.isinf(p):
        return d.abs().amax(-1)
    return (d.abs() ** p).sum(-1) ** (1.0 / p)


def cdist_backward(grad: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, p: float,
                   cdist: torch.Tensor) -> torch.Tensor:
    """The gradient of ``cdist_forward`` with respect to x1, given ``grad`` of its output ``cdist``."""
    if p == 0:
        return torch.zeros_like(x1)
    d = _differences(x1, x2)
    g, dist = grad.unsqueeze(-1), cdist.unsqueeze(-1)
    zero = torch.zeros((), dtype=x1.dtype, device=x1.device)
    if p == 1:
        terms = g * torch.sign(d)
    elif p == 2:
        terms = torch.where(dist == 0, zero, g * d / dist)
    elif math.isinf(p):
        terms = g * torch.sign(d) * (d.abs() == dist).to(x1.dtype)
    else:
        skip = (dist == 0) | ((d == 0) & (p < 1))
        terms = torch.where(skip, zero, g * torch.sign(d) * d.abs() ** (p - 1) / dist ** (p - 1))
    return terms.sum(-2)


def _pairs(n, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows (i, j), i < j, of ``pdist``'s output, in its order (i, then j): pair k's i is the largest with
    k >= i·n - i(i+1)/2, found by the quadratic formula in float64 and corrected by one where it rounded."""
    k = torch.arange(n * (n - 1) // 2, device=device)
    i = torch.floor(n - 0.5 - torch.sqrt((n - 0.5) ** 2 - 2.0 * k.to(torch.float64))).to(torch.long).clamp(min=0)
    start = i * n - i * (i + 1) // 2  # the first pair of row i
    i = torch.where(k < start, i - 1, torch.where(k >= start + (n - 1 - i), i + 1, i))
    start = i * n - i * (i + 1) // 2
    return i, k - start + i + 1


def pdist_forward(self: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    """``F.pdist``: the distances between the rows of ``self`` [n, m], pair (i, j) for i < j, in order."""
    i, j = _pairs(self.shape[0], self.device)
    return cdist_forward(self, self, p)[i, j]


def pdist_backward(grad: torch.Tensor, self: torch.Tensor, p: float, pdist: torch.Tensor) -> torch.Tensor:
    """``pdist_forward``'s gradient: each pair's, to both its rows (``cdist_backward`` of the pairs' matrix and of
    its transpose, with the forward's distances ``pdist`` placed likewise)."""
    n = self.shape[0]
    i, j = _pairs(n, self.device)
    zeros = torch.zeros(n, n, dtype=grad.dtype, device=grad.device)
    full = zeros.index_put((i, j), grad)
    upper = zeros.index_put((i, j), pdist)
    dist = upper + upper.transpose(0, 1)  # the forward's distances, both ways (the diagonal's 0 has no gradient)
    return cdist_backward(full, self, self, p, dist) + cdist_backward(full.transpose(0, 1), self, self, p, dist)


DECOMPOSITIONS = {aten._cdist_forward.default: cdist_forward, aten._cdist_backward.default: cdist_backward,
                  aten._pdist_forward.default: pdist_forward, aten._pdist_backward.default: pdist_backward}

__all__ = ["DECOMPOSITIONS", "cdist_backward", "cdist_forward", "pdist_backward", "pdist_forward"]
