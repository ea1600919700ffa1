// ort_trainer's custom operators for ONNX Runtime (domain "ort_trainer", ../__init__.py): their CPU kernels, and
// the registration of those and of the CUDA kernels (gelu.cu, where nvcc built the library) with a session.
//
// Operators:
//   GeluGrad(dy, x) -> dx       dx = dy * GELU'(x), GELU(x) = x * Phi(x); float32, float16 and bfloat16, dy, x and
//                               dx of one shape and dtype
//   TanhGeluGrad(dy, x) -> dx   the same for GELU's tanh approximation (gelu.h)
//   LayerNormGrad(dy, x, mean, rstd, gamma) -> (dx, dgamma, dbeta, partials)
//                               LayerNorm's backward over the last dims (as many values a row as gamma has),
//                               from the forward's mean and rstd (one a row); float32. partials: the column sums
//                               of each chunk of rows, [chunks, 2, cols] (the CUDA kernel's deterministic
//                               reduction; one chunk on the CPU), read by no other node (layer_norm.h)
//   SoftmaxGrad(dy, y) -> dx    a softmax's gradient over the last axis, dx = y * (dy - sum(dy * y)), from its
//                               output y; float32, float16 and bfloat16, computed in float32
//   SafeSoftmax(x) -> y         a softmax over the last axis whose rows of only -inf give zeros (torch's
//                               _safe_softmax, attention's); float32, float16 and bfloat16, computed in float32
//   CrossEntropy(x, target) -> (losses, lse)
//                               each row's cross-entropy of class scores x [rows, classes] (float32, float16 or
//                               bfloat16) against int64 targets, and its log-sum-exp, float32 [rows]: lse -
//                               x[target], 0 where target == the attribute ignore_index, NaN out of range
//   CrossEntropyGrad(grad, x, target, lse) -> dx
//                               dx = grad[row] * (softmax(x) - onehot(target)), zeros for an ignored row, in x's dtype
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "gelu.h"
#include "half.h"
#include "kernels.h"
#include "layer_norm.h"
#include "ort_abi.h"

#define ORTT_EXPORT extern "C" __attribute__((visibility("default")))

