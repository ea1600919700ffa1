// The CUDA kernel of AddHalf (ops.cc): a float32 sum plus a half-precision tensor widened, one float32 add an
// element, as a Cast to float32 and an Add compute it (one read of each input, one write).
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"

namespace ort_trainer_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // a grid-stride loop covers the rest

template <typename T>
__global__ void add_half_elements(const float* sum, const T* x, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    out[i] = sum[i] + to_float(x[i]);
}

}  // namespace

const char* add_half_cuda(ElementType type, const float* sum, const void* x, float* out, int64_t n, void* stream) {
  if (n == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int64_t blocks = (n + kThreads - 1) / kThreads;
  blocks = blocks > kMaxBlocks ? kMaxBlocks : blocks;
  switch (type) {
    case ElementType::kFloat:
      add_half_elements<float><<<blocks, kThreads, 0, s>>>(sum, static_cast<const float*>(x), out, n);
      break;
    case ElementType::kFloat16:
      add_half_elements<__half><<<blocks, kThreads, 0, s>>>(sum, static_cast<const __half*>(x), out, n);
      break;
    case ElementType::kBFloat16:
      add_half_elements<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(sum, static_cast<const __nv_bfloat16*>(x), out,
                                                                   n);
      break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
