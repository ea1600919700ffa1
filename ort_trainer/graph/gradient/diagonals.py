"""Writing into a diagonal: ``diagonal_scatter`` and the backward of ``torch.diagonal`` (``diagonal_backward``).

Autograd's gradient of ``torch.diagonal`` (``torch.diag`` of a matrix, ``Tensor.diagonal``: a trace, a
Barlow-Twins or VICReg loss, the log-determinant of a Cholesky factor in ``MultivariateNormal.log_prob``) is
``diagonal_backward``, which torch decomposes into ``diagonal_scatter`` of a zero tensor, and torch's reference
of that writes into a view of a clone (``prims.copy_to``): the joint trace then stops with "aot_autograd expected
to have an entirely functional graph". An in-place write into a diagonal in the forward (``x.diagonal().add_(1)``,
``fill_diagonal_``) is functionalised into the same ``diagonal_scatter``. Here the scatter is a ``where`` of a
``[rows, columns]`` mask of the diagonal's positions over the input with its two dims moved last. The
diagonal's element ``k`` sits at row ``k``, column ``k + offset`` (offset >= 0) or at row ``k - offset``, column
``k`` (offset < 0), so the source, indexed by row (or by column) and broadcast along the other dim, is picked where
the mask holds. Values equal torch's exactly (no arithmetic).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def diagonal_scatter(input: torch.Tensor, src: torch.Tensor, offset: int = 0, dim1: int = 0,
                     dim2: int = 1) -> torch.Tensor:
    """``input`` with its diagonal (``torch.diagonal(input, offset, dim1, dim2)``) replaced by ``src``."""
    dim1, dim2 = dim1 % input.dim(), dim2 % input.dim()
    others = [d for d in range(input.dim()) if d not in (dim1, dim2)]
    order = [*others, dim1, dim2]
    moved = input.permute(order)  # [..., rows, columns]
    rows, columns = moved.shape[-2], moved.shape[-1]
    row = torch.arange(rows, device=input.device)
    column = torch.arange(columns, device=input.device)
    mask = (column[None, :] - row[:, None]) == offset
    length = src.shape[-1]
    if length == 0:
        return input.clone()
    src = src.to(input.dtype)
    if offset >= 0:  # element k at row k: each row takes src[..., row] (rows past the diagonal: masked out)
        values = torch.index_select(src, -1, row.clamp(max=length - 1))[..., :, None]
    else:  # element k at column k
        values = torch.index_select(src, -1, column.clamp(max=length - 1))[..., None, :]
    scattered = torch.where(mask, values, moved)
    inverse = [order.index(d) for d in range(input.dim())]
    return scattered.permute(inverse)


def diagonal_backward(grad: torch.Tensor, input_sizes: list, offset: int, dim1: int, dim2: int) -> torch.Tensor:
    """The gradient of ``torch.diagonal``: ``grad`` on the diagonal of zeros of the input's size."""
    return diagonal_scatter(grad.new_zeros(input_sizes), grad, offset, dim1, dim2)


DECOMPOSITIONS = {aten.diagonal_scatter.default: diagonal_scatter, aten.diagonal_backward.default: diagonal_backward}

__all__ = ["DECOMPOSITIONS", "diagonal_backward", "diagonal_scatter"]
