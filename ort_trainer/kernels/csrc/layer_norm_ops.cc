// The runs of ort_trainer's LayerNorm operators (ops.cc registers them; the CPU kernels: cpu_kernels.h, the CUDA
// ones: layer_norm.cu).
//
// Operators:
//   LayerNormGrad(dy, x, mean, rstd, gamma) -> (dx, dgamma, dbeta, partials)
//                               LayerNorm's backward over the last dims (as many values a row as gamma has),
//                               from the forward's mean and rstd (one a row); float32. partials: the column sums
//                               of each chunk of rows, [chunks, 2, cols] (the CUDA kernel's deterministic
//                               reduction; one chunk on the CPU), read by no other node (layer_norm.h)
//   LayerNormGradAdd(dy, x, mean, rstd, gamma, residual) -> (sum, dgamma, dbeta, partials)
//   LayerNormGradAddCast(dy, x, mean, rstd, gamma, residual) -> (sum, dgamma, dbeta, partials, sum_cast)
//                               the same with the gradient added to the residual (float32, x's shape) in the
//                               kernel, one rounded float32 add as an Add node of the two computes it; dy float32,
//                               float16 or bfloat16 of x's element count (a half gradient read as it is: no float32
//                               copy); sum_cast: the sum rounded to dy's dtype (what the products that read the
//                               sum take under mixed precision). x, mean, rstd, gamma and the sums float32
//                               (graph/passes/layer_norm_sums.py)
//   LayerNormGradToFloat16(dy, x, mean, rstd, gamma) -> (dx, dgamma, dbeta, partials, dx_cast)
//   LayerNormGradToBFloat16(...)  LayerNormGrad of float32 tensors with dx rounded to float16 (bfloat16) as well (a
//                               post-norm LayerNorm's gradient, which the sublayer's half products read); one name
//                               a dtype, as the inputs' dtypes do not tell the two apart
//   LayerNormToFloat16(x, gamma, beta) -> (y, mean, rstd)
//   LayerNormToBFloat16(...)    LayerNormalization over the last dims (as many values a row as gamma has) of float32
//                               x, gamma and beta, y written in the half dtype alone (what the products after it
//                               read under mixed precision), mean and rstd float32 one a row, as ONNX's Mean and
//                               InvStdDev; the attribute epsilon (default 1e-5)
//   LayerNormWithFloat16(x, gamma, beta) -> (y, mean, rstd, y_half)
//   LayerNormWithBFloat16(...)  the same with y written in float32 as well, first (a post-norm LayerNorm's output,
//                               which the residual stream reads in float32 and the products in half); y_half is
//                               y's rounding, as a Cast of it
//   AddLayerNormToFloat16(residual, x, gamma, beta) -> (y, mean, rstd, sum)
//   AddLayerNormWithFloat16(residual, x, gamma, beta) -> (y, mean, rstd, y_half, sum)
//   AddLayerNormToBFloat16(...), AddLayerNormWithBFloat16(...)
//                               the LayerNorm of sum = residual + x (residual float32, x of the half dtype, one
//                               rounded float32 add an element as an Add of residual and x's Cast computes it:
//                               the residual stream's sum, which other nodes read too), sum written as well
//                               (graph/passes/layer_norm_forward.py)
#include <stdint.h>

#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "kernels.h"
#include "layer_norm.h"
#include "ops.h"

