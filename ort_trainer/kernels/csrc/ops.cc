// ort_trainer's custom operators for ONNX Runtime (domain "ort_trainer", ../__init__.py): each run's tensors, and
// the registration of the CPU kernels (cpu_kernels.h) and of the CUDA ones (*.cu, where nvcc built the library).
//
// Operators:
//   GeluGrad, TanhGeluGrad, CastsToFloat16, CastsToBFloat16, AliasAfter, SeededDropout: elementwise_ops.cc
//   LayerNorm's operators: layer_norm_ops.cc
//   SoftmaxGrad(dy, y) -> dx    a softmax's gradient over the last axis, dx = y * (dy - sum(dy * y)), from its
//                               output y; float32, float16 and bfloat16, computed in float32
//   SafeSoftmax(x) -> y         a softmax over the last axis whose rows of only -inf give zeros (torch's
//                               _safe_softmax, attention's); float32, float16 and bfloat16, computed in float32
//   BiasSafeSoftmax(x, bias) -> y
//                               SafeSoftmax(x + bias), x + bias rounded to the dtype as an Add node rounds it;
//                               bias broadcast to x (numpy's rules: of rank <= x's, each dim 1 or x's; attention's
//                               mask, [batch, 1, seq, seq] or [batch, 1, 1, seq])
//   CrossEntropy(x, target) -> (losses, lse)
//                               each row's cross-entropy of class scores x [rows, cols] (float32, float16 or
//                               bfloat16) against int64 targets, and its log-sum-exp, float32 [rows]: lse -
//                               x[target], 0 where target == the attribute ignore_index, NaN out of range. The
//                               attribute classes (default: cols): the scores are a row's first `classes` values
//                               (a product padded to aligned rows, graph/passes/aligned.py)
//   CrossEntropyGrad(grad, x, target, lse) -> dx
//                               dx = grad[row] * (softmax(x) - onehot(target)), zeros for an ignored row, in x's
//                               dtype, of x's shape; zeros past `classes`
//   AddHalf(sum, x, ...) -> y   y = sum + x + ... widened to float32 (sum and y float32, each x float16 or bfloat16,
//                               one dtype, holding at least sum's elements: its first ones are read, as a padded
//                               product's leading rows are), one float32 add an element and x, in order, as Casts
//                               then a chain of Adds compute it. sum may be of x's half dtype too (widened as
//                               well); the attribute rows (default: sum's first dim): y is [rows, sum's other dims],
//                               the first elements of sum and each x read (all may be padded products)
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "kernels.h"
#include "layer_norm.h"
#include "ops.h"

#define ORTT_EXPORT extern "C" __attribute__((visibility("default")))

namespace ort_trainer_kernels {
namespace {

constexpr uint32_t kOpVersion = 16;  // KernelComputeV2 (errors reach the session as a failed run)
#ifndef ORT_TRAINER_ALIAS_VERSION
#define ORT_TRAINER_ALIAS_VERSION 18
#endif
constexpr uint32_t kAliasVersion = ORT_TRAINER_ALIAS_VERSION;  // the alias and in-place maps (AliasAfter's)

// the scores a row of `cols` values holds (the attribute classes), or an error
OrtStatus* row_classes(const Kernel* kernel, const char* name, int64_t cols, int64_t* classes) {
  *classes = kernel->classes == 0 ? cols : kernel->classes;
  if (*classes < 0 || *classes > cols)
    return fail(kernel->api, std::string(name) + ": the attribute classes (" + std::to_string(kernel->classes) +
                                 ") must be in [1, " + std::to_string(cols) + "], x's row length");
  return nullptr;
}

OrtStatus* compute_softmax_grad(const OrtApi* api, const Operator* op, OrtKernelContext* context) {
  Tensor dy, y, dx;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &dy));
  ORTT_RETURN_IF_ERROR(input(api, context, 1, &y));
  if (dy.dims != y.dims || y.dims.empty()) return fail(api, "SoftmaxGrad: dy and y must have one shape, of rank >= 1");
  const int64_t cols = y.dims.back(), rows = cols > 0 ? y.size / cols : 0;
  ORTT_RETURN_IF_ERROR(output(api, context, 0, y.dims, &dx));
  if (op->cuda)
    return on_cuda_stream(api, context, "SoftmaxGrad", [&](void* stream) {
      return softmax_grad_cuda(op->type, dy.data, y.data, dx.data, rows, cols, stream);
    });
  dispatch(op->type, [&]<typename T>() { softmax_grad_cpu<T>(dy.data, y.data, dx.data, rows, cols); });
  return nullptr;
}

