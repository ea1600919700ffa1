"""The log-gamma function and its derivatives in operators ONNX has: ``lgamma``, ``digamma`` and ``polygamma(1, ·)``.

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


DECOMPOSITIONS = {aten.lgamma.default: lgamma, aten.digamma.default: digamma, aten.polygamma.default: polygamma}

__all__ = ["DECOMPOSITIONS", "digamma", "lgamma", "polygamma"]
