"""Cholesky factorisations and triangular solves (``torch.linalg.cholesky``, ``solve_triangular``,
``cholesky_solve``, ``cholesky_inverse``) written in tensor operations the export can trace and differentiate.

ONNX has no Cholesky and no triangular solve, and torch's exporter translates neither (nor their backwards). The
distributions that hold a covariance (``torch.distributions.MultivariateNormal``, ``LowRankMultivariateNormal``),
Gaussian-process marginal likelihoods and normalising flows need them. On the ``torch`` route the export guard has
each call compute the functions below instead, for real matrices of a size the trace knows (an ``int``) up to
``MAX_ROWS`` rows; others are left to torch's operators, which the export refuses, naming them:

- ``cholesky(A)`` is right-looking by blocks of ``BLOCK`` rows: each diagonal block's factor, the panel below it
  as ``A21 L11⁻ᵀ`` (``ort_trainer::inverse``, ``linalg.py``), and the trailing block less ``L21 L21ᵀ``. A
  diagonal block is factored in one batch of operations rather than a column at a time: column ``j`` of its
  factor is the Schur complement of its leading ``j × j`` block, ``s = B[:, j] - B[:, :j] B[:j, :j]⁻¹ B[:j, j]``,
  over ``sqrt(s[j])``, with all ``j``'s leading blocks inverted in one batched inverse (``b⁴`` operations for a
  block of ``b`` rows). The graph has a few dozen nodes a block instead of a few a column: a 256-row factor
  builds in ~12 s instead of minutes. The factor equals LAPACK's to float32 rounding times the matrix's
  condition (as LAPACK's own does). It reads ``A``'s lower triangle (``upper=True``: the upper one, giving ``U =
  Lᵀ``), as torch's does, mirrored; the gradient reaches ``A`` symmetrised, ``(G + Gᵀ) / 2``, torch's convention
  (its ``cholesky_backward`` returns a symmetric gradient, the one representer of the derivative along
  symmetric changes). ``cholesky_ex``'s ``info`` is torch's: the order of the first leading minor that is not
  positive definite, 0 where there is none. A matrix that is not positive definite gives NaN where torch raises
  (``cholesky``; ``cholesky_ex`` gives torch's ``info`` and values that are not a factor).
- ``solve_triangular(A, B)`` is the inverse of ``A``'s triangle (``unitriangular``: with ones on its diagonal)
  times ``B`` (``left=False``: ``B`` times it), so its gradient reaches that triangle only, as torch's does. The
  solution is the substitution's to the inverse's rounding, cond(A) · 2^-24 relative (as ``linalg.solve``'s).
- ``cholesky_solve(B, L)`` is the two triangular solves, ``cholesky_inverse(L)`` them applied to the identity;
  the deprecated ``torch.cholesky`` and ``torch.triangular_solve`` map to the same.
"""

from __future__ import annotations

import torch

from ..._logging import warn_once
from . import linalg

MAX_ROWS = 1024  # the most rows of a factorised or solved matrix (module docstring: a ~45 s build)
BLOCK = 32  # the rows of a diagonal block of the factorisation


def _rows(A: torch.Tensor) -> int | None:
    """The matrix's row count where it is a real square matrix with a size the trace knows, at most MAX_ROWS;
    else None (with a warning saying why, where the size is the reason): torch's operator is then traced, which
    the export refuses, naming it."""
    if A.is_complex() or A.dim() < 2 or not A.is_floating_point():
        return None
    n, m = A.shape[-2], A.shape[-1]
    if not isinstance(n, int) or not isinstance(m, int) or n > MAX_ROWS:
        warn_once(("cholesky size", str(n)), "a Cholesky factorisation or triangular solve of matrices of %s rows: "
                  "ort_trainer writes those of a fixed size (an int in the model description) of at most %d rows; "
                  "this one is left to torch's operator, which the export cannot differentiate", n, MAX_ROWS)
        return None
    return n if n == m else None


def _symmetric_read(A: torch.Tensor) -> torch.Tensor:
    """``A``'s lower triangle mirrored: its value. Its gradient: the symmetrised one, ``(G + Gᵀ) / 2``."""
    mirrored = A.tril() + A.tril(-1).mT
    halves = 0.5 * (A + A.mT)
    return mirrored.detach() + (halves - halves.detach())


def _inverse(A: torch.Tensor) -> torch.Tensor:
    return linalg.inverse_op(A)  # ``ort_trainer::inverse``: ONNX Runtime's Inverse


