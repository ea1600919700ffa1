// A convolution and its backward by torch's kernels (oneDNN's on the CPU, as eager PyTorch trains a convolution there:
// graph/gradient/conv_ops.py); part of the torch operators' library (torch_ops.cc includes it). CPU, float32;
// attributes stride, padding, dilation (ints, one per spatial dim: torch's, a padding on both sides), groups (int),
// transposed (int, 0 where absent) and output_padding (ints, a transposed convolution's; zeros where absent):
//   Conv(x, w) -> y, BiasConv(x, w, b) -> y   aten::convolution of x [batch, channels, *space] by w [out,
//                                             channels / groups, *kernel] (transposed: w [channels, out / groups,
//                                             *kernel]), plus b [out] where given
//   ThresholdGrad(dy, y) -> dx                aten::threshold_backward: dy where y > the attribute threshold (float),
//                                             else 0 (a ReLU's gradient from its output: those between convolutions),
//                                             written into dx
//   ConvGrad(dy, x, w) -> (dx, dw)            aten::convolution_backward of a convolution (or transposed one) of x
//   ConvWeightGrad(dy, x, w) -> dw            [batch, channels, *space] by w, as Conv's: the
//                                             input's and the weight's gradients, or the weight's alone (an input
//                                             that needs none: the model's data); the bias's is a sum the graph
//                                             takes itself
// The weight's gradient written as a convolution of ONNX (the batch as its channels, the output gradient as its
// kernel) ran 2.6-3.4x slower than oneDNN's on ONNX Runtime's CPU kernels (a 3 x 3 ResNet convolution of
// [32, 64, 32, 32]: 31 ms against 11.8 ms).
#pragma once

#include <ATen/ATen.h>

#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "ort_io.h"
#include "torch_io.h"

namespace ort_trainer_kernels {

struct ConvAttributes {
  std::vector<int64_t> stride, padding, dilation, output_padding;
  int64_t groups = 1, transposed = 0;

  // whether stride, padding, dilation and output_padding (where given) have one value per spatial dim
  bool fits(size_t space) const {
    return stride.size() == space && padding.size() == space && dilation.size() == space &&
           (output_padding.empty() || output_padding.size() == space);
  }
  std::vector<int64_t> output_padding_of(size_t space) const {
    return output_padding.empty() ? std::vector<int64_t>(space, 0) : output_padding;
  }
};

// Conv or BiasConv, ConvGrad, ConvWeightGrad, ThresholdGrad
enum class ConvOp { kNone, kForward, kGrad, kWeightGrad, kThresholdGrad };

inline OrtStatus* compute_threshold_grad(const OrtApi* api, OrtKernelContext* context, const std::string& name,
                                         double threshold) {
  Tensor dy, y, dx;
  ORTT_RETURN_IF_ERROR(input(api, context, 0, &dy));
  ORTT_RETURN_IF_ERROR(input(api, context, 1, &y));
  if (dy.dims != y.dims) return fail(api, name + ": dy and y must have one shape");
  ORTT_RETURN_IF_ERROR(output(api, context, 0, y.dims, &dx));
  if (dx.size == 0) return nullptr;
  try {
    at::Tensor out = float32_tensor(dx);
    at::threshold_backward_out(out, float32_tensor(dy), float32_tensor(y), threshold);
    return nullptr;
  } catch (const std::exception& error) {
    return fail(api, name + ": " + error.what());
  }
}

// Conv or BiasConv (the file's head)
inline OrtStatus* compute_conv(const OrtApi* api, OrtKernelContext* context, const std::string& name, bool bias,
                               const ConvAttributes& conv) {
  std::vector<Tensor> in(bias ? 3 : 2);
  for (size_t i = 0; i < in.size(); ++i) ORTT_RETURN_IF_ERROR(input(api, context, i, &in[i]));
  const size_t rank = in[0].dims.size(), space = rank >= 2 ? rank - 2 : 0;
  if (rank < 3 || in[1].dims.size() != rank || (bias && in[2].dims.size() != 1) || !conv.fits(space))
    return fail(api, name + ": x and w must have the same rank (3 or more), b one dim, and stride, padding, "
                            "dilation and output_padding one value per spatial dim");
  try {
    const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(float32_tensor(in[2])) : std::nullopt;
    return write_outputs(api, context, {at::convolution(float32_tensor(in[0]), float32_tensor(in[1]), b, conv.stride,
                                                        conv.padding, conv.dilation, conv.transposed != 0,
                                                        conv.output_padding_of(space), conv.groups)});
  } catch (const std::exception& error) {
    return fail(api, name + ": " + error.what());
  }
}

// ConvGrad, or ConvWeightGrad where not `input_grad` (the file's head)
inline OrtStatus* compute_conv_grad(const OrtApi* api, OrtKernelContext* context, const std::string& name,
                                    bool input_grad, const ConvAttributes& conv) {
  std::vector<Tensor> in(3);
  for (size_t i = 0; i < in.size(); ++i) ORTT_RETURN_IF_ERROR(input(api, context, i, &in[i]));
  const size_t rank = in[1].dims.size(), space = rank >= 2 ? rank - 2 : 0;
  if (rank < 3 || in[0].dims.size() != rank || in[2].dims.size() != rank || !conv.fits(space))
    return fail(api, name + ": dy, x and w must have the same rank (3 or more), and stride, padding, dilation and "
                            "output_padding one value per spatial dim");
  try {
    auto grads = at::convolution_backward(float32_tensor(in[0]), float32_tensor(in[1]), float32_tensor(in[2]),
                                          std::nullopt, conv.stride, conv.padding, conv.dilation,
                                          conv.transposed != 0, conv.output_padding_of(space), conv.groups,
                                          {input_grad, true, false});
    return write_outputs(api, context, input_grad ? std::vector<at::Tensor>{std::get<0>(grads), std::get<1>(grads)}
                                                  : std::vector<at::Tensor>{std::get<1>(grads)});
  } catch (const std::exception& error) {
    return fail(api, name + ": " + error.what());
  }
}

}  // namespace ort_trainer_kernels
