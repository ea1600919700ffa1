"""The modified Bessel functions of the first kind of orders 0 and 1 in operators ONNX has: ``torch.special.i0``
(``torch.i0``), ``i0e``, ``i1`` and ``i1e``.

torch decomposes them into ``prims.bessel_i0`` and its siblings, which torch's ONNX exporter does not translate
(``torch.distributions``' von Mises-Fisher and Rice-like likelihoods, Kaiser windows, and their gradients: the
derivative of ``i0`` is ``i1``, those of ``i1`` and the scaled ones read ``i0`` and ``i0e``). Here each is written
out in float64 for a float64 result of at most a few roundings, then rounded once to its input's dtype (float32
results within one rounding of the exact value), from the textbook's two expansions (Abramowitz & Stegun 9.6.10
and 9.7.1), with ``t = |x|``:

- ``t < 20``: the power series ``I0(t) = Σ q^k / (k!)²`` and ``I1(t) = (t / 2) Σ q^k / (k! (k + 1)!)`` with
  ``q = t² / 4``, 48 terms: every term is positive (no cancellation), and the first one left out is below 1e-17 of
  the sum at ``t = 20``;
- ``t ≥ 20``: the asymptotic expansion ``e^-t Iν(t) = (2πt)^-1/2 Σ (-1)^k a_k(ν) / t^k`` with
  ``a_k(ν) = Π_{j ≤ k} (4ν² - (2j - 1)²) / (k! 8^k)``, 20 terms: the first one left out is below 4e-16 at
  ``t = 20`` and smaller beyond.

``i1`` and ``i1e`` are odd (``I1(-x) = -I1(x)``), ``i0`` and ``i0e`` even; ``i0``/``i1`` are ``e^t`` times the
scaled ones where the asymptotic expansion applies, infinite past the dtype's range as torch's. NaN gives NaN. The
gradients are torch's formulas, which read these functions again.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten
_SWITCH = 20.0  # where the asymptotic expansion takes over from the power series
_SERIES_TERMS = 48
_ASYMPTOTIC_TERMS = 20


def _asymptotic_coefficients(order: int) -> list[float]:
    """``(-1)^k a_k(order)`` for k < _ASYMPTOTIC_TERMS (module docstring)."""
    coefficients, value = [1.0], 1.0
    for k in range(1, _ASYMPTOTIC_TERMS):
        value *= -(4 * order * order - (2 * k - 1) ** 2) / (k * 8)
        coefficients.append(value)
    return coefficients


_ASYMPTOTIC = {order: _asymptotic_coefficients(order) for order in (0, 1)}


def _scaled(order: int, x: torch.Tensor) -> torch.Tensor:
    """``e^-|x| I_order(|x|)`` in float64, of a float64 ``x``."""
    t = x.abs()
    small = t < _SWITCH
    # each expansion on arguments inside its own range (no overflow in the branch torch.where leaves out)
    s = torch.where(small, t, 0.0)
    q = s * s / 4
    term = torch.ones_like(s) if order == 0 else s / 2
    series = term
    for k in range(1, _SERIES_TERMS):
        term = term * q / (k * (k + order))
        series = series + term
    a = torch.where(small, _SWITCH, t)
    inverse = 1.0 / a
    asymptotic = torch.full_like(a, _ASYMPTOTIC[order][-1])
    for coefficient in reversed(_ASYMPTOTIC[order][:-1]):
        asymptotic = asymptotic * inverse + coefficient
    asymptotic = asymptotic / torch.sqrt(2 * math.pi * a)
    return torch.where(small, series * torch.exp(-s), asymptotic)


def _result(x: torch.Tensor, value: torch.Tensor, odd: bool) -> torch.Tensor:
    value = torch.where(x < 0, -value, value) if odd else value
    return value.to(x.dtype if x.is_floating_point() else torch.float32)


def i0(self: torch.Tensor) -> torch.Tensor:
    """``I0(x)`` (module docstring)."""
    x = self.to(torch.float64)
    return _result(self, _scaled(0, x) * torch.exp(x.abs()), odd=False)


def i0e(self: torch.Tensor) -> torch.Tensor:
    """``e^-|x| I0(x)`` (module docstring)."""
    return _result(self, _scaled(0, self.to(torch.float64)), odd=False)


def i1(self: torch.Tensor) -> torch.Tensor:
    """``I1(x)`` (module docstring)."""
    x = self.to(torch.float64)
    return _result(self, _scaled(1, x) * torch.exp(x.abs()), odd=True)


def i1e(self: torch.Tensor) -> torch.Tensor:
    """``e^-|x| I1(x)`` (module docstring)."""
    return _result(self, _scaled(1, self.to(torch.float64)), odd=True)


DECOMPOSITIONS = {aten.i0.default: i0, aten.special_i0e.default: i0e, aten.special_i1.default: i1,
                  aten.special_i1e.default: i1e}

__all__ = ["DECOMPOSITIONS", "i0", "i0e", "i1", "i1e"]