namespace ort_trainer_kernels {
namespace {

using namespace ort_abi;

constexpr uint32_t kOpVersion = 16;  // KernelComputeV2 (errors reach the session as a failed run)

enum class Kind { kGeluGrad, kLayerNormGrad, kSoftmaxGrad, kSafeSoftmax, kCrossEntropy, kCrossEntropyGrad };

struct Operator : OrtCustomOp {
  const char* name;
  Kind kind;
  bool tanh_form;
  bool cuda;
  ElementType type;        // of every input and output but LayerNormGrad's gamma, dgamma, dbeta and partials
  ElementType gamma_type;  // LayerNormGrad's gamma, dgamma and dbeta
  size_t inputs, outputs;
  ONNXTensorElementDataType input_types[5], output_types[4];
};

struct Kernel {
  const OrtApi* api;
  const Operator* op;
  int64_t ignore_index;  // CrossEntropy and CrossEntropyGrad's attribute
};

// ---- CPU loops: float32 arithmetic (float64 sums), one rounding to the tensors' dtype ----------------------------
struct F32 {
  using Storage = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct F16 {
  using Storage = uint16_t;
  static float load(uint16_t v) { return float16_to_float(v); }
  static uint16_t store(float v) { return float_to_float16(v); }
};
struct BF16 {
  using Storage = uint16_t;
  static float load(uint16_t v) { return bfloat16_to_float(v); }
  static uint16_t store(float v) { return float_to_bfloat16(v); }
};

// run(begin, end) over [0, items) split among the machine's cores, where each share has at least `grain` items
// (ONNX Runtime's own threads wait while a custom kernel runs); the shares and their order depend only on `items`
// and the core count
template <typename Run>
void parallel(int64_t items, int64_t grain, Run&& run) {
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t shares = std::max<int64_t>(1, std::min(cores, items / std::max<int64_t>(grain, 1)));
  if (shares == 1) {
    run(int64_t{0}, items);
    return;
  }
  std::vector<std::thread> threads;
  const int64_t step = (items + shares - 1) / shares;
  for (int64_t begin = step; begin < items; begin += step)
    threads.emplace_back([&run, begin, step, items] { run(begin, std::min(items, begin + step)); });
  run(int64_t{0}, std::min(items, step));
  for (auto& thread : threads) thread.join();
}

constexpr int64_t kGrain = 1 << 16;  // elements of a share: below that, starting a thread costs more than it saves

// calls run.template operator()<F32 / F16 / BF16>() for `type`
template <typename Run>
void dispatch(ElementType type, Run&& run) {
  switch (type) {
    case ElementType::kFloat: run.template operator()<F32>(); break;
    case ElementType::kFloat16: run.template operator()<F16>(); break;
    case ElementType::kBFloat16: run.template operator()<BF16>(); break;
  }
}

template <typename T, bool kTanh>
void gelu_grad_cpu(const void* dy, const void* x, void* dx, int64_t n) {
  using S = typename T::Storage;
  const S *a = static_cast<const S*>(dy), *b = static_cast<const S*>(x);
  S* out = static_cast<S*>(dx);
  parallel(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = T::load(b[i]);
      out[i] = T::store(T::load(a[i]) * (kTanh ? gelu_tanh_derivative(v) : gelu_erf_derivative(v)));
    }
  });
}

// LayerNorm's backward (layer_norm.h), one chunk: partials [1, 2, cols] hold dgamma and dbeta's float32 sums (the
// float64 sums of each core's share of rows, added in order)
template <typename T, typename G>
void layer_norm_grad_cpu(const void* dy_, const void* x_, const void* mean_, const void* rstd_, const void* gamma_,
                         void* dx_, void* dgamma_, void* dbeta_, float* partials, int64_t rows, int64_t cols) {
  using S = typename T::Storage;
  using GS = typename G::Storage;
  const S *dy = static_cast<const S*>(dy_), *x = static_cast<const S*>(x_);
  const S *mean = static_cast<const S*>(mean_), *rstd = static_cast<const S*>(rstd_);
  const GS* gamma = static_cast<const GS*>(gamma_);
  S* dx = static_cast<S*>(dx_);
  // each share of rows sums its own columns; the shares' sums are added in order
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1));
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t step = std::max<int64_t>(grain, (rows + cores - 1) / cores);
  const int64_t shares = std::max<int64_t>(1, (rows + step - 1) / step);
  std::vector<double> sums(static_cast<size_t>(shares * 2 * cols), 0.0);
  parallel(shares, 1, [&](int64_t first, int64_t last) {
    for (int64_t share = first; share < last; ++share) {
      double *sum_g = sums.data() + share * 2 * cols, *sum_b = sum_g + cols;
      for (int64_t row = share * step; row < std::min(rows, (share + 1) * step); ++row) {
        const S *d = dy + row * cols, *v = x + row * cols;
        const double m = T::load(mean[row]), r = T::load(rstd[row]);
        double s_g = 0.0, s_gx = 0.0;
        for (int64_t c = 0; c < cols; ++c) {
          const double dv = T::load(d[c]), xhat = (T::load(v[c]) - m) * r, g = dv * G::load(gamma[c]);
          s_g += g;
          s_gx += g * xhat;
          sum_g[c] += dv * xhat;
          sum_b[c] += dv;
        }
        const double mean_g = s_g / cols, mean_gx = s_gx / cols;
        S* out = dx + row * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const double xhat = (T::load(v[c]) - m) * r, g = T::load(d[c]) * static_cast<double>(G::load(gamma[c]));
          out[c] = T::store(static_cast<float>(r * (g - mean_g - xhat * mean_gx)));
        }
      }
    }
  });
  GS *dgamma = static_cast<GS*>(dgamma_), *dbeta = static_cast<GS*>(dbeta_);
  for (int64_t c = 0; c < cols; ++c) {
    double g = 0.0, b = 0.0;
    for (int64_t share = 0; share < shares; ++share) {
      g += sums[share * 2 * cols + c];
      b += sums[share * 2 * cols + cols + c];
    }
    partials[c] = static_cast<float>(g);
    partials[cols + c] = static_cast<float>(b);
    dgamma[c] = G::store(partials[c]);
    dbeta[c] = G::store(partials[cols + c]);
  }
}