def _block_factor(B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower Cholesky factor of the symmetric matrices ``B`` (``[..., b, b]``) and each column's pivot, in one
    batch of operations: column ``j`` is the Schur complement of the leading ``j × j`` block, ``s = B[:, j] -
    B[:, :j] B[:j, :j]⁻¹ B[:j, j]``, over ``sqrt(s[j])`` (module docstring). The ``b`` leading blocks' inverses are
    one batched inverse of ``B`` with rows and columns from ``j`` on replaced by the identity's."""
    b = B.shape[-1]
    index = torch.arange(b, device=B.device)
    leading = (index[:, None, None] > index[None, :, None]) & (index[:, None, None] > index[None, None, :])  # [j, r, c]
    eye = torch.eye(b, dtype=B.dtype, device=B.device)
    blocks = torch.where(leading, B.unsqueeze(-3), eye)  # [..., j, b, b]
    inverses = torch.where(leading, _inverse(blocks), torch.zeros((), dtype=B.dtype, device=B.device))
    columns = B.mT  # row j: column j of B
    weights = (inverses @ columns.unsqueeze(-1)).squeeze(-1)  # row j: B[:j, :j]⁻¹ B[:j, j], zero from j on
    schur = columns - weights @ columns  # row j: column j's Schur complement (B symmetric: B @ w = (wᵀ Bᵀ)ᵀ)
    pivots = torch.diagonal(schur, dim1=-2, dim2=-1)
    factor = (schur / pivots.sqrt().unsqueeze(-1)).mT.tril()
    return factor, pivots


def _lower_factor(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower Cholesky factor of the symmetric matrices ``A``, by blocks of ``BLOCK`` rows (right-looking: each
    diagonal block by ``_block_factor``, the panel below it through the block factor's inverse, the rest updated),
    and torch's ``info``."""
    n = A.shape[-1]
    blocks, pivots = [], []
    rest = A
    for start in range(0, n, BLOCK):
        size = min(BLOCK, n - start)
        diagonal, pivot = _block_factor(rest[..., :size, :size])
        pivots.append(pivot)
        if size == rest.shape[-1]:
            blocks.append(diagonal)
            break
        panel = rest[..., size:, :size] @ _inverse(diagonal).mT  # L21 = A21 L11⁻ᵀ
        blocks.append(torch.cat([diagonal, panel], -2))
        rest = rest[..., size:, size:] - panel @ panel.mT
    factor = torch.cat([torch.nn.functional.pad(block, (0, 0, n - block.shape[-2], 0)) for block in blocks], -1)
    failed = ~(torch.cat(pivots, -1) > 0)  # NaN too
    first = torch.argmax(failed.to(torch.int32), -1)  # the first True (0 where there is none)
    info = torch.where(failed.any(-1), first + 1, torch.zeros_like(first)).to(torch.int32)
    return factor, info


def _refined(matrix: torch.Tensor, rough: torch.Tensor) -> torch.Tensor:
    """One step of the Cholesky derivative's formula from the factor ``rough`` (taken as a constant):
    ``L₀ + L₀ Φ(L₀⁻¹ (A - L₀ L₀ᵀ) L₀⁻ᵀ)``, Φ the lower triangle with its diagonal halved. Its value is a better
    factor of ``matrix`` (Newton's step), its gradient the analytic one at ``L₀`` (torch's ``cholesky_backward``)."""
    inverse = _inverse(rough)
    correction = inverse @ (matrix - rough @ rough.mT) @ inverse.mT
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    return rough + rough @ (correction.tril() - 0.5 * correction * eye)


def _factor(A: torch.Tensor, upper: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The factor of ``A`` (``upper``: ``A = Uᵀ U`` from its upper triangle, the lower factor of ``Aᵀ``
    transposed) and torch's ``info``: the blocked factor, without gradient, refined twice (``_refined``), the
    second time with the gradient. The blocked factor loses up to ~5x LAPACK's rounding to the leading blocks'
    inverses, and the analytic gradient at it ~10x: the first step brings the factor to LAPACK's accuracy, the
    second evaluates the gradient at that one (a matrix of condition 250: factor and gradient within 1.4x of
    torch's float32 errors). Autograd never goes through the blocked algorithm."""
    matrix = _symmetric_read(A.mT if upper else A)
    rough, info = _lower_factor(matrix.detach())
    factor = _refined(matrix, _refined(matrix.detach(), rough).detach())
    return (factor.mT if upper else factor), info


@linalg.in_float32
def cholesky(A: torch.Tensor, *, upper: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.linalg.cholesky`` (module docstring)."""
    if out is not None or _rows(A) is None:
        return torch.linalg.cholesky(A, upper=upper, out=out)
    return _factor(A, upper)[0]


@linalg.in_float32
def cholesky_ex(A: torch.Tensor, *, upper: bool = False, check_errors: bool = False,
                out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.cholesky_ex``, with torch's ``info``; ``check_errors`` cannot raise in a graph: the
    factor is computed as where it would pass."""
    if out is not None or _rows(A) is None:
        return torch.linalg.cholesky_ex(A, upper=upper, check_errors=check_errors, out=out)
    return torch.return_types.linalg_cholesky_ex(_factor(A, upper))


@linalg.in_float32
def cholesky_deprecated(A: torch.Tensor, upper: bool = False, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.cholesky`` / ``Tensor.cholesky`` (``upper`` positional)."""
    if out is not None or _rows(A) is None:
        return torch.cholesky(A, upper, out=out)
    return _factor(A, upper)[0]


def _substitute(T: torch.Tensor, B: torch.Tensor, upper: bool, unitriangular: bool) -> torch.Tensor:
    """``X`` with ``T X = B``, ``T`` triangular (``[..., n, n]``; only its triangle read), ``B`` ``[..., n, k]``:
    the triangle's inverse times ``B``."""
    triangle = T.triu(1 if unitriangular else 0) if upper else T.tril(-1 if unitriangular else 0)
    if unitriangular:
        triangle = triangle + torch.eye(T.shape[-1], dtype=T.dtype, device=T.device)
    return _inverse(triangle) @ B


@linalg.in_float32
def solve_triangular(A: torch.Tensor, B: torch.Tensor, *, upper: bool, left: bool = True,
                     unitriangular: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.linalg.solve_triangular`` (module docstring)."""
    if out is not None or _rows(A) is None or B.is_complex() or B.dim() < 2:
        return torch.linalg.solve_triangular(A, B, upper=upper, left=left, unitriangular=unitriangular, out=out)
    if left:
        return _substitute(A, B, upper, unitriangular)
    # X A = B  <=>  Aᵀ Xᵀ = Bᵀ, Aᵀ triangular the other way
    return _substitute(A.mT, B.mT, not upper, unitriangular).mT


@linalg.in_float32
def triangular_solve(b: torch.Tensor, A: torch.Tensor, upper: bool = True, transpose: bool = False,
                     unitriangular: bool = False, *, out: tuple | None = None):
    """The deprecated ``torch.triangular_solve`` (``b`` first): the solution and a copy of ``A``."""
    if out is not None or _rows(A) is None or b.is_complex():
        return torch.triangular_solve(b, A, upper, transpose, unitriangular, out=out)
    T = A.mT if transpose else A
    solution = _substitute(T, b, upper != transpose, unitriangular)
    return torch.return_types.triangular_solve((solution, A.clone()))


@linalg.in_float32
def cholesky_solve(B: torch.Tensor, L: torch.Tensor, upper: bool = False, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.cholesky_solve``: ``X`` with ``L Lᵀ X = B`` (``upper``: ``Uᵀ U X = B``), two substitutions."""
    if out is not None or _rows(L) is None or B.is_complex():
        return torch.cholesky_solve(B, L, upper, out=out)
    lower = L.mT if upper else L
    return _substitute(lower.mT, _substitute(lower, B, False, False), True, False)


@linalg.in_float32
def cholesky_inverse(L: torch.Tensor, upper: bool = False, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.cholesky_inverse``: ``(L Lᵀ)⁻¹`` as ``cholesky_solve`` of the identity."""
    if out is not None or _rows(L) is None:
        return torch.cholesky_inverse(L, upper, out=out)
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand(L.shape)
    return cholesky_solve(eye, L, upper)


REPLACEMENTS = {torch.linalg.cholesky: cholesky, torch.linalg.cholesky_ex: cholesky_ex,
                torch.cholesky: cholesky_deprecated, torch.Tensor.cholesky: cholesky_deprecated,
                torch.linalg.solve_triangular: solve_triangular, torch.triangular_solve: triangular_solve,
                torch.Tensor.triangular_solve: triangular_solve, torch.cholesky_solve: cholesky_solve,
                torch.Tensor.cholesky_solve: cholesky_solve, torch.cholesky_inverse: cholesky_inverse,
                torch.Tensor.cholesky_inverse: cholesky_inverse}

__all__ = ["MAX_ROWS", "REPLACEMENTS", "cholesky", "cholesky_deprecated", "cholesky_ex", "cholesky_inverse",
           "cholesky_solve", "solve_triangular", "triangular_solve"]