// how `bias` broadcasts over the rows of x (numpy's rules), or an error naming the shapes
OrtStatus* row_broadcast(const OrtApi* api, const Tensor& x, const Tensor& bias, RowBroadcast* broadcast) {
  const size_t rank = x.dims.size();
  auto shape = [](const std::vector<int64_t>& dims) {
    std::string text = "[";
    for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
    return text + "]";
  };
  if (bias.dims.size() > rank || rank - 1 > static_cast<size_t>(kMaxRowRank))
    return fail(api, "BiasSafeSoftmax: bias " + shape(bias.dims) + " does not broadcast to x " + shape(x.dims) +
                         " (of rank at most x's, and x of rank at most " + std::to_string(kMaxRowRank + 1) + ")");
  std::vector<int64_t> dims(rank - bias.dims.size(), 1);
  dims.insert(dims.end(), bias.dims.begin(), bias.dims.end());
  int64_t stride = 1;
  std::vector<int64_t> strides(rank);
  for (size_t i = rank; i-- > 0;) {
    if (dims[i] != 1 && dims[i] != x.dims[i])
      return fail(api, "BiasSafeSoftmax: bias " + shape(bias.dims) + " does not broadcast to x " + shape(x.dims));
    strides[i] = dims[i] == 1 ? 0 : stride;
    stride *= dims[i];
  }
  broadcast->rank = static_cast<int>(rank - 1);
  for (size_t i = 0; i + 1 < rank; ++i) {
    broadcast->dims[i] = x.dims[i];
    broadcast->strides[i] = strides[i];
  }
  broadcast->col_stride = strides[rank - 1];
  return nullptr;
}

OrtStatus* compute_safe_softmax(const OrtApi* api, const Operator* op, OrtKernelContext* context) {
  Tensor x, bias, y;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &x));
  if (x.dims.empty()) return fail(api, std::string(op->name) + ": x must have rank >= 1");
  RowBroadcast broadcast;
  if (op->kind == Kind::kBiasSafeSoftmax) {
    ORTT_RETURN_IF_ERROR(input(api, context, 1, &bias));
    ORTT_RETURN_IF_ERROR(row_broadcast(api, x, bias, &broadcast));
  }
  const int64_t cols = x.dims.back(), rows = cols > 0 ? x.size / cols : 0;
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &y));
  if (op->cuda)
    return on_cuda_stream(api, context, op->name, [&](void* stream) {
      return safe_softmax_cuda(op->type, x.data, bias.data, broadcast, y.data, rows, cols, stream);
    });
  dispatch(op->type, [&]<typename T>() { safe_softmax_cpu<T>(x.data, bias.data, broadcast, y.data, rows, cols); });
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
  int64_t classes = 0;
  ORTT_RETURN_IF_ERROR(row_classes(kernel, "CrossEntropy", cols, &classes));
  Tensor losses, lse;
  ORTT_RETURN_IF_ERROR(output(api, context, 0, {rows}, &losses));
  ORTT_RETURN_IF_ERROR(output(api, context, 1, {rows}, &lse));
  const int64_t* t = static_cast<const int64_t*>(target.data);
  float *l = static_cast<float*>(losses.data), *e = static_cast<float*>(lse.data);
  if (op->cuda)
    return on_cuda_stream(api, context, "CrossEntropy", [&](void* stream) {
      return cross_entropy_cuda(op->type, x.data, t, l, e, rows, cols, classes, kernel->ignore_index, stream);
    });
  dispatch(op->type,
           [&]<typename T>() { cross_entropy_cpu<T>(x.data, t, l, e, rows, cols, classes, kernel->ignore_index); });
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
  int64_t classes = 0;
  ORTT_RETURN_IF_ERROR(row_classes(kernel, "CrossEntropyGrad", cols, &classes));
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &dx));
  const float *g = static_cast<const float*>(grad.data), *e = static_cast<const float*>(lse.data);
  const int64_t* t = static_cast<const int64_t*>(target.data);
  if (op->cuda)
    return on_cuda_stream(api, context, "CrossEntropyGrad", [&](void* stream) {
      return cross_entropy_grad_cuda(op->type, g, x.data, t, e, dx.data, rows, cols, classes, kernel->ignore_index,
                                     stream);
    });
  dispatch(op->type, [&]<typename T>() {
    cross_entropy_grad_cpu<T>(g, x.data, t, e, dx.data, rows, cols, classes, kernel->ignore_index);
  });
  return nullptr;
}