// a softmax's gradient over rows of `cols` values, the row's sum in float64
template <typename T>
void softmax_grad_cpu(const void* dy_, const void* y_, void* dx_, int64_t rows, int64_t cols) {
  using S = typename T::Storage;
  const S *dy = static_cast<const S*>(dy_), *y = static_cast<const S*>(y_);
  S* dx = static_cast<S*>(dx_);
  parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const S *d = dy + row * cols, *v = y + row * cols;
      double sum = 0.0;
      for (int64_t c = 0; c < cols; ++c) sum += static_cast<double>(T::load(d[c])) * T::load(v[c]);
      S* out = dx + row * cols;
      for (int64_t c = 0; c < cols; ++c)
        out[c] = T::store(static_cast<float>(T::load(v[c]) * (T::load(d[c]) - sum)));
    }
  });
}

// a safe softmax over rows of `cols` values: exp(x - max) / sum, zeros for a row of only -inf (a NaN anywhere in
// a row makes the row NaN, as torch's softmax does)
template <typename T>
void safe_softmax_cpu(const void* x_, void* y_, int64_t rows, int64_t cols) {
  using S = typename T::Storage;
  const S* x = static_cast<const S*>(x_);
  S* y = static_cast<S*>(y_);
  parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const S* v = x + row * cols;
      S* out = y + row * cols;
      double top = -INFINITY;
      bool masked = true;
      for (int64_t c = 0; c < cols; ++c) {
        const double value = T::load(v[c]);
        top = value > top ? value : top;
        masked = masked && value == -INFINITY;
      }
      if (masked) {
        for (int64_t c = 0; c < cols; ++c) out[c] = T::store(0.0f);
        continue;
      }
      double sum = 0.0;
      for (int64_t c = 0; c < cols; ++c) sum += exp(T::load(v[c]) - top);
      for (int64_t c = 0; c < cols; ++c) out[c] = T::store(static_cast<float>(exp(T::load(v[c]) - top) / sum));
    }
  });
}

// cross-entropy of rows of `cols` scores: lse by a max and a float64 sum of exp; the row's loss lse - x[target]
template <typename T>
void cross_entropy_cpu(const void* x_, const int64_t* target, float* losses, float* lse, int64_t rows, int64_t cols,
                       int64_t ignore_index) {
  using S = typename T::Storage;
  const S* x = static_cast<const S*>(x_);
  parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const S* v = x + row * cols;
      double top = -INFINITY, sum = 0.0;
      bool nan = false;
      for (int64_t c = 0; c < cols; ++c) {
        const double value = T::load(v[c]);
        nan = nan || value != value;
        top = value > top ? value : top;
      }
      for (int64_t c = 0; c < cols; ++c) sum += exp(T::load(v[c]) - top);
      const double row_lse = nan ? NAN : top + log(sum);
      lse[row] = static_cast<float>(row_lse);
      const int64_t t = target[row];
      losses[row] = t == ignore_index ? 0.0f
                    : (t >= 0 && t < cols ? static_cast<float>(row_lse - T::load(v[t])) : NAN);
    }
  });
}

