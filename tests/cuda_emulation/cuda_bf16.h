// bfloat16 for the emulated CUDA kernels (cuda_runtime.h): storage, and conversions rounding to nearest even as the
// GPU's do (the CPU kernels' bit-exact ones, ort_trainer/kernels/csrc/half.h).
#pragma once

#include <stdint.h>

#include "half.h"

struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 h) { return ort_trainer_kernels::bfloat16_to_float(h.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{ort_trainer_kernels::float_to_bfloat16(f)}; }