OrtStatus* compute_add_half(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  const Operator* op = kernel->op;
  size_t count = 0;
  ORTT_RETURN_IF_ERROR(input_count(api, context, &count));
  Tensor sum, y;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &sum));
  std::vector<Tensor> xs(count > 1 ? count - 1 : 0);
  std::vector<const void*> data;
  int64_t smallest = sum.size;  // the fewest elements an input holds
  for (size_t i = 0; i < xs.size(); ++i) {
    ORTT_RETURN_IF_ERROR(input(api, context, i + 1, &xs[i]));
    data.push_back(xs[i].data);
    smallest = std::min(smallest, xs[i].size);
  }
  std::vector<int64_t> dims = sum.dims;
  if (kernel->rows != 0 && !dims.empty()) dims[0] = kernel->rows;
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  if (kernel->rows < 0 || xs.empty() || smallest < n || sum.size < n)
    return fail(api, "AddHalf: y has " + std::to_string(n) + " elements (rows " +
                         std::to_string(dims.empty() ? 1 : dims[0]) + "), more than sum's " + std::to_string(sum.size) +
                         " or an x's " + std::to_string(xs.empty() ? 0 : smallest));
  ORTT_RETURN_IF_ERROR(output(api, context, 0, dims, &y));
  float* out = static_cast<float*>(y.data);
  if (op->cuda)
    return on_cuda_stream(api, context, "AddHalf", [&](void* stream) {
      return add_half_cuda(op->type, op->gamma_type, sum.data, data.data(), static_cast<int>(data.size()), out, n,
                           stream);
    });
  dispatch(op->type, [&]<typename T>() {
    dispatch(op->gamma_type,
             [&]<typename U>() { add_half_cpu<U, T>(sum.data, data.data(), static_cast<int>(data.size()), out, n); });
  });
  return nullptr;
}

OrtStatus* compute(void* opaque, OrtKernelContext* context) {
  const Kernel* kernel = static_cast<const Kernel*>(opaque);
  switch (kernel->op->kind) {
    case Kind::kGeluGrad: return compute_gelu_grad(kernel->api, kernel->op, context);
    case Kind::kSeededDropout: return compute_seeded_dropout(kernel, context);
    case Kind::kLayerNormGrad:
    case Kind::kLayerNormGradAdd:
    case Kind::kLayerNormGradAddCast:
    case Kind::kLayerNormGradCast: return compute_layer_norm_grad(kernel->api, kernel->op, context);
    case Kind::kSoftmaxGrad: return compute_softmax_grad(kernel->api, kernel->op, context);
    case Kind::kSafeSoftmax:
    case Kind::kBiasSafeSoftmax: return compute_safe_softmax(kernel->api, kernel->op, context);
    case Kind::kCrossEntropy: return compute_cross_entropy(kernel, context);
    case Kind::kCrossEntropyGrad: return compute_cross_entropy_grad(kernel, context);
    case Kind::kAddHalf: return compute_add_half(kernel, context);
    case Kind::kHalfCopies: return compute_half_copies(kernel, context);
    case Kind::kAliasAfter: return compute_alias_after(kernel, context);
    case Kind::kLayerNormCast:
    case Kind::kLayerNormWithCast:
    case Kind::kAddLayerNormCast:
    case Kind::kAddLayerNormWithCast: return compute_layer_norm_cast(kernel, context);
  }
  return fail(kernel->api, "unknown operator");
}

