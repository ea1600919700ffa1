// SeededDropout's random numbers (elementwise_ops.cc), shared by the CPU loop and the CUDA kernel (dropout.cu):
// Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011), a
// counter-based generator: four 32-bit draws are a function of a 128-bit counter and a 64-bit key alone, so every
// element's draw can be computed where it is needed, in any order, by any thread, and the same on the host and on a
// GPU.
//
// Element i of the dropout node numbered `stream` draws word i % 4 of the block at counter (i / 4 as two 32-bit
// words, low first; stream; 0) under the key (seed's low and high 32 bits): each (seed, node, element) its own word.
// The element is kept where that word is below `threshold`: the keep probability threshold / 2^32.
#pragma once

#include <stdint.h>

#include "kernels.h"  // ORTT_HOST_DEVICE

namespace ort_trainer_kernels {

ORTT_HOST_DEVICE uint32_t mul_high(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// Philox4x32 with 10 rounds: out = the block of counter `c` under key `k` (Random123's philox4x32_10)
ORTT_HOST_DEVICE void philox4x32_10(const uint32_t c[4], const uint32_t k[2], uint32_t out[4]) {
  uint32_t x0 = c[0], x1 = c[1], x2 = c[2], x3 = c[3], k0 = k[0], k1 = k[1];
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mul_high(0xD2511F53u, x0), lo0 = 0xD2511F53u * x0;
    const uint32_t hi1 = mul_high(0xCD9E8D57u, x2), lo1 = 0xCD9E8D57u * x2;
    x0 = hi1 ^ x1 ^ k0;
    x1 = lo1;
    x2 = hi0 ^ x3 ^ k1;
    x3 = lo0;
    k0 += 0x9E3779B9u;  // the Weyl sequence's bumps of the key between rounds
    k1 += 0xBB67AE85u;
  }
  out[0] = x0, out[1] = x1, out[2] = x2, out[3] = x3;
}

// the four draws of elements [4 * group, 4 * group + 4) of dropout node `stream` under `seed`
ORTT_HOST_DEVICE void dropout_draws(uint64_t seed, uint32_t stream, uint64_t group, uint32_t out[4]) {
  const uint32_t counter[4] = {static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32), stream, 0u};
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  philox4x32_10(counter, key, out);
}

}  // namespace ort_trainer_kernels
