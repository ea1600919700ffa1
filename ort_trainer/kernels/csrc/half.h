// float16 and bfloat16 <-> float32 on the host (the CPU kernels of ops.cc), bit by bit: round to nearest even,
// subnormals, infinities and NaN as IEEE 754 and as torch converts them.
#pragma once

#include <stdint.h>
#include <string.h>

namespace ort_trainer_kernels {

inline float bits_to_float(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float bfloat16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bfloat16(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // NaN stays NaN
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);  // to nearest, ties to even
  return static_cast<uint16_t>(rounded >> 16);
}

inline float float16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_float16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;            // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;           // rounds past 65504: inf
  if (magnitude < 0x38800000u) {                                 // below 2^-14: a subnormal (or 0)
    // magnitude * 2^24 rounded to an integer, ties to even: the float adds 0.5 units of the subnormal's last place
    const float scaled = bits_to_float(magnitude) * 16777216.0f;  // exact (a power of two)
    const float rounded = (scaled + 8388608.0f) - 8388608.0f;     // round to nearest even in float32's own adder
    return sign | static_cast<uint16_t>(rounded);
  }
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u) - (112u << 23);
  return sign | static_cast<uint16_t>(rounded >> 13);
}

}  // namespace ort_trainer_kernels
