// The CUDA kernels of CrossEntropy and CrossEntropyGrad (ops.cc), one block a
// row of class scores (the first `classes` of a row `cols` wide), in float32 whatever the scores' dtype:
//   forward:  the row's max and sum of exp merged on the fly (one read of the row), then lse and the row's loss
//   backward: dx = g * (exp(x - lse) - [c == target]), zeros for an ignored row and past `classes` (one read, one
//             write)
// A thread takes 16 bytes of the row at a time (8 float16 or bfloat16 scores, 4 float32) where rows of a multiple of
// that many scores start aligned for it, one score otherwise.
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"
#include "vector_io.cuh"

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

// V scores a thread and step: the step's (max, sum of exp(x - max)) merged into the thread's
template <typename T, int V>
__global__ void forward_rows(const T* x, const int64_t* target, float* losses, float* lse, int64_t cols,
                             int64_t classes, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* x_row = x + row * cols;
  float2 part = make_float2(-INFINITY, 0.0f);
  for (int64_t c = threadIdx.x * static_cast<int64_t>(V); c < classes; c += static_cast<int64_t>(blockDim.x) * V) {
    float xs[V];
    load<V>(x_row + c, xs);
    float top = -INFINITY;
    bool nan = false;
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (c + k < classes) {
        nan |= isnan(xs[k]);
        top = fmaxf(top, xs[k]);
      }
    if (nan) {
      part = make_float2(NAN, NAN);
    } else if (top != -INFINITY) {  // (a step of -inf scores adds nothing)
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (c + k < classes) sum += expf(xs[k] - top);
      part = merge(part, make_float2(top, sum));
    }
  }
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

// V scores a thread and step
template <typename T, int V>
__global__ void backward_rows(const float* grad, const T* x, const int64_t* target, const float* lse, T* dx,
                              int64_t cols, int64_t classes, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  const T* x_row = x + row * cols;
  T* dx_row = dx + row * cols;
  const float g = t == ignore_index ? 0.0f : grad[row], row_lse = lse[row];
  for (int64_t c = threadIdx.x * static_cast<int64_t>(V); c < cols; c += static_cast<int64_t>(blockDim.x) * V) {
    float out[V] = {};
    if (g != 0.0f && c < classes) {  // (past classes, or for a zero grad: zeros, the scores unread)
      float xs[V];
      load<V>(x_row + c, xs);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float p = c + k >= classes ? 0.0f : expf(xs[k] - row_lse) * g;
        out[k] = c + k == t && c + k < classes ? p - g : p;
      }
    }
    store<V>(dx_row + c, out);
  }
}

// 16 bytes of scores a thread and step where every row starts aligned for them
template <typename T>
bool vectors_fit(const void* x, const void* dx, int64_t cols) {
  constexpr int V = 16 / sizeof(T);
  return cols % V == 0 && aligned_for<V>(static_cast<const T*>(x)) && aligned_for<V>(static_cast<const T*>(dx));
}

template <typename T>
void launch_forward(const void* x, const int64_t* target, float* losses, float* lse, int64_t rows, int64_t cols,
                    int64_t classes, int64_t ignore_index, cudaStream_t s) {
  const T* scores = static_cast<const T*>(x);
  at_width<16 / sizeof(T)>(vectors_fit<T>(x, nullptr, cols), [&]<int V>() {
    forward_rows<T, V><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(scores, target, losses, lse, cols, classes,
                                                                         ignore_index);
  });
}

template <typename T>
void launch_backward(const float* grad, const void* x, const int64_t* target, const float* lse, void* dx,
                     int64_t rows, int64_t cols, int64_t classes, int64_t ignore_index, cudaStream_t s) {
  const T* scores = static_cast<const T*>(x);
  T* out = static_cast<T*>(dx);
  at_width<16 / sizeof(T)>(vectors_fit<T>(x, dx, cols), [&]<int V>() {
    backward_rows<T, V><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(grad, scores, target, lse, out, cols,
                                                                          classes, ignore_index);
  });
}

}  // namespace

const char* cross_entropy_cuda(ElementType type, const void* x, const int64_t* target, float* losses, float* lse,
                               int64_t rows, int64_t cols, int64_t classes, int64_t ignore_index, void* stream) {
  if (rows == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case ElementType::kFloat:
      launch_forward<float>(x, target, losses, lse, rows, cols, classes, ignore_index, s);
      break;
    case ElementType::kFloat16:
      launch_forward<__half>(x, target, losses, lse, rows, cols, classes, ignore_index, s);
      break;
    case ElementType::kBFloat16:
      launch_forward<__nv_bfloat16>(x, target, losses, lse, rows, cols, classes, ignore_index, s);
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
  switch (type) {
    case ElementType::kFloat:
      launch_backward<float>(grad, x, target, lse, dx, rows, cols, classes, ignore_index, s);
      break;
    case ElementType::kFloat16:
      launch_backward<__half>(grad, x, target, lse, dx, rows, cols, classes, ignore_index, s);
      break;
    case ElementType::kBFloat16:
      launch_backward<__nv_bfloat16>(grad, x, target, lse, dx, rows, cols, classes, ignore_index, s);
      break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
