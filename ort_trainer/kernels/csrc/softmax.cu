// The CUDA kernels of SafeSoftmax and SoftmaxGrad (ops.cc), over each row (the last axis), in float32 whatever the
// tensors' dtype, rounded once. One warp a row: each lane's share of the row's reductions, combined by shuffles,
// then its share of the output.
//   SafeSoftmax: y = exp(x - max) / sum(exp(x - max)), and 0 on a row whose every value is -inf; BiasSafeSoftmax
//                the same of x + bias (broadcast, rounded to the dtype)
//   SoftmaxGrad: dx = y * (dy - sum(dy * y))
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"

namespace ort_trainer_kernels {
namespace {

constexpr int kWarpsPerBlock = 8;

template <typename T>
__global__ void softmax_grad_rows(const T* dy, const T* y, T* dx, int64_t rows, int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* dy_row = dy + row * cols;
  const T* y_row = y + row * cols;
  T* dx_row = dx + row * cols;
  float sum = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) sum += to_float(dy_row[c]) * to_float(y_row[c]);
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  for (int64_t c = lane; c < cols; c += 32) {
    const float v = to_float(y_row[c]);
    dx_row[c] = from_float<T>(v * (to_float(dy_row[c]) - sum));
  }
}

// the row's value at column c: x, or x + bias rounded to T (Add's result: float32 holds the sum of two float16 or
// bfloat16 values closely enough that rounding it to T gives the correctly rounded sum)
template <typename T>
__device__ __forceinline__ float biased(const T* x_row, const T* bias_row, int64_t col_stride, int64_t c) {
  if (bias_row == nullptr) return to_float(x_row[c]);
  return to_float(from_float<T>(to_float(x_row[c]) + to_float(bias_row[c * col_stride])));
}

template <typename T>
__global__ void safe_softmax_rows(const T* x, const T* bias, RowBroadcast broadcast, T* y, int64_t rows,
                                  int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* x_row = x + row * cols;
  const T* bias_row = bias == nullptr ? nullptr : bias + broadcast.row_offset(row);
  const int64_t step = broadcast.col_stride;
  T* y_row = y + row * cols;
  float top = -INFINITY;
  int masked = 1;  // every value -inf (a NaN is not, and turns the row's softmax to NaN as torch's does)
  for (int64_t c = lane; c < cols; c += 32) {
    const float v = biased(x_row, bias_row, step, c);
    top = fmaxf(top, v);
    masked &= v == -INFINITY;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
    masked &= __shfl_xor_sync(0xffffffffu, masked, offset);
  }
  if (masked) {
    for (int64_t c = lane; c < cols; c += 32) y_row[c] = from_float<T>(0.0f);
    return;
  }
  float sum = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) sum += expf(biased(x_row, bias_row, step, c) - top);
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float scale = 1.0f / sum;
  for (int64_t c = lane; c < cols; c += 32)
    y_row[c] = from_float<T>(expf(biased(x_row, bias_row, step, c) - top) * scale);
}

template <typename T>
void launch_forward(const void* x, const void* bias, const RowBroadcast& broadcast, void* y, int64_t rows,
                    int64_t cols, cudaStream_t s) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  safe_softmax_rows<T><<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, s>>>(
      static_cast<const T*>(x), static_cast<const T*>(bias), broadcast, static_cast<T*>(y), rows, cols);
}

template <typename T>
void launch(const void* dy, const void* y, void* dx, int64_t rows, int64_t cols, cudaStream_t s) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  softmax_grad_rows<T><<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, s>>>(
      static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dx), rows, cols);
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
