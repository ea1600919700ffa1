"""torch functions whose own forms the export cannot translate, computed with ones it can (the export guard calls
these in their place, ``guard.ExportGuard.handle``).

- ``Tensor.fill_diagonal_`` writes through a strided view of the tensor (``as_strided``), which functionalisation
  turns into ``as_strided_scatter``, an operator torch's ONNX exporter cannot translate. A contrastive loss that
  masks each sample's similarity with itself (``similarity.fill_diagonal_(-inf)``) stopped the export there. The
  same positions are a constant mask of the shape: for a matrix, where row equals column, or, with ``wrap=True``,
  every ``columns + 1``-th element in memory order (a tall matrix's diagonal restarting below itself, as torch's
  does); for more dims (all of one size), where every index is equal. ``masked_fill_`` of that mask changes the
  tensor in place, as torch's does.
- ``F.embedding(..., sparse=True)`` (``nn.Embedding(sparse=True)``) asks autograd for a sparse gradient of the
  table, a sparse tensor the exporter cannot translate: the graph's gradient is dense, the same values (the
  trainer's optimizers update dense weights; with ``torch.optim.SGD`` a sparse step moves the same rows).
- ``F.bilinear`` (``nn.Bilinear``, ``torch.bilinear``) is ATen's ``_trilinear``, which the exporter cannot translate
  either: here the ``einsum`` it is, ``y[..., o] = Σ x1[..., i] W[o, i, j] x2[..., j] + b[o]``, which contracts
  through matrix products (torch's kernel does too), never a ``[..., o, i, j]`` product.
- ``torch.combinations`` selects from a triangle mask with ``masked_select``, whose size the trace takes from the
  mask's values (it stopped with "Pending unbacked symbols"); the size is ``C(n, r)`` (with replacement
  ``C(n + r - 1, r)``) for a 1-d tensor of ``n`` elements: the index of every combination is a constant, in torch's
  (lexicographic) order, and the result the input gathered at it (DLRM- and factorisation-machine-style pairwise
  feature interactions).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def fill_diagonal_(tensor: torch.Tensor, fill_value: float, wrap: bool = False) -> torch.Tensor:
    """``tensor.fill_diagonal_(fill_value, wrap)`` (module docstring); other shapes left to torch's (its error)."""
    shape = tensor.shape
    if tensor.dim() < 2 or not all(isinstance(size, int) for size in shape) or \
            (tensor.dim() > 2 and len(set(shape)) != 1):
        return torch.Tensor.fill_diagonal_(tensor, fill_value, wrap)
    indices = [torch.arange(size, device=tensor.device) for size in shape]
    if tensor.dim() == 2:
        rows, columns = indices[0][:, None], indices[1][None, :]
        mask = (rows * shape[1] + columns) % (shape[1] + 1) == 0 if wrap else rows == columns
    else:
        grids = torch.meshgrid(*indices, indexing="ij")
        mask = torch.stack([grid == grids[0] for grid in grids[1:]]).all(0)
    return tensor.masked_fill_(mask, fill_value)


def bilinear(input1: torch.Tensor, input2: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.bilinear`` as an ``einsum`` (module docstring)."""
    out = torch.einsum("...i,oij,...j->...o", input1, weight, input2)
    return out if bias is None else out + bias


def embedding(input: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None, max_norm: float | None = None,
              norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """``F.embedding`` with a dense gradient (module docstring)."""
    return F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, False)


def combinations(input: torch.Tensor, r: int = 2, with_replacement: bool = False) -> torch.Tensor:
    """``torch.combinations`` as a gather at constant indices (module docstring); other cases left to torch's."""
    if input.dim() != 1 or not isinstance(input.shape[0], int) or r < 1:
        return torch.combinations(input, r, with_replacement)
    pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    rows = list(pick(range(input.shape[0]), r))
    if not rows:
        return input.new_empty((0, r))
    return input[torch.tensor(rows, device=input.device)]


REPLACEMENTS = {torch.Tensor.fill_diagonal_: fill_diagonal_, torch.bilinear: bilinear, F.embedding: embedding,
                torch.combinations: combinations}

__all__ = ["REPLACEMENTS", "bilinear", "combinations", "embedding", "fill_diagonal_"]