namespace ort_trainer_kernels {

OrtStatus* compute_layer_norm_grad(const OrtApi* api, const Operator* op, OrtKernelContext* context) {
  const Kind kind = op->kind;
  const bool adds = kind == Kind::kLayerNormGradAdd || kind == Kind::kLayerNormGradAddCast;
  const bool casts = kind == Kind::kLayerNormGradAddCast || kind == Kind::kLayerNormGradCast;
  // the dtypes (t: x's, g: gamma's, d: dy's, c: the cast's): LayerNormGrad's own; the others' LayerNorm is float32,
  // their registered type dy's (LayerNormGradAdd*) and the cast's
  const ElementType f32 = ElementType::kFloat, t = kind == Kind::kLayerNormGrad ? op->type : f32;
  const ElementType g = kind == Kind::kLayerNormGrad ? op->gamma_type : f32, d = adds ? op->type : t;
  const ElementType c = casts ? op->type : d;
  Tensor dy, x, mean, rstd, gamma, residual;
  Tensor* inputs[] = {&dy, &x, &mean, &rstd, &gamma, &residual};
  for (size_t i = 0; i < (adds ? 6 : 5); ++i) ORTT_RETURN_IF_ERROR(input(api, context, i, inputs[i]));
  const int64_t cols = gamma.size, rows = cols > 0 ? x.size / cols : 0;
  // (LayerNormGradAdd reads dy by its elements: a product's [rows, cols] for x's [batch, seq, cols])
  if ((adds ? dy.size != x.size || residual.dims != x.dims : dy.dims != x.dims) || cols == 0 || rows * cols != x.size ||
      mean.size != rows || rstd.size != rows)
    return fail(api, std::string(op->name) + ": dy and x must have one shape (LayerNormGradAdd: dy x's element count, "
                                             "the residual x's shape), a multiple of gamma's size, and mean and rstd "
                                             "one value for each row of gamma's size");
  const int64_t chunks = op->cuda ? layer_norm_chunks(rows) : 1;
  Tensor dx, dgamma, dbeta, partials, cast;
  ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &dx));
  ORTT_RETURN_IF_ERROR(output(api, context, 1, gamma.dims, &dgamma));
  ORTT_RETURN_IF_ERROR(output(api, context, 2, gamma.dims, &dbeta));
  ORTT_RETURN_IF_ERROR(output(api, context, 3, {chunks, 2, cols}, &partials));
  if (casts) ORTT_RETURN_IF_ERROR(output(api, context, 4, x.dims, &cast));
  float* sums = static_cast<float*>(partials.data);
  if (op->cuda)
    return on_cuda_stream(api, context, op->name, [&](void* stream) {
      return layer_norm_grad_cuda(t, d, c, g, dy.data, x.data, mean.data, rstd.data, gamma.data,
                                  residual.data, dx.data, cast.data, dgamma.data, dbeta.data, sums, rows, cols, chunks,
                                  stream);
    });
  dispatch(t, [&]<typename T>() {
    dispatch(g, [&]<typename G>() {
      dispatch(d, [&]<typename D>() {
        dispatch(c, [&]<typename C>() {
          layer_norm_grad_cpu<T, G, D, C>(dy.data, x.data, mean.data, rstd.data, gamma.data, residual.data, dx.data,
                                          cast.data, dgamma.data, dbeta.data, sums, rows, cols);
        });
      });
    });
  });
  return nullptr;
}

OrtStatus* compute_layer_norm_cast(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  const Operator* op = kernel->op;
  const bool both = writes_both(op->kind);        // (y32 first, the half y after the statistics)
  const size_t add = adds_residual(op->kind) ? 1 : 0;  // (the residual first, then x: the inputs one further on)
  Tensor x, branch, gamma, beta, y, y32, mean, rstd, sum;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &x));
  if (add) ORTT_RETURN_IF_ERROR(input(api, context, 1, &branch));
  ORTT_RETURN_IF_ERROR(input(api, context, 1 + add, &gamma));
  ORTT_RETURN_IF_ERROR(input(api, context, 2 + add, &beta));
  const int64_t cols = gamma.size, rows = cols > 0 ? x.size / cols : 0;
  if (cols == 0 || rows * cols != x.size || beta.size != cols)
    return fail(api, std::string(op->name) + ": x must be rows of gamma's size, and beta of gamma's size");
  if (add && branch.dims != x.dims) return fail(api, std::string(op->name) + ": residual and x must have one shape");
  // the statistics as ONNX's: x's dims with 1 for each normalized one
  std::vector<int64_t> stats = x.dims;
  for (int64_t i = static_cast<int64_t>(stats.size()) - 1, n = 1; i >= 0 && n < cols; --i) n *= stats[i], stats[i] = 1;
  ORTT_RETURN_IF_ERROR(output(api, context, both ? 3 : 0, x.dims, &y));
  if (both) ORTT_RETURN_IF_ERROR(output(api, context, 0, x.dims, &y32));
  ORTT_RETURN_IF_ERROR(output(api, context, 1, stats, &mean));
  ORTT_RETURN_IF_ERROR(output(api, context, 2, stats, &rstd));
  if (add) ORTT_RETURN_IF_ERROR(output(api, context, both ? 4 : 3, x.dims, &sum));
  float* ys = static_cast<float*>(y32.data);  // (null for LayerNormTo*)
  const float *xs = static_cast<const float*>(x.data), *g = static_cast<const float*>(gamma.data);
  const float* b = static_cast<const float*>(beta.data);
  float *m = static_cast<float*>(mean.data), *r = static_cast<float*>(rstd.data), *s = static_cast<float*>(sum.data);
  const void* x2 = branch.data;  // (null but for the Add* forms)
  if (op->cuda)
    return on_cuda_stream(api, context, op->name, [&](void* stream) {
      return layer_norm_cast_cuda(op->type, xs, x2, s, g, b, y.data, ys, m, r, rows, cols, kernel->epsilon, stream);
    });
  dispatch(op->type, [&]<typename H>() {
    layer_norm_cast_cpu<H>(xs, x2, s, g, b, y.data, ys, m, r, rows, cols, kernel->epsilon);
  });
  return nullptr;
}

}  // namespace ort_trainer_kernels