template <typename T>
void cross_entropy_grad_cpu(const float* grad, const void* x_, const int64_t* target, const float* lse, void* dx_,
                            int64_t rows, int64_t cols, int64_t ignore_index) {
  using S = typename T::Storage;
  const S* x = static_cast<const S*>(x_);
  S* dx = static_cast<S*>(dx_);
  parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = target[row];
      const double g = t == ignore_index ? 0.0 : grad[row];
      const S* v = x + row * cols;
      S* out = dx + row * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const double p = g == 0.0 ? 0.0 : exp(T::load(v[c]) - static_cast<double>(lse[row])) * g;
        out[c] = T::store(static_cast<float>(c == t ? p - g : p));
      }
    }
  });
}

// ---- one run of an operator ----------------------------------------------------------------------------------
OrtStatus* fail(const OrtApi* api, const std::string& message) {
  return slot<CreateStatus>(api, kCreateStatus)(ORT_RUNTIME_EXCEPTION, ("ort_trainer kernels: " + message).c_str());
}

#define ORTT_RETURN_IF_ERROR(expression)   \
  do {                                     \
    OrtStatus* status_ = (expression);     \
    if (status_ != nullptr) return status_; \
  } while (0)

struct Tensor {
  void* data = nullptr;
  std::vector<int64_t> dims;
  int64_t size = 1;  // elements
};

OrtStatus* input(const OrtApi* api, OrtKernelContext* context, size_t index, Tensor* tensor) {
  const OrtValue* value = nullptr;
  ORTT_RETURN_IF_ERROR(slot<KernelContextGetInput>(api, kKernelContextGetInput)(context, index, &value));
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ORTT_RETURN_IF_ERROR(slot<GetTensorTypeAndShape>(api, kGetTensorTypeAndShape)(value, &info));
  size_t rank = 0;
  OrtStatus* status = slot<GetDimensionsCount>(api, kGetDimensionsCount)(info, &rank);
  if (status == nullptr) {
    tensor->dims.resize(rank);
    status = slot<GetDimensions>(api, kGetDimensions)(info, tensor->dims.data(), rank);
  }
  slot<ReleaseTensorTypeAndShapeInfo>(api, kReleaseTensorTypeAndShapeInfo)(info);
  ORTT_RETURN_IF_ERROR(status);
  tensor->size = 1;
  for (int64_t d : tensor->dims) tensor->size *= d;
  return slot<GetTensorMutableData>(api, kGetTensorMutableData)(const_cast<OrtValue*>(value), &tensor->data);
}

OrtStatus* output(const OrtApi* api, OrtKernelContext* context, size_t index, const std::vector<int64_t>& dims,
                  Tensor* tensor) {
  OrtValue* value = nullptr;
  ORTT_RETURN_IF_ERROR(
      slot<KernelContextGetOutput>(api, kKernelContextGetOutput)(context, index, dims.data(), dims.size(), &value));
  tensor->dims = dims;
  tensor->size = 1;
  for (int64_t d : dims) tensor->size *= d;
  return slot<GetTensorMutableData>(api, kGetTensorMutableData)(value, &tensor->data);
}

#ifdef ORT_TRAINER_KERNELS_CUDA
OrtStatus* cuda_stream(const OrtApi* api, OrtKernelContext* context, void** stream) {
  return slot<KernelContextGetGPUComputeStream>(api, kKernelContextGetGPUComputeStream)(context, stream);
}
#endif

OrtStatus* compute_gelu_grad(const OrtApi* api, const Operator* op, OrtKernelContext* context) {
  Tensor dy, x, dx;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &dy));
  ORTT_RETURN_IF_ERROR(input(api, context, 1, &x));
  if (dy.dims != x.dims) return fail(api, std::string(op->name) + ": dy and x must have one shape");
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &dx));
  if (op->cuda) {
#ifdef ORT_TRAINER_KERNELS_CUDA
    void* stream = nullptr;
    ORTT_RETURN_IF_ERROR(cuda_stream(api, context, &stream));
    const char* error = gelu_grad_cuda(op->type, op->tanh_form, dy.data, x.data, dx.data, x.size, stream);
    if (error != nullptr) return fail(api, std::string(op->name) + " on CUDA: " + error);
#endif
    return nullptr;
  }
  dispatch(op->type, [&]<typename T>() {
    if (op->tanh_form)
      gelu_grad_cpu<T, true>(dy.data, x.data, dx.data, x.size);
    else
      gelu_grad_cpu<T, false>(dy.data, x.data, dx.data, x.size);
  });
  return nullptr;
}

