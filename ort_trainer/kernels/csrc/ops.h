// What ops.cc (the operators' table and some of their runs), layer_norm_ops.cc (LayerNorm's operators) and
// elementwise_ops.cc (those that go over their elements one at a time) share:
// each operator's entry, a kernel's attributes, and the launch of a CUDA kernel on the session's stream.
#pragma once

#include <stdint.h>

#include <string>
#include <vector>

#include "kernels.h"
#include "ort_abi.h"
#include "ort_io.h"

namespace ort_trainer_kernels {

using namespace ort_abi;

enum class Kind {
  kGeluGrad,
  kLayerNormGrad,
  kLayerNormGradAdd,
  kLayerNormGradAddCast,
  kLayerNormGradCast,
  kLayerNormCast,
  kLayerNormWithCast,
  kAddLayerNormCast,
  kAddLayerNormWithCast,
  kSoftmaxGrad,
  kSafeSoftmax,
  kBiasSafeSoftmax,
  kCrossEntropy,
  kCrossEntropyGrad,
  kAddHalf,
  kHalfCopies,
  kAliasAfter,
  kSeededDropout
};

struct Operator : OperatorEntry {
  Kind kind;
  bool tanh_form;
  ElementType type;        // of every input and output but LayerNormGrad's gamma, dgamma, dbeta and partials (the
                           // LayerNorm operators of float32 LayerNorms: dy's or the cast's, layer_norm_ops.cc)
  ElementType gamma_type;  // LayerNormGrad's gamma, dgamma and dbeta; AddHalf's sum
};

struct Kernel {
  const OrtApi* api;
  const Operator* op;
  int64_t ignore_index;  // CrossEntropy and CrossEntropyGrad's attributes
  int64_t classes;       // 0: a row's every value
  int64_t rows;          // AddHalf's attribute: 0, sum's
  float epsilon;         // LayerNormTo* and LayerNormWith*'s
  std::vector<int64_t> output_rows;  // CastsTo*'s attribute: each y's first dim (0 or none: x's own)
  float ratio = 0.0f;       // SeededDropout's attributes: the drop probability,
  int64_t stream = 0;       // the node's number (philox.h)
  uint32_t threshold = 0;   // and from the ratio: an element is kept where its draw is below threshold,
  float scale = 1.0f;       // its value scaled by 1 / (1 - ratio) (float32, as ONNX Runtime's Dropout computes it)
};

// runs launch(stream) (a CUDA launcher of kernels.h) on the session's CUDA stream: nullptr, or its error as the
// run's. Operators with CUDA kernels exist only where nvcc built the library: elsewhere launch is never called
// (nor compiled into the library).
template <typename Launch>
OrtStatus* on_cuda_stream(const OrtApi* api, OrtKernelContext* context, const char* name, Launch&& launch) {
#ifdef ORT_TRAINER_KERNELS_CUDA
  void* stream = nullptr;
  ORTT_RETURN_IF_ERROR(
      slot<KernelContextGetGPUComputeStream>(api, kKernelContextGetGPUComputeStream)(context, &stream));
  const char* error = launch(stream);
  return error == nullptr ? nullptr : fail(api, std::string(name) + " on CUDA: " + error);
#else
  (void)context;
  (void)launch;
  return fail(api, std::string(name) + ": this library was built without CUDA kernels");
#endif
}

// AddLayerNormTo* and AddLayerNormWith*: the forward of a LayerNorm of a residual sum, which it computes
inline bool adds_residual(Kind kind) { return kind == Kind::kAddLayerNormCast || kind == Kind::kAddLayerNormWithCast; }

// LayerNormTo*, LayerNormWith* and their Add* forms: a float32 LayerNorm's forward (attribute epsilon)
inline bool is_layer_norm_forward(Kind kind) {
  return kind == Kind::kLayerNormCast || kind == Kind::kLayerNormWithCast || adds_residual(kind);
}

// LayerNormWith* and AddLayerNormWith*: y written in float32 and the half dtype both
inline bool writes_both(Kind kind) { return kind == Kind::kLayerNormWithCast || kind == Kind::kAddLayerNormWithCast; }

// the element-wise operators' runs (elementwise_ops.cc)
OrtStatus* compute_gelu_grad(const OrtApi* api, const Operator* op, OrtKernelContext* context);
OrtStatus* compute_half_copies(const Kernel* kernel, OrtKernelContext* context);
OrtStatus* compute_alias_after(const Kernel* kernel, OrtKernelContext* context);
OrtStatus* compute_seeded_dropout(const Kernel* kernel, OrtKernelContext* context);

// LayerNorm's operators' runs (layer_norm_ops.cc)
OrtStatus* compute_layer_norm_grad(const OrtApi* api, const Operator* op, OrtKernelContext* context);
OrtStatus* compute_layer_norm_cast(const Kernel* kernel, OrtKernelContext* context);

}  // namespace ort_trainer_kernels
