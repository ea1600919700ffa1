// Training-mode batch norm's backward by torch's kernel (graph/gradient/batch_norm_ops.py), as eager PyTorch trains
// nn.BatchNorm on the CPU; part of the torch operators' library (torch_ops.cc includes it). CPU, float32; attribute
// epsilon (float):
//   BatchNormGrad(dy, x, w, save_mean, save_invstd) -> (dx, dw, db)
//                                             aten::native_batch_norm_backward of a batch norm over every dim of x
//                                             [batch, channels, ...] but the channels, from the forward's batch
//                                             statistics (the mean and 1 / sqrt(var + epsilon), [channels])
// Written in ONNX, it was about 25 element-wise nodes and reductions per batch norm, 3x the kernel's time.
#pragma once

#include <ATen/ATen.h>

#include <exception>
#include <string>
#include <vector>

#include "ort_io.h"

namespace ort_trainer_kernels {

inline OrtStatus* compute_batch_norm_grad(const OrtApi* api, OrtKernelContext* context, const std::string& name,
                                          double epsilon) {
  std::vector<Tensor> in(5);
  for (size_t i = 0; i < in.size(); ++i) ORTT_RETURN_IF_ERROR(input(api, context, i, &in[i]));
  const Tensor& x = in[1];
  if (x.dims.size() < 2 || in[0].dims != x.dims || in[2].dims.size() != 1 || in[2].dims[0] != x.dims[1] ||
      in[3].dims != in[2].dims || in[4].dims != in[2].dims)
    return fail(api, name + ": dy and x must be [batch, channels, ...] alike, w and the statistics [channels]");
  try {
    const at::TensorOptions options = at::TensorOptions().dtype(at::kFloat);
    auto wrap = [&](const Tensor& t) { return at::from_blob(t.data, t.dims, options); };
    auto [dx, dw, db] = at::native_batch_norm_backward(wrap(in[0]), wrap(in[1]), wrap(in[2]), std::nullopt,
                                                       std::nullopt, wrap(in[3]), wrap(in[4]), true, epsilon,
                                                       {true, true, true});
    const at::Tensor results[] = {dx, dw, db};
    for (size_t i = 0; i < 3; ++i) {
      Tensor out;
      const std::vector<int64_t> dims(results[i].sizes().begin(), results[i].sizes().end());
      ORTT_RETURN_IF_ERROR(output(api, context, i, dims, &out));
      if (out.size > 0) wrap(out).copy_(results[i]);
    }
    return nullptr;
  } catch (const std::exception& error) {
    return fail(api, name + ": " + error.what());
  }
}

}  // namespace ort_trainer_kernels
