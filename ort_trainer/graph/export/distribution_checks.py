"""``torch.distributions``' matrix constraints checked without a Python branch on tensor values.

A distribution validates its arguments by default (``Distribution(validate_args=None)``): ``MultivariateNormal``
with a ``covariance_matrix`` or ``precision_matrix`` checks ``constraints.positive_definite``, whose ``check``
first asks ``if not sym_check.all(): return sym_check`` (``_Symmetric.check`` asks the same of its squareness).
That ``if`` reads a tensor's value into Python, which ``torch.export`` cannot trace. Its only use is the
distribution's ``if not torch._is_all_true(valid): raise`` (traced where it passes, ``validations.py``), which
raises where any element is False, so the branch can be an ``&``: False where the matrix is not symmetric (torch's
result there), else Cholesky's verdict (``torch.linalg.cholesky_ex(value).info == 0``, ``cholesky.py``) or the
eigenvalues' (positive semidefinite). Squareness comes from the shapes, which Python may read.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.distributions import constraints

from .trace_tools import methods_replaced


def _symmetric(self, value: torch.Tensor) -> torch.Tensor:
    if value.shape[-2] != value.shape[-1]:
        return constraints._Square.check(self, value)
    return torch.isclose(value, value.mT, atol=1e-6).all(-2).all(-1)


def _symmetric_and(self, value: torch.Tensor, verdict: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """False where ``value`` is not symmetric (or not square), else ``verdict(value)``."""
    symmetric = _symmetric(self, value)
    return symmetric if value.shape[-2] != value.shape[-1] else symmetric & verdict(value)


def _positive_definite(self, value: torch.Tensor) -> torch.Tensor:
    return _symmetric_and(self, value, lambda matrix: torch.linalg.cholesky_ex(matrix).info.eq(0))


def _positive_semidefinite(self, value: torch.Tensor) -> torch.Tensor:
    return _symmetric_and(self, value, lambda matrix: torch.linalg.eigvalsh(matrix).ge(0).all(-1))


_CHECKS = {constraints._Symmetric: _symmetric, constraints._PositiveDefinite: _positive_definite,
           constraints._PositiveSemidefinite: _positive_semidefinite}


@contextlib.contextmanager
def without_branches() -> Iterator[None]:
    """Within, on the calling thread: the constraints' ``check`` methods are the branch-free ones above (module
    docstring)."""
    replacements = {cls: {"check": lambda _, *args, check=check: check(*args)} for cls, check in _CHECKS.items()}
    with methods_replaced(replacements):
        yield


__all__ = ["without_branches"]
