// The CUDA kernel of AddHalf (ops.cc): a float32 (or half-precision) sum plus half-precision tensors, each widened,
// one float32 add an element and tensor, in order, as Casts to float32 and a chain of Adds compute it (one read of
// each input, one write).
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"

namespace ort_trainer_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // a grid-stride loop covers the rest
constexpr int kMaxAddends = 8;           // the tensors one launch adds (passed by value); more: further launches

template <typename T>
struct Addends {
  const T* x[kMaxAddends];
  int count;
};

template <typename S, typename T>
__global__ void add_half_elements(const S* sum, Addends<T> xs, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    float total = to_float(sum[i]);
    // (unrolled over the struct's fixed size: a loop to the run-time count would copy the parameters to local memory)
#pragma unroll
    for (int k = 0; k < kMaxAddends; ++k)
      if (k < xs.count) total = __fadd_rn(total, to_float(xs.x[k][i]));
    out[i] = total;
  }
}

// sum (of S) plus the xs in launches of up to kMaxAddends, each after the first adding to out
template <typename S, typename T>
void launch(const void* sum, const void* const* xs, int count, float* out, int64_t n, int64_t blocks,
            cudaStream_t s) {
  for (int first = 0; first < count; first += kMaxAddends) {
    Addends<T> addends{};
    addends.count = count - first < kMaxAddends ? count - first : kMaxAddends;
    for (int k = 0; k < addends.count; ++k) addends.x[k] = static_cast<const T*>(xs[first + k]);
    if (first == 0)
      add_half_elements<S, T><<<blocks, kThreads, 0, s>>>(static_cast<const S*>(sum), addends, out, n);
    else
      add_half_elements<float, T><<<blocks, kThreads, 0, s>>>(out, addends, out, n);
  }
}

}  // namespace

const char* add_half_cuda(ElementType type, ElementType sum_type, const void* sum, const void* const* xs, int count,
                          float* out, int64_t n, void* stream) {
  if (n == 0 || count == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int64_t blocks = (n + kThreads - 1) / kThreads;
  blocks = blocks > kMaxBlocks ? kMaxBlocks : blocks;
  // a float32 sum and xs of any dtype, or a half sum and xs of its dtype
  if (sum_type == ElementType::kFloat) {
    switch (type) {
      case ElementType::kFloat: launch<float, float>(sum, xs, count, out, n, blocks, s); break;
      case ElementType::kFloat16: launch<float, __half>(sum, xs, count, out, n, blocks, s); break;
      case ElementType::kBFloat16: launch<float, __nv_bfloat16>(sum, xs, count, out, n, blocks, s); break;
    }
  } else if (sum_type != type) {
    return "unsupported dtypes";
  } else if (type == ElementType::kFloat16) {
    launch<__half, __half>(sum, xs, count, out, n, blocks, s);
  } else {
    launch<__nv_bfloat16, __nv_bfloat16>(sum, xs, count, out, n, blocks, s);
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
