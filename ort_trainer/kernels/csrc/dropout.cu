// The CUDA kernel of SeededDropout (elementwise_ops.cc): y = x * scale where an element's Philox draw is below the
// threshold (philox.h), x * 0 elsewhere, and the mask of the kept elements. The seed is read from device memory by the
// kernel itself, so a CUDA graph that captured the launch draws new masks when the seed's buffer is written before a
// replay. Each thread draws one block of four words: four consecutive elements, moved as one vector where x, y and
// the mask are aligned for it.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"
#include "philox.h"
#include "vector_io.cuh"

namespace ort_trainer_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // a grid-stride loop past that: no launch of more blocks than CUDA allows

template <int V, typename T>
__global__ void seeded_dropout_kernel(const T* x, T* y, bool* mask, int64_t n, const int64_t* seed, uint32_t stream,
                                      uint32_t threshold, float scale) {
  const uint64_t key = static_cast<uint64_t>(*seed);
  const int64_t groups = (n + 3) / 4;
  for (int64_t group = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; group < groups;
       group += static_cast<int64_t>(gridDim.x) * kThreads) {
    uint32_t draws[4];
    dropout_draws(key, stream, static_cast<uint64_t>(group), draws);
    const int64_t first = group * 4;
    if constexpr (V == 4) {
      if (first + 4 <= n) {
        float values[4];
        load<4>(x + first, values);
        Pack<bool, 4> kept;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          kept.v[k] = draws[k] < threshold;
          values[k] *= kept.v[k] ? scale : 0.0f;  // (a dropped NaN or inf stays NaN, as torch's x * mask * scale)
        }
        store<4>(y + first, values);
        *reinterpret_cast<Pack<bool, 4>*>(mask + first) = kept;
        continue;
      }
    }
    for (int k = 0; k < 4 && first + k < n; ++k) {
      const bool keep = draws[k] < threshold;
      y[first + k] = from_float<T>(to_float(x[first + k]) * (keep ? scale : 0.0f));
      mask[first + k] = keep;
    }
  }
}

template <typename T>
const char* launch(const void* x, void* y, bool* mask, int64_t n, const int64_t* seed, uint32_t stream,
                   uint32_t threshold, float scale, cudaStream_t s) {
  if (n == 0) return nullptr;
  const int64_t groups = (n + 3) / 4;
  const int64_t wanted = (groups + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < kMaxBlocks ? wanted : kMaxBlocks);
  const T* xs = static_cast<const T*>(x);
  T* ys = static_cast<T*>(y);
  at_width<4>(aligned_for<4>(xs) && aligned_for<4>(ys) && aligned_for<4>(mask), [&]<int V>() {
    seeded_dropout_kernel<V, T><<<blocks, kThreads, 0, s>>>(xs, ys, mask, n, seed, stream, threshold, scale);
  });
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace

const char* seeded_dropout_cuda(ElementType type, const void* x, void* y, bool* mask, int64_t n, const int64_t* seed,
                                uint32_t stream, uint32_t threshold, float scale, void* stream_handle) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream_handle);
  switch (type) {
    case ElementType::kFloat: return launch<float>(x, y, mask, n, seed, stream, threshold, scale, s);
    case ElementType::kFloat16: return launch<__half>(x, y, mask, n, seed, stream, threshold, scale, s);
    case ElementType::kBFloat16: return launch<__nv_bfloat16>(x, y, mask, n, seed, stream, threshold, scale, s);
  }
  return "x must be float32, float16 or bfloat16";
}

}  // namespace ort_trainer_kernels
