// What ops.cc (the ONNX Runtime side) and the CUDA kernels (*.cu) share.
#pragma once

#include <stdint.h>

namespace ort_trainer_kernels {

// the tensor dtypes the operators take (their ONNX TensorProto numbers)
enum class ElementType : int { kFloat = 1, kFloat16 = 10, kBFloat16 = 16 };

// Each launcher queues its kernels on `stream` (a cudaStream_t) and returns nullptr, or CUDA's message of a
// launch's error.

// dx = dy * GELU'(x) over n elements (gelu.h)
const char* gelu_grad_cuda(ElementType type, bool tanh_form, const void* dy, const void* x, void* dx, int64_t n,
                           void* stream);

// LayerNorm's backward over `rows` rows of `cols` values (layer_norm.h), in float32 whatever the dtypes (t: x,
// mean, rstd and dx; d: dy; c: dx_cast; g: gamma, dgamma and dbeta): dx; the column sums of dy * xhat and of dy over
// each of `chunks` runs of rows into partials [chunks, 2, cols] (float32); their sums over the chunks, in order, into
// dgamma and dbeta. With a residual (nullptr: none; t's dtype), dx is the residual + the gradient rounded to t, one
// add as an Add node computes it; with dx_cast (nullptr: none), dx rounded to c as well (c is d, or float16 or
// bfloat16 where t, d and g are float32)
const char* layer_norm_grad_cuda(ElementType t, ElementType d, ElementType c, ElementType g, const void* dy,
                                 const void* x, const void* mean, const void* rstd, const void* gamma,
                                 const void* residual, void* dx, void* dx_cast, void* dgamma, void* dbeta,
                                 float* partials, int64_t rows, int64_t cols, int64_t chunks, void* stream);

// LayerNorm's forward over `rows` rows of `cols` float32 values (x, gamma, beta float32): each row's mean and
// rstd = 1 / sqrt(var + epsilon) (float32, one a row), and y = (x - mean) * rstd * gamma + beta rounded to
// `type` (float16 or bfloat16); the float32 y too where y32 is not null (its half copy is y32's rounding). Where
// branch (of `type`) is not null, the rows normalized are x + branch, each element one rounded float32 add (as an
// Add of x and a Cast of branch computes it), written to sum
const char* layer_norm_cast_cuda(ElementType type, const float* x, const void* branch, float* sum, const float* gamma,
                                 const float* beta, void* y, float* y32, float* mean, float* rstd, int64_t rows,
                                 int64_t cols, float epsilon, void* stream);

// a softmax's gradient over the last axis: dx = y * (dy - sum(dy * y)) for each of `rows` rows of `cols` values
const char* softmax_grad_cuda(ElementType type, const void* dy, const void* y, void* dx, int64_t rows, int64_t cols,
                              void* stream);

// a function of the CPU kernels and the CUDA ones alike
#if defined(__CUDACC__)
#define ORTT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ORTT_HOST_DEVICE inline
#endif

// a bias broadcast over a softmax's rows (BiasSafeSoftmax): row r of x, whose dims before the last are `dims`
// (row-major), reads the bias at row_offset(r) + c * col_stride (col_stride 0 or 1; strides 0 along a dim the bias
// has 1 of)
constexpr int kMaxRowRank = 8;
struct RowBroadcast {
  int rank = 0;
  int64_t dims[kMaxRowRank] = {};
  int64_t strides[kMaxRowRank] = {};
  int64_t col_stride = 0;

  ORTT_HOST_DEVICE int64_t row_offset(int64_t row) const {
    int64_t offset = 0;
    for (int i = rank - 1; i >= 0; --i) {
      offset += (row % dims[i]) * strides[i];
      row /= dims[i];
    }
    return offset;
  }
};

// a safe softmax over the last axis: a row whose every value is -inf gives zeros (torch's _safe_softmax); with a
// bias (nullptr: none), of x + bias rounded to the dtype, as an Add node before it gives (broadcast: RowBroadcast)
const char* safe_softmax_cuda(ElementType type, const void* x, const void* bias, RowBroadcast broadcast, void* y,
                              int64_t rows, int64_t cols, void* stream);

// cross-entropy over `rows` rows of `classes` class scores x, rows `cols` apart (a padded product's, the rest no
// scores), against int64 targets: each row's log-sum-exp and loss (lse - x[target]; 0 for an ignored row, NaN for
// a target out of range), float32
const char* cross_entropy_cuda(ElementType type, const void* x, const int64_t* target, float* losses, float* lse,
                               int64_t rows, int64_t cols, int64_t classes, int64_t ignore_index, void* stream);

// its gradient: dx = grad[row] * (exp(x - lse) - [c == target]), zeros for an ignored row and past `classes`
const char* cross_entropy_grad_cuda(ElementType type, const float* grad, const void* x, const int64_t* target,
                                    const float* lse, void* dx, int64_t rows, int64_t cols, int64_t classes,
                                    int64_t ignore_index, void* stream);

// sum + xs[0] + ... + xs[count - 1], each widened to float32, in order, over n values (each holds at least n: its
// first n are read); sum float32 (sum_type) or of the xs' half dtype (type)
const char* add_half_cuda(ElementType type, ElementType sum_type, const void* sum, const void* const* xs, int count,
                          float* out, int64_t n, void* stream);

// one tensor of CastsToFloat16 or CastsToBFloat16 (ops.cc): the n float32 values of x rounded to the half dtype into
// y, then zeros up to `padded` elements of y (a padded product's weight: graph/passes/weight_casts.py)
struct HalfCopy {
  const float* x;
  void* y;
  int64_t n;
  int64_t padded;  // >= n
};

// every copy of `copies` (count of them) into y of `type` (float16 or bfloat16), in a few launches (each of up to
// kMaxHalfCopies tensors)
constexpr int kMaxHalfCopies = 64;
const char* half_copies_cuda(ElementType type, const HalfCopy* copies, int count, void* stream);

// `bytes` bytes of src copied to dst, device to device (AliasAfter's y where ONNX Runtime gave it a buffer of its own)
const char* device_copy_cuda(const void* src, void* dst, int64_t bytes, void* stream);

// SeededDropout (philox.h) over n elements of x (of `type`): y = x * scale where element i's draw under *seed (read
// by the kernel from device memory) for node `stream` is below `threshold`, x * 0 elsewhere (a dropped NaN stays
// NaN, as in torch); mask[i] whether element i was kept
const char* seeded_dropout_cuda(ElementType type, const void* x, void* y, bool* mask, int64_t n, const int64_t* seed,
                                uint32_t stream, uint32_t threshold, float scale, void* stream_handle);

}  // namespace ort_trainer_kernels