// ---- the operator struct's functions -------------------------------------------------------------------------
const Operator* as_operator(const OrtCustomOp* op) { return static_cast<const Operator*>(op); }

void* create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {
  // torch's default, every value, sum's rows, where the node has no attribute
  int64_t ignore_index = -100, classes = 0, rows = 0;
  const Kind kind = as_operator(op)->kind;
  std::vector<std::pair<const char*, int64_t*>> attributes;
  if (kind == Kind::kCrossEntropy || kind == Kind::kCrossEntropyGrad)
    attributes = {{"ignore_index", &ignore_index}, {"classes", &classes}};
  if (kind == Kind::kAddHalf) attributes = {{"rows", &rows}};
  int64_t stream = 0;
  if (kind == Kind::kSeededDropout) attributes = {{"stream", &stream}};
  for (auto [name, value] : attributes) {
    OrtStatus* status = slot<KernelInfoGetAttributeInt64>(api, kKernelInfoGetAttributeInt64)(info, name, value);
    if (status != nullptr) slot<ReleaseStatus>(api, kReleaseStatus)(status);
  }
  // a float attribute into `value`, which keeps its default where the node has none
  const auto read_float = [&](const char* name, float* value) {
    OrtStatus* status = slot<KernelInfoGetAttributeFloat>(api, kKernelInfoGetAttributeFloat)(info, name, value);
    if (status != nullptr) slot<ReleaseStatus>(api, kReleaseStatus)(status);
  };
  float epsilon = 1e-5f, ratio = 0.5f;  // ONNX's defaults
  if (is_layer_norm_forward(kind)) read_float("epsilon", &epsilon);
  if (kind == Kind::kSeededDropout) read_float("ratio", &ratio);
  std::vector<int64_t> output_rows;
  if (kind == Kind::kHalfCopies) {
    const auto get = slot<KernelInfoGetAttributeArrayInt64>(api, kKernelInfoGetAttributeArrayInt64);
    size_t size = 0;
    OrtStatus* status = get(info, "output_rows", nullptr, &size);  // (an error: the node has none)
    if (status == nullptr) {
      output_rows.resize(size);
      status = get(info, "output_rows", output_rows.data(), &size);
    }
    if (status != nullptr) {
      slot<ReleaseStatus>(api, kReleaseStatus)(status);
      output_rows.clear();
    }
  }
  // kept where a draw is below round((1 - ratio) 2^32): a keep probability within 2^-33 of 1 - ratio
  const double keep = std::min(std::max(1.0 - static_cast<double>(ratio), 0.0), 1.0) * 4294967296.0;
  const auto threshold = static_cast<uint32_t>(std::min<long long>(std::llround(keep), 0xffffffffLL));
  return new Kernel{api, as_operator(op), ignore_index, classes, rows, epsilon, std::move(output_rows), ratio, stream,
                    threshold, 1.0f / (1.0f - ratio)};
}
void destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }

// AliasAfter's maps (struct version 18): y (output 0) is x (input 0); may be in place likewise
size_t first_is_first(int** input_index, int** output_index) {
  *input_index = new int[1]{0};
  *output_index = new int[1]{0};
  return 1;
}
void release_indices(int* input_index, int* output_index) {
  delete[] input_index;
  delete[] output_index;
}
int first_opset(const OrtCustomOp*) { return 1; }
int last_opset(const OrtCustomOp*) { return 0x7fffffff; }