OrtStatus* compute_layer_norm_grad(const OrtApi* api, const Operator* op, OrtKernelContext* context) {
  Tensor dy, x, mean, rstd, gamma;
  Tensor* inputs[] = {&dy, &x, &mean, &rstd, &gamma};
  for (size_t i = 0; i < 5; ++i) ORTT_RETURN_IF_ERROR(input(api, context, i, inputs[i]));
  const int64_t cols = gamma.size, rows = cols > 0 ? x.size / cols : 0;
  if (dy.dims != x.dims || cols == 0 || rows * cols != x.size || mean.size != rows || rstd.size != rows)
    return fail(api, "LayerNormGrad: dy and x must have one shape, a multiple of gamma's size, and mean and rstd "
                     "one value for each row of gamma's size");
  const int64_t chunks = op->cuda ? layer_norm_chunks(rows) : 1;
  Tensor dx, dgamma, dbeta, partials;
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &dx));
  ORTT_RETURN_IF_ERROR(output(api, context, 1, gamma.dims, &dgamma));
  ORTT_RETURN_IF_ERROR(output(api, context, 2, gamma.dims, &dbeta));
  ORTT_RETURN_IF_ERROR(output(api, context, 3, {chunks, 2, cols}, &partials));
  float* sums = static_cast<float*>(partials.data);
  if (op->cuda) {
#ifdef ORT_TRAINER_KERNELS_CUDA
    void* stream = nullptr;
    ORTT_RETURN_IF_ERROR(cuda_stream(api, context, &stream));
    const char* error = layer_norm_grad_cuda(op->type, op->gamma_type, dy.data, x.data, mean.data, rstd.data,
                                             gamma.data, dx.data, dgamma.data, dbeta.data, sums, rows, cols, chunks,
                                             stream);
    if (error != nullptr) return fail(api, std::string("LayerNormGrad on CUDA: ") + error);
#endif
    return nullptr;
  }
  dispatch(op->type, [&]<typename T>() {
    dispatch(op->gamma_type, [&]<typename G>() {
      layer_norm_grad_cpu<T, G>(dy.data, x.data, mean.data, rstd.data, gamma.data, dx.data, dgamma.data, dbeta.data,
                                sums, rows, cols);
    });
  });
  return nullptr;
}

OrtStatus* compute_softmax_grad(const OrtApi* api, const Operator* op, OrtKernelContext* context) {
  Tensor dy, y, dx;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &dy));
  ORTT_RETURN_IF_ERROR(input(api, context, 1, &y));
  if (dy.dims != y.dims || y.dims.empty()) return fail(api, "SoftmaxGrad: dy and y must have one shape, of rank >= 1");
  const int64_t cols = y.dims.back(), rows = cols > 0 ? y.size / cols : 0;
  ORTT_RETURN_IF_ERROR(output(api, context, 0, y.dims, &dx));
  if (op->cuda) {
#ifdef ORT_TRAINER_KERNELS_CUDA
    void* stream = nullptr;
    ORTT_RETURN_IF_ERROR(cuda_stream(api, context, &stream));
    const char* error = softmax_grad_cuda(op->type, dy.data, y.data, dx.data, rows, cols, stream);
    if (error != nullptr) return fail(api, std::string("SoftmaxGrad on CUDA: ") + error);
#endif
    return nullptr;
  }
  dispatch(op->type, [&]<typename T>() { softmax_grad_cpu<T>(dy.data, y.data, dx.data, rows, cols); });
  return nullptr;
}

