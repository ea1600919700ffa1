// The runs of ort_trainer's operators that go over their tensors an element at a time (ops.cc registers them; the
// CPU kernels: cpu_kernels.h, the CUDA ones: gelu.cu, half_copies.cu, dropout.cu).
//
// Operators:
//   GeluGrad(dy, x) -> dx       dx = dy * GELU'(x), GELU(x) = x * Phi(x); float32, float16 and bfloat16, dy, x and
//                               dx of one shape and dtype
//   TanhGeluGrad(dy, x) -> dx   the same for GELU's tanh approximation (gelu.h)
//   CastsToFloat16(x, ...) -> (y, ...), CastsToBFloat16(x, ...) -> (y, ...)
//                               each float32 x rounded to float16 (bfloat16), as a Cast to it rounds; the
//                               attribute output_rows (ints, one a y; 0 or none: x's own): y's first dim, at least x's,
//                               the rows past x's zeros (a padded product's weight). One node for a step's weights:
//                               one CUDA launch for up to 64 of them
//   AliasAfter(x, after) -> y   y is x, computed once `after` (any dtype; read by no one) is: the wait of a
//                               recompute's copies for the backward (graph/passes/recompute.py) kept on the device.
//                               y is x's own buffer where ONNX Runtime honors the operator's alias map (its struct
//                               version 18, a runtime of API 18 or later), else a copy of x
//   SeededDropout(x, seed) -> (y, mask)
//                               ONNX's training-mode Dropout with the drop probability the attribute ratio (in
//                               [0, 1)): y = x * 1 / (1 - ratio) where an element is kept, x * 0 elsewhere; mask
//                               (bool) the kept elements. Whether element i is kept is a function of the int64 seed
//                               (one value, read where the node runs: device memory on a GPU, so a captured CUDA graph
//                               draws anew once the seed's buffer is rewritten), the attribute stream (the node's
//                               number: each node its own draws) and i alone (philox.h): the same on the host and a
//                               GPU. x float32, float16 or bfloat16 (graph/passes/dropout.py's seeded_dropout)
#include <stdint.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "kernels.h"
#include "ops.h"

namespace ort_trainer_kernels {

OrtStatus* compute_gelu_grad(const OrtApi* api, const Operator* op, OrtKernelContext* context) {
  Tensor dy, x, dx;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &dy));
  ORTT_RETURN_IF_ERROR(input(api, context, 1, &x));
  if (dy.dims != x.dims) return fail(api, std::string(op->name) + ": dy and x must have one shape");
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &dx));
  if (op->cuda)
    return on_cuda_stream(api, context, op->name, [&](void* stream) {
      return gelu_grad_cuda(op->type, op->tanh_form, dy.data, x.data, dx.data, x.size, stream);
    });
  dispatch(op->type, [&]<typename T>() {
    if (op->tanh_form)
      gelu_grad_cpu<T, true>(dy.data, x.data, dx.data, x.size);
    else
      gelu_grad_cpu<T, false>(dy.data, x.data, dx.data, x.size);
  });
  return nullptr;
}

OrtStatus* compute_half_copies(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  const std::string name = kernel->op->name;
  size_t count = 0;
  ORTT_RETURN_IF_ERROR(input_count(api, context, &count));
  if (!kernel->output_rows.empty() && kernel->output_rows.size() != count)
    return fail(api, name + ": output_rows has " + std::to_string(kernel->output_rows.size()) + " values for " +
                         std::to_string(count) + " tensors");
  std::vector<HalfCopy> copies(count);
  for (size_t i = 0; i < count; ++i) {
    Tensor x, y;
    ORTT_RETURN_IF_ERROR(input(api, context, i, &x));
    std::vector<int64_t> dims = x.dims;
    if (!kernel->output_rows.empty()) {
      const int64_t rows = kernel->output_rows[i];  // (0: x's own)
      if (rows != 0 && (dims.empty() || rows < dims[0]))
        return fail(api, name + ": output_rows[" + std::to_string(i) + "] (" + std::to_string(rows) +
                             ") must be at least x's first dim (" + std::to_string(dims.empty() ? 0 : dims[0]) + ")");
      if (rows != 0) dims[0] = rows;
    }
    ORTT_RETURN_IF_ERROR(output(api, context, i, dims, &y));
    copies[i] = HalfCopy{static_cast<const float*>(x.data), y.data, x.size, y.size};
  }
  if (kernel->op->cuda)
    return on_cuda_stream(api, context, kernel->op->name, [&](void* stream) {
      return half_copies_cuda(kernel->op->type, copies.data(), static_cast<int>(count), stream);
    });
  dispatch(kernel->op->type, [&]<typename T>() { half_copies_cpu<T>(copies.data(), static_cast<int>(count)); });
  return nullptr;
}

OrtStatus* compute_alias_after(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  Tensor x, y;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &x));
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &y));
  if (y.data == x.data || x.size == 0) return nullptr;  // (the alias: nothing to write)
  const int64_t bytes = x.size * (kernel->op->type == ElementType::kFloat ? 4 : 2);
  if (kernel->op->cuda)
    return on_cuda_stream(api, context, "AliasAfter",
                          [&](void* stream) { return device_copy_cuda(x.data, y.data, bytes, stream); });
  std::copy_n(static_cast<const char*>(x.data), bytes, static_cast<char*>(y.data));
  return nullptr;
}

OrtStatus* compute_seeded_dropout(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  const Operator* op = kernel->op;
  if (!(kernel->ratio >= 0.0f && kernel->ratio < 1.0f))
    return fail(api, "SeededDropout: the attribute ratio (" + std::to_string(kernel->ratio) + ") must be in [0, 1)");
  Tensor x, seed, y, mask;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &x));
  ORTT_RETURN_IF_ERROR(input(api, context, 1, &seed));
  if (seed.size != 1)
    return fail(api, "SeededDropout: seed must hold one int64 value, not " + std::to_string(seed.size));
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &y));
  ORTT_RETURN_IF_ERROR(output(api, context, 1, x.dims, &mask));
  bool* kept = static_cast<bool*>(mask.data);
  const int64_t* key = static_cast<const int64_t*>(seed.data);
  const uint32_t stream = static_cast<uint32_t>(kernel->stream);
  if (op->cuda)
    return on_cuda_stream(api, context, "SeededDropout", [&](void* s) {
      return seeded_dropout_cuda(op->type, x.data, y.data, kept, x.size, key, stream, kernel->threshold, kernel->scale,
                                 s);
    });
  dispatch(op->type, [&]<typename T>() {
    seeded_dropout_cpu<T>(x.data, y.data, kept, x.size, static_cast<uint64_t>(*key), stream, kernel->threshold,
                          kernel->scale);
  });
  return nullptr;
}

}  // namespace ort_trainer_kernels