// (alias_version: AliasAfter's struct version, 0: kOpVersion's, which has no alias map)
Operator make_operator(const char* op_name, Kind kind, bool tanh_form, bool cuda, ElementType type,
                       ElementType gamma_type = ElementType::kFloat, uint32_t alias_version = 0) {
  Operator op{};
  // each input's and output's dtype: T the operator's, G LayerNormGrad's weights', float32 and int64 fixed
  // (LayerNormGradAdd: T is dy's and the cast's, LayerNormGradTo*: the cast's; every other tensor float32)
  const auto t = static_cast<ONNXTensorElementDataType>(type), g = static_cast<ONNXTensorElementDataType>(gamma_type);
  const auto f32 = ONNX_FLOAT, i64 = ONNX_INT64;
  const bool add = kind == Kind::kLayerNormGradAdd || kind == Kind::kLayerNormGradAddCast;
  const bool casts = kind == Kind::kLayerNormGradAddCast || kind == Kind::kLayerNormGradCast;
  const std::vector<ONNXTensorElementDataType> ins =
      kind == Kind::kLayerNormGrad       ? std::vector{t, t, t, t, g}
      : add                              ? std::vector{t, f32, f32, f32, f32, f32}
      : kind == Kind::kLayerNormGradCast ? std::vector{f32, f32, f32, f32, f32}
      : adds_residual(kind)              ? std::vector{f32, t, f32, f32}
      : is_layer_norm_forward(kind)      ? std::vector{f32, f32, f32}
      : kind == Kind::kSafeSoftmax      ? std::vector{t}
      : kind == Kind::kBiasSafeSoftmax  ? std::vector{t, t}
      : kind == Kind::kCrossEntropy     ? std::vector{t, i64}
      : kind == Kind::kCrossEntropyGrad ? std::vector{f32, t, i64, f32}
      : kind == Kind::kAddHalf          ? std::vector{g, t}
      : kind == Kind::kHalfCopies       ? std::vector{f32}
      : kind == Kind::kAliasAfter       ? std::vector{t, ONNX_UNDEFINED}
      : kind == Kind::kSeededDropout    ? std::vector{t, i64}
                                        : std::vector{t, t};
  const std::vector<ONNXTensorElementDataType> outs =
      kind == Kind::kLayerNormGrad      ? std::vector{t, g, g, f32}
      : casts                           ? std::vector{f32, f32, f32, f32, t}
      : add                             ? std::vector{f32, f32, f32, f32}
      : kind == Kind::kLayerNormCast    ? std::vector{t, f32, f32}
      : kind == Kind::kLayerNormWithCast ? std::vector{f32, f32, f32, t}
      : kind == Kind::kAddLayerNormCast ? std::vector{t, f32, f32, f32}
      : kind == Kind::kAddLayerNormWithCast ? std::vector{f32, f32, f32, t, f32}
      : kind == Kind::kCrossEntropy ? std::vector{f32, f32}
      : kind == Kind::kAddHalf      ? std::vector{f32}
      : kind == Kind::kSeededDropout ? std::vector{t, ONNX_BOOL}
                                    : std::vector{t};
  set_entry(&op, kOpVersion, op_name, cuda, ins, outs, create_kernel, destroy_kernel, compute);
  if (kind == Kind::kAliasAfter && alias_version != 0) {
    op.version = alias_version;
    op.InferOutputShapeFn = nullptr;
    op.GetStartVersion = first_opset;
    op.GetEndVersion = last_opset;
    op.GetMayInplace = first_is_first;
    op.ReleaseMayInplace = release_indices;
    op.GetAliasMap = first_is_first;
    op.ReleaseAliasMap = release_indices;
  }
  op.variadic = kind == Kind::kAddHalf || kind == Kind::kHalfCopies;  // x, ...
  op.variadic_output = kind == Kind::kHalfCopies;                     // y, ...
  op.kind = kind;
  op.tanh_form = tanh_form;
  op.type = type;
  op.gamma_type = gamma_type;
  return op;
}

