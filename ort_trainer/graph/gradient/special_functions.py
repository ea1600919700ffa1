"""The log-gamma function and its derivatives in operators ONNX has: ``lgamma``, ``digamma`` and ``polygamma(1, ·)``;
the inverse error function, ``erfinv``; and ``hypot``.

ONNX has no gamma function; torch's ONNX exporter translates none of the three (``torch.distributions``' Gamma,
Beta, Dirichlet, StudentT and negative binomial log-probabilities use ``lgamma``; its gradient is ``digamma``, whose
gradient is ``polygamma(1, ·)``). Here each is written out in float64 (then rounded to its input's dtype once:
float32 results within one rounding of the exact value away from the poles) as the textbook computes it:

- arguments below 1/2 by reflection: ``lgamma(x) = log(π / |sin(πx)|) - lgamma(1 - x)``,
  ``digamma(x) = digamma(1 - x) - π / tan(πx)``, ``trigamma(x) = π² / sin²(πx) - trigamma(1 - x)``
  (``sin`` and ``cos`` of ``π (x - round(x))``: the same values, without the rounding of a large ``πx``, by their
  Taylor series);
- arguments below 8 raised by 8 with the recurrences ``lgamma(y) = lgamma(y + 8) - Σ log(y + i)``,
  ``digamma(y) = digamma(y + 8) - Σ 1 / (y + i)``, ``trigamma(y) = trigamma(y + 8) + Σ 1 / (y + i)²``;
- at 8 and above, the asymptotic (Stirling) series to the fifth term, whose next term is below 1e-13 there.

At the poles (0 and the negative integers) the values are infinite or NaN, as torch's.

``erfinv`` (no translation either; ``torch.nn.init.trunc_normal_``'s inverse CDF, flows' Gaussianisation) of a
float32 or half input is Giles' approximation ("Approximating the erfinv function", GPU Computing Gems, 2011: one
polynomial of ``w = -log(1 - x²)`` below 5, one of ``sqrt(w)`` above) evaluated in float64, within 1.3e-7 of the
exact value, relative, then rounded: a few float32 ulps. ±1 give ±inf, |x| > 1 NaN, as torch's. Its gradient is
torch's formula, which reads ``erfinv`` again. A float64 input is not written out (the approximation is a float32
one, and ONNX Runtime has no float64 ``Erf`` to refine it with).

``hypot`` (``prims.hypot``, no translation) avoids the squares' overflow as torch's kernel does: float32 and half
computed in float64 and rounded once, float64 scaled by the larger magnitude.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten
_SHIFT = 8
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _dtype(x: torch.Tensor) -> torch.dtype:
    """The result's dtype: the input's, float32 for an integer input (torch's promotion)."""
    return x.dtype if x.is_floating_point() else torch.float32


def _prepared(x: torch.Tensor) -> tuple:
    """x in float64; whether it reflects; y (x or 1 - x, at least 1/2); whether y is raised; z (y or y + 8);
    x's distance to its nearest integer, for the reflections' sin and tan."""
    x = x.to(torch.float64)
    reflected = x < 0.5
    y = torch.where(reflected, 1.0 - x, x)
    raised = y < _SHIFT
    return x, reflected, y, raised, torch.where(raised, y + _SHIFT, y), x - torch.round(x)


def _sin_cos_pi(fraction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sin(π f) and cos(π f) for |f| <= 1/2, by their Taylor series to the 23rd and 24th powers (the next terms are
    below 1e-20): ONNX Runtime has no float64 ``Cos`` on every build and provider (1.19's CPU)."""
    t = math.pi * fraction
    t2 = t * t
    sine, cosine = torch.ones_like(t), torch.ones_like(t)
    for k in range(11, 0, -1):  # Horner: 1 - t²/(2k(2k+1)) (...), 1 - t²/((2k-1)2k) (...)
        sine = 1.0 - t2 / ((2 * k) * (2 * k + 1)) * sine
        cosine = 1.0 - t2 / ((2 * k - 1) * (2 * k)) * cosine
    return t * sine, cosine


def lgamma(self: torch.Tensor) -> torch.Tensor:
    """log |Γ(x)| (module docstring)."""
    x, reflected, y, raised, z, fraction = _prepared(self)
    r = 1.0 / z
    r2 = r * r
    series = r * (1 / 12 + r2 * (-1 / 360 + r2 * (1 / 1260 + r2 * (-1 / 1680 + r2 * (1 / 1188)))))
    value = (z - 0.5) * torch.log(z) - z + _HALF_LOG_2PI + series
    value = torch.where(raised, value - sum(torch.log(y + i) for i in range(_SHIFT)), value)
    value = torch.where(reflected, math.log(math.pi) - torch.log(torch.abs(_sin_cos_pi(fraction)[0])) - value, value)
    return value.to(_dtype(self))


def digamma(self: torch.Tensor) -> torch.Tensor:
    """Γ'(x) / Γ(x) (module docstring)."""
    x, reflected, y, raised, z, fraction = _prepared(self)
    r = 1.0 / z
    r2 = r * r
    value = torch.log(z) - 0.5 * r - r2 * (1 / 12 + r2 * (-1 / 120 + r2 * (1 / 252 + r2 * (-1 / 240 + r2 / 132))))
    value = torch.where(raised, value - sum(1.0 / (y + i) for i in range(_SHIFT)), value)
    sine, cosine = _sin_cos_pi(fraction)
    value = torch.where(reflected, value - math.pi * cosine / sine, value)
    return value.to(_dtype(self))


def polygamma(n: int, self: torch.Tensor) -> torch.Tensor:
    """The n-th derivative of digamma: n = 1 (trigamma, digamma's gradient) here; others are not written out."""
    if n != 1:
        return NotImplemented
    x, reflected, y, raised, z, fraction = _prepared(self)
    r = 1.0 / z
    r2 = r * r
    value = r + 0.5 * r2 + r * r2 * (1 / 6 + r2 * (-1 / 30 + r2 * (1 / 42 + r2 * (-1 / 30 + r2 * (5 / 66)))))
    value = torch.where(raised, value + sum(1.0 / (y + i) ** 2 for i in range(_SHIFT)), value)
    value = torch.where(reflected, (math.pi / _sin_cos_pi(fraction)[0]) ** 2 - value, value)
    return value.to(_dtype(self))


# Giles' single-precision coefficients, highest power first: of w - 2.5 where w < 5, of sqrt(w) - 3 above
_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                   -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                0.00943887047, 1.00167406, 2.83297682)


def _horner(coefficients: tuple, t: torch.Tensor) -> torch.Tensor:
    value = torch.full_like(t, coefficients[0])
    for coefficient in coefficients[1:]:
        value = value * t + coefficient
    return value


def erfinv(self: torch.Tensor) -> torch.Tensor:
    """The inverse of the error function (module docstring); float64 inputs are left to the exporter."""
    if self.dtype == torch.float64:
        return NotImplemented
    x = self.to(torch.float64)
    inside = x.abs() < 1
    w = -torch.log(torch.where(inside, (1.0 - x) * (1.0 + x), 1.0))  # (0 outside: no infinite w)
    central = _horner(_ERFINV_CENTRAL, w - 2.5)
    tail = _horner(_ERFINV_TAIL, torch.sqrt(w) - 3.0)
    value = torch.where(w < 5.0, central, tail) * x
    edge = torch.where(x.abs() == 1, x * math.inf, math.nan)  # ±inf at ±1, NaN beyond (and for NaN)
    return torch.where(inside, value, edge).to(_dtype(self))


def hypot(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``sqrt(self² + other²)`` without overflow or underflow of the squares: float32 and half in float64 (then
    rounded once, as torch's kernel), float64 scaled by the larger magnitude. inf where either is infinite (NaN
    or not), as torch's."""
    dtype = torch.promote_types(self.dtype, other.dtype) if self.is_floating_point() or other.is_floating_point() \
        else torch.float32
    a, b = self.to(torch.float64).abs(), other.to(torch.float64).abs()
    if dtype != torch.float64:
        value = torch.sqrt(a * a + b * b)
    else:
        larger, smaller = torch.maximum(a, b), torch.minimum(a, b)
        ratio = smaller / torch.where(larger == 0, 1.0, larger)
        value = larger * torch.sqrt(1.0 + ratio * ratio)
    value = torch.where(a.isinf() | b.isinf(), math.inf, value)
    return value.to(dtype)


DECOMPOSITIONS = {aten.lgamma.default: lgamma, aten.digamma.default: digamma, aten.polygamma.default: polygamma,
                  aten.erfinv.default: erfinv, aten.hypot.default: hypot}

__all__ = ["DECOMPOSITIONS", "digamma", "erfinv", "hypot", "lgamma", "polygamma"]
