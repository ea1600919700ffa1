// What the CPU operators of torch's kernels (torch_conv.h, torch_norm.h, torch_rnn.h) share: ONNX Runtime's float32
// tensors read as torch's (no copy), and torch's results copied into the run's outputs.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "ort_io.h"

namespace ort_trainer_kernels {

// `t` (a float32 tensor of ONNX Runtime's: an input, or an output already allocated) as a torch tensor on its memory
inline at::Tensor float32_tensor(const Tensor& t) {
  return at::from_blob(t.data, t.dims, at::TensorOptions().dtype(at::kFloat));
}

// copies torch's results into the run's outputs, one each (for a kernel that cannot write into given buffers)
inline OrtStatus* write_outputs(const OrtApi* api, OrtKernelContext* context, const std::vector<at::Tensor>& results) {
  for (size_t i = 0; i < results.size(); ++i) {
    Tensor out;
    const std::vector<int64_t> dims(results[i].sizes().begin(), results[i].sizes().end());
    ORTT_RETURN_IF_ERROR(output(api, context, i, dims, &out));
    if (out.size > 0) at::from_blob(out.data, dims, results[i].options()).copy_(results[i]);
  }
  return nullptr;
}

}  // namespace ort_trainer_kernels