OrtStatus* compute_safe_softmax(const OrtApi* api, const Operator* op, OrtKernelContext* context) {
  Tensor x, y;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &x));
  if (x.dims.empty()) return fail(api, "SafeSoftmax: x must have rank >= 1");
  const int64_t cols = x.dims.back(), rows = cols > 0 ? x.size / cols : 0;
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &y));
  if (op->cuda) {
#ifdef ORT_TRAINER_KERNELS_CUDA
    void* stream = nullptr;
    ORTT_RETURN_IF_ERROR(cuda_stream(api, context, &stream));
    const char* error = safe_softmax_cuda(op->type, x.data, y.data, rows, cols, stream);
    if (error != nullptr) return fail(api, std::string("SafeSoftmax on CUDA: ") + error);
#endif
    return nullptr;
  }
  dispatch(op->type, [&]<typename T>() { safe_softmax_cpu<T>(x.data, y.data, rows, cols); });
  return nullptr;
}

OrtStatus* compute_cross_entropy(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  const Operator* op = kernel->op;
  Tensor x, target;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &x));
  ORTT_RETURN_IF_ERROR(input(api, context, 1, &target));
  if (x.dims.size() != 2 || target.dims.size() != 1 || target.dims[0] != x.dims[0])
    return fail(api, "CrossEntropy: x must be [rows, classes] and target [rows]");
  const int64_t rows = x.dims[0], cols = x.dims[1];
  Tensor losses, lse;
  ORTT_RETURN_IF_ERROR(output(api, context, 0, {rows}, &losses));
  ORTT_RETURN_IF_ERROR(output(api, context, 1, {rows}, &lse));
  const int64_t* t = static_cast<const int64_t*>(target.data);
  float *l = static_cast<float*>(losses.data), *e = static_cast<float*>(lse.data);
  if (op->cuda) {
#ifdef ORT_TRAINER_KERNELS_CUDA
    void* stream = nullptr;
    ORTT_RETURN_IF_ERROR(cuda_stream(api, context, &stream));
    const char* error = cross_entropy_cuda(op->type, x.data, t, l, e, rows, cols, kernel->ignore_index, stream);
    if (error != nullptr) return fail(api, std::string("CrossEntropy on CUDA: ") + error);
#endif
    return nullptr;
  }
  dispatch(op->type, [&]<typename T>() { cross_entropy_cpu<T>(x.data, t, l, e, rows, cols, kernel->ignore_index); });
  return nullptr;
}

OrtStatus* compute_cross_entropy_grad(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  const Operator* op = kernel->op;
  Tensor grad, x, target, lse, dx;
  Tensor* inputs[] = {&grad, &x, &target, &lse};
  for (size_t i = 0; i < 4; ++i) ORTT_RETURN_IF_ERROR(input(api, context, i, inputs[i]));
  if (x.dims.size() != 2 || target.size != x.dims[0] || grad.size != x.dims[0] || lse.size != x.dims[0])
    return fail(api, "CrossEntropyGrad: x must be [rows, classes], and grad, target and lse one value a row");
  const int64_t rows = x.dims[0], cols = x.dims[1];
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &dx));
  const float *g = static_cast<const float*>(grad.data), *e = static_cast<const float*>(lse.data);
  const int64_t* t = static_cast<const int64_t*>(target.data);
  if (op->cuda) {
#ifdef ORT_TRAINER_KERNELS_CUDA
    void* stream = nullptr;
    ORTT_RETURN_IF_ERROR(cuda_stream(api, context, &stream));
    const char* error = cross_entropy_grad_cuda(op->type, g, x.data, t, e, dx.data, rows, cols, kernel->ignore_index,
                                                stream);
    if (error != nullptr) return fail(api, std::string("CrossEntropyGrad on CUDA: ") + error);
#endif
    return nullptr;
  }
  dispatch(op->type, [&]<typename T>() {
    cross_entropy_grad_cpu<T>(g, x.data, t, e, dx.data, rows, cols, kernel->ignore_index);
  });
  return nullptr;
}

