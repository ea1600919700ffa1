// The CUDA kernels of CrossEntropy and CrossEntropyGrad (ops.cc), one block a
// row of class scores (the first `classes` of a row `cols` wide), in float32 whatever the scores' dtype:
//   forward:  the row's max and sum of exp merged on the fly (one read of the row), then lse and the row's loss
//   backward: dx = g * (exp(x - lse) - [c == target]), zeros for an ignored row and past `classes` (one read, one
//             write)
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"

namespace ort_trainer_kernels {
namespace {

constexpr int kThreads = 512;

// (max, sum of exp(x - max)) of two partial rows merged
__device__ __forceinline__ float2 merge(float2 a, float2 b) {
  if (isnan(a.x) || isnan(b.x)) return make_float2(NAN, NAN);  // (fmaxf would drop a NaN against a -inf)
  const float top = fmaxf(a.x, b.x);
  if (top == -INFINITY) return make_float2(top, 0.0f);
  return make_float2(top, a.y * expf(a.x - top) + b.y * expf(b.x - top));
}

template <typename T>
__global__ void forward_rows(const T* x, const int64_t* target, float* losses, float* lse, int64_t cols,
                             int64_t classes, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* x_row = x + row * cols;
  float2 part = make_float2(-INFINITY, 0.0f);
  for (int64_t c = threadIdx.x; c < classes; c += blockDim.x)
    part = merge(part, make_float2(to_float(x_row[c]), 1.0f));
  for (int offset = 16; offset > 0; offset >>= 1)
    part = merge(part, make_float2(__shfl_xor_sync(0xffffffffu, part.x, offset),
                                   __shfl_xor_sync(0xffffffffu, part.y, offset)));
  __shared__ float2 warps[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warps[warp] = part;
  __syncthreads();
  if (threadIdx.x == 0) {
    float2 total = warps[0];
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) total = merge(total, warps[w]);
    // a NaN score makes the row's lse and loss NaN; a row of -inf has lse -inf (torch's logsumexp) and loss NaN
    const float row_lse = total.x == -INFINITY ? -INFINITY : total.x + logf(total.y);
    lse[row] = row_lse;
    const int64_t t = target[row];
    losses[row] = t == ignore_index ? 0.0f : (t >= 0 && t < classes ? row_lse - to_float(x_row[t]) : NAN);
  }
}

template <typename T>
__global__ void backward_rows(const float* grad, const T* x, const int64_t* target, const float* lse, T* dx,
                              int64_t cols, int64_t classes, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  const T* x_row = x + row * cols;
  T* dx_row = dx + row * cols;
  const float g = t == ignore_index ? 0.0f : grad[row], row_lse = lse[row];
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float p = g == 0.0f || c >= classes ? 0.0f : expf(to_float(x_row[c]) - row_lse) * g;
    dx_row[c] = from_float<T>(c == t && c < classes ? p - g : p);
  }
}

}  // namespace

const char* cross_entropy_cuda(ElementType type, const void* x, const int64_t* target, float* losses, float* lse,
                               int64_t rows, int64_t cols, int64_t classes, int64_t ignore_index, void* stream) {
  if (rows == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned blocks = static_cast<unsigned>(rows);
  switch (type) {
    case ElementType::kFloat:
      forward_rows<float><<<blocks, kThreads, 0, s>>>(static_cast<const float*>(x), target, losses, lse, cols,
                                                      classes, ignore_index);
      break;
    case ElementType::kFloat16:
      forward_rows<__half><<<blocks, kThreads, 0, s>>>(static_cast<const __half*>(x), target, losses, lse, cols,
                                                       classes, ignore_index);
      break;
    case ElementType::kBFloat16:
      forward_rows<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(static_cast<const __nv_bfloat16*>(x), target, losses,
                                                              lse, cols, classes, ignore_index);
      break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

const char* cross_entropy_grad_cuda(ElementType type, const float* grad, const void* x, const int64_t* target,
                                    const float* lse, void* dx, int64_t rows, int64_t cols, int64_t classes,
                                    int64_t ignore_index, void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned blocks = static_cast<unsigned>(rows);
  switch (type) {
    case ElementType::kFloat:
      backward_rows<float><<<blocks, kThreads, 0, s>>>(grad, static_cast<const float*>(x), target, lse,
                                                       static_cast<float*>(dx), cols, classes, ignore_index);
      break;
    case ElementType::kFloat16:
      backward_rows<__half><<<blocks, kThreads, 0, s>>>(grad, static_cast<const __half*>(x), target, lse,
                                                        static_cast<__half*>(dx), cols, classes, ignore_index);
      break;
    case ElementType::kBFloat16:
      backward_rows<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(grad, static_cast<const __nv_bfloat16*>(x), target,
                                                               lse, static_cast<__nv_bfloat16*>(dx), cols,
                                                               classes, ignore_index);
      break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
