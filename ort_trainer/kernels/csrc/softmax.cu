// The CUDA kernels of SafeSoftmax and SoftmaxGrad (ops.cc), over each row (the last axis), in float32 whatever the
// tensors' dtype, rounded once. One warp a row: each lane's share of the row's reductions, combined by shuffles,
// then its share of the output; 4 consecutive columns a lane and step where every row starts aligned for them (a
// multiple of 4 columns, aligned tensors), one otherwise.
//   SafeSoftmax: y = exp(x - max) / sum(exp(x - max)), and 0 on a row whose every value is -inf; BiasSafeSoftmax
//                the same of x + bias (broadcast, rounded to the dtype)
//   SoftmaxGrad: dx = y * (dy - sum(dy * y))
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"
#include "vector_io.cuh"

namespace ort_trainer_kernels {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kVector = 4;  // the columns a lane reads at a time where rows of a multiple of 4 start aligned for them

// V columns a lane and step
template <typename T, int V>
__global__ void softmax_grad_rows(const T* dy, const T* y, T* dx, int64_t rows, int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t first = (threadIdx.x & 31) * static_cast<int64_t>(V);
  const T* dy_row = dy + row * cols;
  const T* y_row = y + row * cols;
  T* dx_row = dx + row * cols;
  float sum = 0.0f;
  for (int64_t c = first; c < cols; c += 32 * V) {
    float d[V], v[V];
    load<V>(dy_row + c, d);
    load<V>(y_row + c, v);
#pragma unroll
    for (int k = 0; k < V; ++k) sum += d[k] * v[k];
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  for (int64_t c = first; c < cols; c += 32 * V) {
    float d[V], v[V];
    load<V>(dy_row + c, d);
    load<V>(y_row + c, v);
#pragma unroll
    for (int k = 0; k < V; ++k) d[k] = v[k] * (d[k] - sum);
    store<V>(dx_row + c, d);
  }
}

// the row's values at columns c .. c + V - 1: x, or x + bias rounded to T (Add's result: float32 holds the sum of two
// float16 or bfloat16 values closely enough that rounding it to T gives the correctly rounded sum); a bias along the
// row (col_stride 1) read V at a time, or one value for the whole row (col_stride 0)
template <typename T, int V>
__device__ __forceinline__ void biased(const T* x_row, const T* bias_row, int64_t col_stride, int64_t c,
                                       float (&out)[V]) {
  load<V>(x_row + c, out);
  if (bias_row == nullptr) return;
  float b[V];
  if (col_stride == 0) {
#pragma unroll
    for (int k = 0; k < V; ++k) b[k] = to_float(bias_row[0]);
  } else {
    load<V>(bias_row + c, b);
  }
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] = to_float(from_float<T>(out[k] + b[k]));
}

template <typename T, int V>
__global__ void safe_softmax_rows(const T* x, const T* bias, RowBroadcast broadcast, T* y, int64_t rows,
                                  int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t first = (threadIdx.x & 31) * static_cast<int64_t>(V);
  const T* x_row = x + row * cols;
  const T* bias_row = bias == nullptr ? nullptr : bias + broadcast.row_offset(row);
  const int64_t step = broadcast.col_stride;
  T* y_row = y + row * cols;
  float top = -INFINITY;
  int masked = 1;  // every value -inf (a NaN is not, and turns the row's softmax to NaN as torch's does)
  for (int64_t c = first; c < cols; c += 32 * V) {
    float v[V];
    biased<T, V>(x_row, bias_row, step, c, v);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      top = fmaxf(top, v[k]);
      masked &= v[k] == -INFINITY;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
    masked &= __shfl_xor_sync(0xffffffffu, masked, offset);
  }
  if (masked) {
    float zeros[V] = {};
    for (int64_t c = first; c < cols; c += 32 * V) store<V>(y_row + c, zeros);
    return;
  }
  float sum = 0.0f;
  for (int64_t c = first; c < cols; c += 32 * V) {
    float v[V];
    biased<T, V>(x_row, bias_row, step, c, v);
#pragma unroll
    for (int k = 0; k < V; ++k) sum += expf(v[k] - top);
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float scale = 1.0f / sum;
  for (int64_t c = first; c < cols; c += 32 * V) {
    float v[V];
    biased<T, V>(x_row, bias_row, step, c, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = expf(v[k] - top) * scale;
    store<V>(y_row + c, v);
  }
}

// whether every row of the tensors starts on a boundary of kVector elements (a bias along the row too: its rows lie
// a multiple of cols apart)
template <typename T>
bool vectors_fit(int64_t cols, const void* a, const void* b, const void* c) {
  return cols % kVector == 0 && aligned_for<kVector>(static_cast<const T*>(a)) &&
         aligned_for<kVector>(static_cast<const T*>(b)) && aligned_for<kVector>(static_cast<const T*>(c));
}

template <typename T>
void launch_forward(const void* x, const void* bias, const RowBroadcast& broadcast, void* y, int64_t rows,
                    int64_t cols, cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const T *in = static_cast<const T*>(x), *b = static_cast<const T*>(bias);
  T* out = static_cast<T*>(y);
  at_width<kVector>(vectors_fit<T>(cols, x, bias, y), [&]<int V>() {
    safe_softmax_rows<T, V><<<blocks, kWarpsPerBlock * 32, 0, s>>>(in, b, broadcast, out, rows, cols);
  });
}

template <typename T>
void launch(const void* dy, const void* y, void* dx, int64_t rows, int64_t cols, cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const T *g = static_cast<const T*>(dy), *v = static_cast<const T*>(y);
  T* out = static_cast<T*>(dx);
  at_width<kVector>(vectors_fit<T>(cols, dy, y, dx), [&]<int V>() {
    softmax_grad_rows<T, V><<<blocks, kWarpsPerBlock * 32, 0, s>>>(g, v, out, rows, cols);
  });
}

}  // namespace

const char* softmax_grad_cuda(ElementType type, const void* dy, const void* y, void* dx, int64_t rows, int64_t cols,
                              void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case ElementType::kFloat: launch<float>(dy, y, dx, rows, cols, s); break;
    case ElementType::kFloat16: launch<__half>(dy, y, dx, rows, cols, s); break;
    case ElementType::kBFloat16: launch<__nv_bfloat16>(dy, y, dx, rows, cols, s); break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

const char* safe_softmax_cuda(ElementType type, const void* x, const void* bias, RowBroadcast broadcast, void* y,
                              int64_t rows, int64_t cols, void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case ElementType::kFloat: launch_forward<float>(x, bias, broadcast, y, rows, cols, s); break;
    case ElementType::kFloat16: launch_forward<__half>(x, bias, broadcast, y, rows, cols, s); break;
    case ElementType::kBFloat16: launch_forward<__nv_bfloat16>(x, bias, broadcast, y, rows, cols, s); break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