OrtStatus* compute(void* opaque, OrtKernelContext* context) {
  const Kernel* kernel = static_cast<const Kernel*>(opaque);
  switch (kernel->op->kind) {
    case Kind::kGeluGrad: return compute_gelu_grad(kernel->api, kernel->op, context);
    case Kind::kLayerNormGrad: return compute_layer_norm_grad(kernel->api, kernel->op, context);
    case Kind::kSoftmaxGrad: return compute_softmax_grad(kernel->api, kernel->op, context);
    case Kind::kSafeSoftmax: return compute_safe_softmax(kernel->api, kernel->op, context);
    case Kind::kCrossEntropy: return compute_cross_entropy(kernel, context);
    case Kind::kCrossEntropyGrad: return compute_cross_entropy_grad(kernel, context);
  }
  return fail(kernel->api, "unknown operator");
}

// ---- the operator struct's functions -------------------------------------------------------------------------
const Operator* as_operator(const OrtCustomOp* op) { return static_cast<const Operator*>(op); }

void* create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {
  int64_t ignore_index = -100;  // torch's default, where the node has no attribute
  const Kind kind = as_operator(op)->kind;
  if (kind == Kind::kCrossEntropy || kind == Kind::kCrossEntropyGrad) {
    OrtStatus* status = slot<KernelInfoGetAttributeInt64>(api, kKernelInfoGetAttributeInt64)(info, "ignore_index",
                                                                                             &ignore_index);
    if (status != nullptr) slot<ReleaseStatus>(api, kReleaseStatus)(status);
  }
  return new Kernel{api, as_operator(op), ignore_index};
}
const char* name(const OrtCustomOp* op) { return as_operator(op)->name; }
const char* provider(const OrtCustomOp* op) { return as_operator(op)->cuda ? "CUDAExecutionProvider" : nullptr; }
ONNXTensorElementDataType input_type(const OrtCustomOp* op, size_t index) {
  return as_operator(op)->input_types[index];
}
ONNXTensorElementDataType output_type(const OrtCustomOp* op, size_t index) {
  return as_operator(op)->output_types[index];
}
size_t input_count(const OrtCustomOp* op) { return as_operator(op)->inputs; }
size_t output_count(const OrtCustomOp* op) { return as_operator(op)->outputs; }
void destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }
OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; }
OrtMemType device_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int variadic_min_arity(const OrtCustomOp*) { return 1; }
int variadic_homogeneous(const OrtCustomOp*) { return 1; }

Operator make_operator(const char* op_name, Kind kind, bool tanh_form, bool cuda, ElementType type,
                       ElementType gamma_type = ElementType::kFloat) {
  Operator op{};
  op.version = kOpVersion;
  op.CreateKernel = create_kernel;
  op.GetName = name;
  op.GetExecutionProviderType = provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = output_count;
  op.KernelCompute = nullptr;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = device_memory;
  op.GetVariadicInputMinArity = variadic_min_arity;
  op.GetVariadicInputHomogeneity = variadic_homogeneous;
  op.GetVariadicOutputMinArity = variadic_min_arity;
  op.GetVariadicOutputHomogeneity = variadic_homogeneous;
  op.CreateKernelV2 = nullptr;
  op.KernelComputeV2 = compute;
  op.name = op_name;
  op.kind = kind;
  // each input's and output's dtype: T the operator's, G LayerNormGrad's weights', float32 and int64 fixed
  const auto t = static_cast<ONNXTensorElementDataType>(type), g = static_cast<ONNXTensorElementDataType>(gamma_type);
  const auto f32 = ONNX_FLOAT, i64 = ONNX_INT64;
  const std::vector<ONNXTensorElementDataType> ins =
      kind == Kind::kLayerNormGrad      ? std::vector{t, t, t, t, g}
      : kind == Kind::kSafeSoftmax      ? std::vector{t}
      : kind == Kind::kCrossEntropy     ? std::vector{t, i64}
      : kind == Kind::kCrossEntropyGrad ? std::vector{f32, t, i64, f32}
                                        : std::vector{t, t};
  const std::vector<ONNXTensorElementDataType> outs =
      kind == Kind::kLayerNormGrad  ? std::vector{t, g, g, f32}
      : kind == Kind::kCrossEntropy ? std::vector{f32, f32}
                                    : std::vector{t};
  op.inputs = ins.size();
  op.outputs = outs.size();
  std::copy(ins.begin(), ins.end(), op.input_types);
  std::copy(outs.begin(), outs.end(), op.output_types);
  op.tanh_form = tanh_form;
  op.cuda = cuda;
  op.type = type;
  op.gamma_type = gamma_type;
  return op;
}

