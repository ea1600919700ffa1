// GELU's derivative, shared by the CPU loop (ops.cc) and the CUDA kernel (gelu.cu).
//
// dx = dy * g'(x), computed in float32 whatever the tensors' dtype (as torch's gelu_backward does on
// CUDA: its opmath type for half and bfloat16 is float), rounded once to the output's dtype.
//   erf form:  g(x) = x * Phi(x),  g'(x) = Phi(x) + x * phi(x),
//              Phi(x) = (1 + erf(x / sqrt 2)) / 2,  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
//   tanh form: g(x) = x * (1 + tanh(u)) / 2,  u = sqrt(2/pi) * (x + 0.044715 x^3),
//              g'(x) = (1 + t) / 2 + x * (1 - t^2) * sqrt(2/pi) * (1 + 3 * 0.044715 x^2) / 2,  t = tanh(u)
#pragma once

#include <math.h>

#include "kernels.h"  // ORTT_HOST_DEVICE

namespace ort_trainer_kernels {

ORTT_HOST_DEVICE float gelu_erf_derivative(float x) {
  const float kSqrt1_2 = 0.70710678118654752440f;     // 1 / sqrt(2)
  const float kRsqrt2Pi = 0.39894228040143267794f;    // 1 / sqrt(2 pi)
  const float cdf = 0.5f * (1.0f + erff(x * kSqrt1_2));
  const float pdf = kRsqrt2Pi * expf(-0.5f * x * x);  // 0 where x^2 / 2 overflows exp's range: the limit
  return cdf + x * pdf;
}

ORTT_HOST_DEVICE float gelu_tanh_derivative(float x) {
  const float kSqrt2OverPi = 0.79788456080286535588f;  // sqrt(2 / pi)
  const float kC = 0.044715f;
  const float x2 = x * x;
  const float t = tanhf(kSqrt2OverPi * x * (1.0f + kC * x2));
  // (1 - t^2) as (1 - t)(1 + t): no cancellation where |t| is near 1. Where the tanh saturates it is exactly 0, and
  // so is its term (rather than 0 * inf = NaN once x^3 overflows float32, past |x| ~ 1e13)
  const float sech2 = (1.0f - t) * (1.0f + t);
  const float slope = sech2 == 0.0f ? 0.0f : 0.5f * x * sech2 * kSqrt2OverPi * (1.0f + 3.0f * kC * x2);
  return 0.5f * (1.0f + t) + slope;
}

}  // namespace ort_trainer_kernels