// every (operator, provider, dtype); ONNX Runtime keeps pointers to them for the process's life (alias_version:
// AliasAfter's, runtime_alias_version's for the process's runtime)
const std::vector<Operator>& operators(uint32_t alias_version) {
  static const std::vector<Operator> all = [alias_version] {
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
        ops.push_back(make_operator("BiasSafeSoftmax", Kind::kBiasSafeSoftmax, false, cuda, type));
        ops.push_back(make_operator("CrossEntropy", Kind::kCrossEntropy, false, cuda, type));
        ops.push_back(make_operator("CrossEntropyGrad", Kind::kCrossEntropyGrad, false, cuda, type));
        ops.push_back(make_operator("AliasAfter", Kind::kAliasAfter, false, cuda, type, type, alias_version));
        ops.push_back(make_operator("SeededDropout", Kind::kSeededDropout, false, cuda, type));
        if (type != ElementType::kFloat) {  // (a float32 sum, or one of x's dtype: G is the sum's)
          ops.push_back(make_operator("AddHalf", Kind::kAddHalf, false, cuda, type, ElementType::kFloat));
          ops.push_back(make_operator("AddHalf", Kind::kAddHalf, false, cuda, type, type));
          ops.push_back(make_operator(type == ElementType::kFloat16 ? "CastsToFloat16" : "CastsToBFloat16",
                                      Kind::kHalfCopies, false, cuda, type));
        }
      }
      // LayerNorm's tensors in one dtype, or a half-precision input with float32 weights (torch's layer norm of a
      // float16 activation under autocast: its mean and rstd in the input's dtype)
      for (ElementType type : {ElementType::kFloat, ElementType::kFloat16, ElementType::kBFloat16}) {
        ops.push_back(make_operator("LayerNormGrad", Kind::kLayerNormGrad, false, cuda, type, type));
        if (type != ElementType::kFloat)
          ops.push_back(make_operator("LayerNormGrad", Kind::kLayerNormGrad, false, cuda, type, ElementType::kFloat));
        // float32 LayerNorms whose gradient goes on into a float32 residual sum, dy of any dtype
        ops.push_back(make_operator("LayerNormGradAdd", Kind::kLayerNormGradAdd, false, cuda, type));
        if (type != ElementType::kFloat) {
          ops.push_back(make_operator("LayerNormGradAddCast", Kind::kLayerNormGradAddCast, false, cuda, type));
          const bool f16 = type == ElementType::kFloat16;
          ops.push_back(make_operator(f16 ? "LayerNormGradToFloat16" : "LayerNormGradToBFloat16",
                                      Kind::kLayerNormGradCast, false, cuda, type));
          ops.push_back(make_operator(f16 ? "LayerNormToFloat16" : "LayerNormToBFloat16", Kind::kLayerNormCast, false,
                                      cuda, type));
          ops.push_back(make_operator(f16 ? "LayerNormWithFloat16" : "LayerNormWithBFloat16", Kind::kLayerNormWithCast,
                                      false, cuda, type));
          ops.push_back(make_operator(f16 ? "AddLayerNormToFloat16" : "AddLayerNormToBFloat16", Kind::kAddLayerNormCast,
                                      false, cuda, type));
          ops.push_back(make_operator(f16 ? "AddLayerNormWithFloat16" : "AddLayerNormWithBFloat16",
                                      Kind::kAddLayerNormWithCast, false, cuda, type));
        }
      }
    }
    return ops;
  }();
  return all;
}

// AliasAfter's struct version for the runtime of `base`: kAliasVersion (its alias map read) where the runtime's C API
// (the minor number of its release: 1.19 -> 19) has it, else 0 (kOpVersion's: y a copy)
uint32_t runtime_alias_version(const OrtApiBase* base) {
  unsigned major = 0, minor = 0;
  const bool known = std::sscanf(base->GetVersionString(), "%u.%u", &major, &minor) == 2 && major == 1;
  return known && minor >= kAliasVersion ? kAliasVersion : 0;
}

}  // namespace
}  // namespace ort_trainer_kernels

// ONNX Runtime's entry point of a custom-operator library (SessionOptions.register_custom_ops_library)
ORTT_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  using namespace ort_trainer_kernels;
  return register_operators(options, base, kOpVersion, "ort_trainer", operators(runtime_alias_version(base)));
}

// 1 where nvcc built the library (its operators have CUDA kernels), 0 otherwise (../__init__.py)
ORTT_EXPORT int OrtTrainerKernelsHaveCuda() {
#ifdef ORT_TRAINER_KERNELS_CUDA
  return 1;
#else
  return 0;
#endif
}