// every (operator, provider, dtype); ONNX Runtime keeps pointers to them for the process's life
const std::vector<Operator>& operators() {
  static const std::vector<Operator> all = [] {
    std::vector<Operator> ops;
#ifdef ORT_TRAINER_KERNELS_CUDA
    const bool providers[] = {false, true};
#else
    const bool providers[] = {false};
#endif
    for (bool cuda : providers)
    {
      for (ElementType type : {ElementType::kFloat, ElementType::kFloat16, ElementType::kBFloat16}) {
        ops.push_back(make_operator("GeluGrad", Kind::kGeluGrad, false, cuda, type));
        ops.push_back(make_operator("TanhGeluGrad", Kind::kGeluGrad, true, cuda, type));
        ops.push_back(make_operator("SoftmaxGrad", Kind::kSoftmaxGrad, false, cuda, type));
        ops.push_back(make_operator("SafeSoftmax", Kind::kSafeSoftmax, false, cuda, type));
        ops.push_back(make_operator("CrossEntropy", Kind::kCrossEntropy, false, cuda, type));
        ops.push_back(make_operator("CrossEntropyGrad", Kind::kCrossEntropyGrad, false, cuda, type));
      }
      // LayerNorm's tensors in one dtype, or a half-precision input with float32 weights (torch's layer norm of a
      // float16 activation under autocast: its mean and rstd in the input's dtype)
      for (ElementType type : {ElementType::kFloat, ElementType::kFloat16, ElementType::kBFloat16}) {
        ops.push_back(make_operator("LayerNormGrad", Kind::kLayerNormGrad, false, cuda, type, type));
        if (type != ElementType::kFloat)
          ops.push_back(make_operator("LayerNormGrad", Kind::kLayerNormGrad, false, cuda, type, ElementType::kFloat));
      }
    }
    return ops;
  }();
  return all;
}

}  // namespace
}  // namespace ort_trainer_kernels

// ONNX Runtime's entry point of a custom-operator library (SessionOptions.register_custom_ops_library)
ORTT_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  using namespace ort_abi;
  const OrtApi* api = base->GetApi(ort_trainer_kernels::kOpVersion);
  // a runtime older than 1.16: nothing registered (a session of a graph with these operators says they are missing)
  if (api == nullptr) return nullptr;
  OrtCustomOpDomain* domain = nullptr;
  ORTT_RETURN_IF_ERROR(slot<CreateCustomOpDomain>(api, kCreateCustomOpDomain)("ort_trainer", &domain));
  for (const auto& op : ort_trainer_kernels::operators())
    ORTT_RETURN_IF_ERROR(slot<CustomOpDomainAdd>(api, kCustomOpDomainAdd)(domain, &op));
  // the domain is left to the process (ONNX Runtime's sessions refer to it; one a registration)
  return slot<AddCustomOpDomain>(api, kAddCustomOpDomain)(options, domain);
}

// 1 where nvcc built the library (its operators have CUDA kernels), 0 otherwise (../__init__.py)
ORTT_EXPORT int OrtTrainerKernelsHaveCuda() {
#ifdef ORT_TRAINER_KERNELS_CUDA
  return 1;
#else
  return 0;
#endif
}
