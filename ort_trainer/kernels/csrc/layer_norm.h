// LayerNorm's backward, as torch's native_layer_norm_backward computes it, from the forward's saved statistics
// (mean and rstd = 1 / sqrt(var + eps) of each row of `cols` values):
//   xhat = (x - mean) * rstd,  g = dy * gamma
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (means over the row)
//   dgamma = sum over rows of dy * xhat,  dbeta = sum over rows of dy
#pragma once

#include <stdint.h>

namespace ort_trainer_kernels {

// the rows of one chunk of the column sums: enough chunks to fill a GPU's multiprocessors with blocks, few
// enough that their sums over the chunks stay short
constexpr int64_t kLayerNormRowsPerChunk = 128;
constexpr int64_t kLayerNormMaxChunks = 64;

inline int64_t layer_norm_chunks(int64_t rows) {
  const int64_t chunks = (rows + kLayerNormRowsPerChunk - 1) / kLayerNormRowsPerChunk;
  return chunks < 1 ? 1 : (chunks > kLayerNormMaxChunks ? kLayerNormMaxChunks : chunks);
}

}  // namespace ort_trainer_kernels
