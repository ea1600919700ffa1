// Training-mode batch norm and its backward by torch's kernels (graph/gradient/batch_norm_ops.py), as eager PyTorch
// trains nn.BatchNorm on the CPU; part of the torch operators' library (torch_ops.cc includes it). CPU, float32;
// attributes epsilon (float), momentum (float: torch's):
//   BatchNormGrad(dy, x, w, save_mean, save_invstd) -> (dx, dw, db)
//                                             aten::native_batch_norm_backward of a batch norm over every dim of x
//                                             [batch, channels, ...] but the channels, from the forward's batch
//                                             statistics (the mean and 1 / sqrt(var + epsilon), [channels])
//   BatchNormTraining(x, w, b, running_mean, running_var) -> (y, save_mean, save_invstd, new_running_mean,
//                     new_running_var)        aten::native_batch_norm in training, written into the outputs (the
//                                             new running statistics updated from copies of the old, as torch updates
//                                             a module's in place: the variance unbiased)
// Written in ONNX, the two were about 35 element-wise nodes and reductions per batch norm.
#pragma once

#include <ATen/ATen.h>

#include <exception>
#include <string>
#include <vector>

#include "ort_io.h"
#include "torch_io.h"

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
    auto [dx, dw, db] = at::native_batch_norm_backward(float32_tensor(in[0]), float32_tensor(in[1]),
                                                       float32_tensor(in[2]), std::nullopt, std::nullopt,
                                                       float32_tensor(in[3]), float32_tensor(in[4]), true, epsilon,
                                                       {true, true, true});
    return write_outputs(api, context, {dx, dw, db});
  } catch (const std::exception& error) {
    return fail(api, name + ": " + error.what());
  }
}

inline OrtStatus* compute_batch_norm_training(const OrtApi* api, OrtKernelContext* context, const std::string& name,
                                              double epsilon, double momentum) {
  std::vector<Tensor> in(5), out(5);
  for (size_t i = 0; i < in.size(); ++i) ORTT_RETURN_IF_ERROR(input(api, context, i, &in[i]));
  const Tensor& x = in[0];
  if (x.dims.size() < 2 || in[1].dims.size() != 1 || in[1].dims[0] != x.dims[1] || in[2].dims != in[1].dims ||
      in[3].dims != in[1].dims || in[4].dims != in[1].dims)
    return fail(api, name + ": x must be [batch, channels, ...], w, b and the running statistics [channels]");
  for (size_t i = 0; i < out.size(); ++i)
    ORTT_RETURN_IF_ERROR(output(api, context, i, i ? in[1].dims : x.dims, &out[i]));
  try {
    at::Tensor y = float32_tensor(out[0]), mean = float32_tensor(out[1]), invstd = float32_tensor(out[2]),
               running_mean = float32_tensor(out[3]), running_var = float32_tensor(out[4]);
    running_mean.copy_(float32_tensor(in[3]));
    running_var.copy_(float32_tensor(in[4]));
    at::native_batch_norm_out(y, mean, invstd, float32_tensor(x), float32_tensor(in[1]), float32_tensor(in[2]),
                              running_mean, running_var, true, momentum, epsilon);
    return nullptr;
  } catch (const std::exception& error) {
    return fail(api, name + ": " + error.what());
  }
}

}  // namespace ort_trainer_kernels
