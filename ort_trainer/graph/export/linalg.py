"""Matrix inverses, solves and determinants (``torch.linalg.inv``, ``solve``, ``det``, ``slogdet``) as operators the
export can differentiate and translate.

torch's joint trace fails on ``linalg_inv`` (its ``info`` output), and the exporter has no translation for the
LU solves that ``det``'s and ``solve``'s backwards use. On the ``torch`` route the export guard
(``guard.ExportGuard.handle``) has each call compute the functions below instead:

- ``inv(A)`` is ``ort_trainer::inverse``, translated into ONNX Runtime's ``com.microsoft`` ``Inverse`` (float32,
  float64, float16; batched), whose registered autograd is torch's formula, ``-A⁻ᵀ G A⁻ᵀ``, on its output;
- ``solve(A, B)`` is ``inv(A) @ B`` (``left=False``: ``B @ inv(A)``; a batch of vectors as columns): the same
  solution, to the inverse's rounding (cond(A) · 2^-24, as an LU solve's up to a constant factor);
- ``det(A)`` of a float32 matrix is ``ort_trainer::det``, translated into ONNX ``Det``, whose autograd is
  ``G · det · A⁻ᵀ``; ONNX Runtime has no float64 ``Det``, so other dtypes stay refused;
- ``slogdet(A)`` / ``logdet(A)`` of a float32 matrix: the sign of ``Det`` (no gradient) and
  ``ort_trainer::logabsdet``, ``log |Det(A)|``, whose autograd is ``G · A⁻ᵀ``. It is computed from the
  determinant itself, so a determinant past float32's range (about 1e±38) gives an infinite logarithm where
  torch's LU-based one does not; its gradient does not read the determinant.

A singular matrix gives infinities or NaN where torch raises (``inv``, ``solve``) or takes another formula
(``det``'s gradient).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


def in_float32(function: Callable) -> Callable:
    """``function`` computed as autocast computes torch's matrix functions (its float32 list: inverses,
    factorisations, solves, determinants): under autocast (the trace's mixed precision), on float32 copies of its
    half tensors with autocast off, so that its products are not rounded to half and ONNX Runtime's ``Inverse``
    (no bfloat16 kernel) gets float32."""
    @functools.wraps(function)
    def computed(*args, **kwargs):
        if not torch.is_autocast_enabled("cpu"):
            return function(*args, **kwargs)
        widen = lambda value: value.float() if isinstance(value, torch.Tensor) and value.dtype in (  # noqa: E731
            torch.float16, torch.bfloat16) else value
        with torch.autocast("cpu", enabled=False):
            return function(*map(widen, args), **{key: widen(value) for key, value in kwargs.items()})
    return computed


@torch.library.custom_op("ort_trainer::inverse", mutates_args=())
def inverse_op(a: torch.Tensor) -> torch.Tensor:
    """The inverse of each matrix of ``a`` (``[..., n, n]``)."""
    return torch.linalg.inv(a)


@inverse_op.register_fake
def _inverse_fake(a):
    return torch.empty_like(a)


def _inverse_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _inverse_backward(ctx, grad):
    (inverse,) = ctx.saved_tensors
    return -(inverse.mT @ grad @ inverse.mT)


inverse_op.register_autograd(_inverse_backward, setup_context=_inverse_setup)


@torch.library.custom_op("ort_trainer::det", mutates_args=())
def det_op(a: torch.Tensor) -> torch.Tensor:
    """The determinant of each matrix of ``a`` (``[..., n, n]`` -> ``[...]``)."""
    return torch.linalg.det(a)


def _one_per_matrix(a):
    """The fake result of ``det`` and ``logabsdet``: one value per matrix of ``a``."""
    return a.new_empty(a.shape[:-2])


det_op.register_fake(_one_per_matrix)


def _det_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)


def _det_backward(ctx, grad):
    a, det = ctx.saved_tensors
    return (grad * det)[..., None, None] * torch.ops.ort_trainer.inverse(a).mT


det_op.register_autograd(_det_backward, setup_context=_det_setup)


@torch.library.custom_op("ort_trainer::logabsdet", mutates_args=())
def logabsdet_op(a: torch.Tensor) -> torch.Tensor:
    """The logarithm of the absolute determinant of each matrix of ``a`` (``[..., n, n]`` -> ``[...]``)."""
    return torch.linalg.slogdet(a)[1]


logabsdet_op.register_fake(_one_per_matrix)


def _logabsdet_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _logabsdet_backward(ctx, grad):
    (a,) = ctx.saved_tensors
    return grad[..., None, None] * torch.ops.ort_trainer.inverse(a).mT


logabsdet_op.register_autograd(_logabsdet_backward, setup_context=_logabsdet_setup)
INVERSE, DET = torch.ops.ort_trainer.inverse.default, torch.ops.ort_trainer.det.default
LOGABSDET = torch.ops.ort_trainer.logabsdet.default


@in_float32
def inv(A: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.linalg.inv`` (``torch.inverse``, ``Tensor.inverse``) as ``ort_trainer::inverse`` (real matrices)."""
    if out is not None or A.is_complex():
        return torch.linalg.inv(A, out=out)
    return torch.ops.ort_trainer.inverse(A)


@in_float32
def solve(A: torch.Tensor, B: torch.Tensor, *, left: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.linalg.solve`` as the inverse times ``B`` (module docstring); ``B`` of ``A``'s batch shape and one
    dim fewer is a batch of vectors, as torch reads it."""
    if out is not None or A.is_complex() or B.is_complex():
        return torch.linalg.solve(A, B, left=left, out=out)
    inverse = torch.ops.ort_trainer.inverse(A)
    if B.dim() == A.dim() - 1 and B.shape == A.shape[:-1]:
        return (inverse @ B.unsqueeze(-1)).squeeze(-1) if left else (B.unsqueeze(-2) @ inverse).squeeze(-2)
    return inverse @ B if left else B @ inverse


@in_float32
def det(A: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.linalg.det`` (``torch.det``, ``Tensor.det``) of float32 matrices as ``ort_trainer::det``."""
    if out is not None or A.dtype != torch.float32:
        return torch.linalg.det(A, out=out)
    return torch.ops.ort_trainer.det(A)


def _slogdet(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sign and log-absolute-determinant of float32 matrices (``ort_trainer::det``'s sign, without gradient,
    and ``ort_trainer::logabsdet``); None for other dtypes."""
    if A.dtype != torch.float32:
        return None
    return torch.sign(torch.ops.ort_trainer.det(A)).detach(), torch.ops.ort_trainer.logabsdet(A)


@in_float32
def linalg_slogdet(A: torch.Tensor, *, out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.slogdet`` of float32 matrices (module docstring)."""
    found = None if out is not None else _slogdet(A)
    return torch.linalg.slogdet(A, out=out) if found is None else torch.return_types.linalg_slogdet(found)


@in_float32
def slogdet(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.slogdet`` / ``Tensor.slogdet`` of float32 matrices (module docstring)."""
    found = _slogdet(A)
    return torch.slogdet(A) if found is None else torch.return_types.slogdet(found)


@in_float32
def logdet(A: torch.Tensor) -> torch.Tensor:
    """``torch.logdet`` / ``Tensor.logdet`` of float32 matrices: the log-absolute-determinant, NaN where the
    determinant is negative (as torch's)."""
    found = _slogdet(A)
    if found is None:
        return torch.logdet(A)
    sign, value = found
    return torch.where(sign < 0, torch.full_like(value, float("nan")), value)


REPLACEMENTS = {torch.linalg.inv: inv, torch.inverse: inv, torch.Tensor.inverse: inv, torch.linalg.solve: solve,
                torch.linalg.det: det, torch.det: det, torch.Tensor.det: det, torch.linalg.slogdet: linalg_slogdet,
                torch.slogdet: slogdet, torch.Tensor.slogdet: slogdet, torch.logdet: logdet,
                torch.Tensor.logdet: logdet}

__all__ = ["DET", "INVERSE", "LOGABSDET", "REPLACEMENTS", "det", "det_op", "inv", "inverse_op", "linalg_slogdet",
           "logabsdet_op", "logdet", "slogdet", "solve"]
