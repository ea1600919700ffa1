// The CUDA kernels of GeluGrad and TanhGeluGrad (ops.cc; the arithmetic: gelu.h), built where nvcc builds the library.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "gelu.h"
#include "kernels.h"

namespace ort_trainer_kernels {
namespace {

template <typename T, bool kTanh>
__device__ __forceinline__ T gelu_grad_one(T dy, T x) {
  const float xf = to_float(x);
  return from_float<T>(to_float(dy) * (kTanh ? gelu_tanh_derivative(xf) : gelu_erf_derivative(xf)));
}

// 16 bytes of each tensor a thread and step (the memory system's widest load), where every pointer is 16-byte
// aligned and the length a multiple of the vector's; one element a step otherwise
template <typename T, bool kTanh>
__global__ void gelu_grad_vector(const uint4* dy, const uint4* x, uint4* dx, int64_t vectors) {
  constexpr int kPer = sizeof(uint4) / sizeof(T);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    uint4 a = dy[i], b = x[i], out;
    const T* av = reinterpret_cast<const T*>(&a);
    const T* bv = reinterpret_cast<const T*>(&b);
    T* ov = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int k = 0; k < kPer; ++k) ov[k] = gelu_grad_one<T, kTanh>(av[k], bv[k]);
    dx[i] = out;
  }
}

template <typename T, bool kTanh>
__global__ void gelu_grad_scalar(const T* dy, const T* x, T* dx, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    dx[i] = gelu_grad_one<T, kTanh>(dy[i], x[i]);
  }
}

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // a grid-stride loop covers the rest

int64_t blocks_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks);
}

template <typename T, bool kTanh>
cudaError_t launch(const void* dy, const void* x, void* dx, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kPer = sizeof(uint4) / sizeof(T);
  const bool aligned = (reinterpret_cast<uintptr_t>(dy) | reinterpret_cast<uintptr_t>(x) |
                        reinterpret_cast<uintptr_t>(dx)) % sizeof(uint4) == 0;
  if (aligned && n % kPer == 0) {
    const int64_t vectors = n / kPer;
    gelu_grad_vector<T, kTanh><<<blocks_for(vectors), kThreads, 0, stream>>>(
        static_cast<const uint4*>(dy), static_cast<const uint4*>(x), static_cast<uint4*>(dx), vectors);
  } else {
    gelu_grad_scalar<T, kTanh><<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), n);
  }
  return cudaGetLastError();
}

template <bool kTanh>
cudaError_t launch_typed(ElementType type, const void* dy, const void* x, void* dx, int64_t n, cudaStream_t s) {
  switch (type) {
    case ElementType::kFloat: return launch<float, kTanh>(dy, x, dx, n, s);
    case ElementType::kFloat16: return launch<__half, kTanh>(dy, x, dx, n, s);
    case ElementType::kBFloat16: return launch<__nv_bfloat16, kTanh>(dy, x, dx, n, s);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

const char* gelu_grad_cuda(ElementType type, bool tanh_form, const void* dy, const void* x, void* dx, int64_t n,
                           void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t error = tanh_form ? launch_typed<true>(type, dy, x, dx, n, s)
                                      : launch_typed<false>(type, dy, x, dx, n, s);
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
