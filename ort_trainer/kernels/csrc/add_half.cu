// The CUDA kernel of AddHalf (ops.cc): a float32 (or half-precision) sum plus a half-precision tensor, each widened,
// one float32 add an element, as Casts to float32 and an Add compute it (one read of each input, one write).
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"

namespace ort_trainer_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // a grid-stride loop covers the rest

template <typename S, typename T>
__global__ void add_half_elements(const S* sum, const T* x, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    out[i] = __fadd_rn(to_float(sum[i]), to_float(x[i]));
}

template <typename S, typename T>
void launch(const void* sum, const void* x, float* out, int64_t n, int64_t blocks, cudaStream_t s) {
  add_half_elements<S, T><<<blocks, kThreads, 0, s>>>(static_cast<const S*>(sum), static_cast<const T*>(x), out, n);
}

}  // namespace

const char* add_half_cuda(ElementType type, ElementType sum_type, const void* sum, const void* x, float* out,
                          int64_t n, void* stream) {
  if (n == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int64_t blocks = (n + kThreads - 1) / kThreads;
  blocks = blocks > kMaxBlocks ? kMaxBlocks : blocks;
  // a float32 sum and x of any dtype, or a half sum and x of its dtype
  if (sum_type == ElementType::kFloat) {
    switch (type) {
      case ElementType::kFloat: launch<float, float>(sum, x, out, n, blocks, s); break;
      case ElementType::kFloat16: launch<float, __half>(sum, x, out, n, blocks, s); break;
      case ElementType::kBFloat16: launch<float, __nv_bfloat16>(sum, x, out, n, blocks, s); break;
    }
  } else if (sum_type != type) {
    return "unsupported dtypes";
  } else if (type == ElementType::kFloat16) {
    launch<__half, __half>(sum, x, out, n, blocks, s);
  } else {
    launch<__nv_bfloat16, __nv_bfloat16>(sum, x, out, n, blocks, s);
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
