// float16 for the emulated CUDA kernels (cuda_runtime.h): storage, and conversions rounding to nearest even as the
// GPU's do (the CPU kernels' bit-exact ones, ort_trainer/kernels/csrc/half.h).
#pragma once

#include <stdint.h>

#include "half.h"

struct __half {
  uint16_t bits;
};
inline float __half2float(__half h) { return ort_trainer_kernels::float16_to_float(h.bits); }
inline __half __float2half_rn(float f) { return __half{ort_trainer_kernels::float_to_float16(f)}; }
