// The CUDA launchers of ort_trainer's kernels (ort_trainer/kernels/csrc/kernels.h), under C names for ctypes, as the
// emulated library (cuda_runtime.h) exports them to tests/test_cuda_emulated.py. Types are ONNX's numbers.
#include <vector>

#include "kernels.h"
#include "layer_norm.h"

using namespace ort_trainer_kernels;

namespace {
ElementType as_type(int type) { return static_cast<ElementType>(type); }
}  // namespace

extern "C" {

const char* emu_gelu_grad(int type, int tanh_form, const void* dy, const void* x, void* dx, int64_t n) {
  return gelu_grad_cuda(as_type(type), tanh_form != 0, dy, x, dx, n, nullptr);
}

const char* emu_layer_norm_grad(int t, int d, int c, int g, const void* dy, const void* x, const void* mean,
                                const void* rstd, const void* gamma, const void* residual, void* dx, void* dx_cast,
                                void* dgamma, void* dbeta, float* partials, int64_t rows, int64_t cols,
                                int64_t chunks) {
  return layer_norm_grad_cuda(as_type(t), as_type(d), as_type(c), as_type(g), dy, x, mean, rstd, gamma, residual, dx,
                              dx_cast, dgamma, dbeta, partials, rows, cols, chunks, nullptr);
}

int64_t emu_layer_norm_chunks(int64_t rows) { return layer_norm_chunks(rows); }

const char* emu_layer_norm_cast(int type, const float* x, const void* branch, float* sum, const float* gamma,
                                const float* beta, void* y, float* y32, float* mean, float* rstd, int64_t rows,
                                int64_t cols, float epsilon) {
  return layer_norm_cast_cuda(as_type(type), x, branch, sum, gamma, beta, y, y32, mean, rstd, rows, cols, epsilon,
                              nullptr);
}

const char* emu_softmax_grad(int type, const void* dy, const void* y, void* dx, int64_t rows, int64_t cols) {
  return softmax_grad_cuda(as_type(type), dy, y, dx, rows, cols, nullptr);
}

// the bias's broadcast as ops.cc's row_broadcast computes it: x's leading dims, the bias's strides along them
const char* emu_safe_softmax(int type, const void* x, const void* bias, int rank, const int64_t* dims,
                             const int64_t* strides, int64_t col_stride, void* y, int64_t rows, int64_t cols) {
  RowBroadcast broadcast;
  broadcast.rank = rank;
  for (int i = 0; i < rank && i < kMaxRowRank; ++i) {
    broadcast.dims[i] = dims[i];
    broadcast.strides[i] = strides[i];
  }
  broadcast.col_stride = col_stride;
  return safe_softmax_cuda(as_type(type), x, bias, broadcast, y, rows, cols, nullptr);
}

const char* emu_cross_entropy(int type, const void* x, const int64_t* target, float* losses, float* lse, int64_t rows,
                              int64_t cols, int64_t classes, int64_t ignore_index) {
  return cross_entropy_cuda(as_type(type), x, target, losses, lse, rows, cols, classes, ignore_index, nullptr);
}

const char* emu_cross_entropy_grad(int type, const float* grad, const void* x, const int64_t* target,
                                   const float* lse, void* dx, int64_t rows, int64_t cols, int64_t classes,
                                   int64_t ignore_index) {
  return cross_entropy_grad_cuda(as_type(type), grad, x, target, lse, dx, rows, cols, classes, ignore_index, nullptr);
}

const char* emu_add_half(int type, int sum_type, const void* sum, const void* const* xs, int count, float* out,
                         int64_t n) {
  return add_half_cuda(as_type(type), as_type(sum_type), sum, xs, count, out, n, nullptr);
}

// copy k: xs[k]'s ns[k] values into ys[k], padded[k] elements (ops.cc's HalfCopy table)
const char* emu_half_copies(int type, const void* const* xs, void* const* ys, const int64_t* ns, const int64_t* padded,
                            int count) {
  std::vector<HalfCopy> copies(count);
  for (int k = 0; k < count; ++k) copies[k] = HalfCopy{static_cast<const float*>(xs[k]), ys[k], ns[k], padded[k]};
  return half_copies_cuda(as_type(type), copies.data(), count, nullptr);
}

const char* emu_device_copy(const void* src, void* dst, int64_t bytes) {
  return device_copy_cuda(src, dst, bytes, nullptr);
}

const char* emu_seeded_dropout(int type, const void* x, void* y, bool* mask, int64_t n, const int64_t* seed,
                               uint32_t stream, uint32_t threshold, float scale) {
  return seeded_dropout_cuda(as_type(type), x, y, mask, n, seed, stream, threshold, scale, nullptr);
}

}  // extern "C"
