// ort_trainer's operators that run torch's own kernels inside ONNX Runtime (domain "ort_trainer.torch",
// ../torch_ops.py): built against the torch of the process that loads it, linked to its libraries, on the tensors
// ONNX Runtime gives the run (wrapped without a copy) and, on a GPU, on the session's CUDA stream. Not part of the
// kernel library (ops.cc), which needs no torch.
//
// Operators (T: float32, float16 or bfloat16; attributes scale (float), causal (int 0/1) and backend (int: 0, the
// default, or 1; below)):
//   Attention(q, k, v) -> (out, lse)          softmax(q·kᵀ·scale [+ causal mask]) · v over q, k, v [batch, heads,
//   BiasAttention(q, k, v, bias) -> (out, lse)  seq, head dim]; with an additive bias broadcast to [batch, heads,
//                                             seq_q, seq_k] (attention's mask); lse: each row's log-sum-exp of the
//                                             scores, float32 [batch, heads, seq_q]
//   AttentionGrad(dout, q, k, v, out, lse) -> (dq, dk, dv)
//   BiasAttentionGrad(dout, q, k, v, bias, out, lse) -> (dq, dk, dv)
//                                             the backward, from the forward's out and lse (no probabilities kept)
// Attribute layout (int): 0 (default) as above; 1: q, k, v, out, dout, dq, dk and dv are [batch, seq, heads, dim]
// (as a projection's output lies once split into heads: no transposed copy), lse as above.
//   PackedAttention(qkv) -> (out, lse), PackedBiasAttention(qkv, bias) -> (out, lse)
//   PackedAttentionGrad(dout, qkv, out, lse) -> dqkv, PackedBiasAttentionGrad(dout, qkv, bias, out, lse) -> dqkv
//                                             the same on q, k and v packed in one [batch, seq, 3, heads, dim]
//                                             tensor (one projection's output: GPT-2's c_attn), read as strided
//                                             views of it, their gradients written into one tensor of its shape;
//                                             layout 1 for out and dout (graph/passes/packed_attention.py)
// On the CPU: torch's flash attention for the CPU (_scaled_dot_product_flash_attention_for_cpu and its backward);
// on CUDA: torch's memory-efficient attention (_scaled_dot_product_efficient_attention and its backward), which
// takes an additive bias, or with the attribute backend 1 the kernel torch's own scaled_dot_product_attention picks
// for the tensors (at::_fused_sdp_choice, torch.backends.cuda.enable_*_sdp applying): flash attention (no bias) or
// cuDNN's, else the memory-efficient one; the backward picks again from the same tensors. None keeps a
// [seq_q, seq_k] tensor; each one's lse is each row's natural log-sum-exp of the scaled, biased scores.
//
// Matrix products (graph/passes/torch_products.py), torch's BLAS (cuBLAS on CUDA: a bias vector in the product's
// epilogue; MKL on the CPU):
//   Gemm(a, b) -> y, BiasGemm(a, b, c) -> y   ONNX's Gemm: y = alpha · op(a) · op(b) [+ beta · c], a and b 2-D,
//                                             op() a transpose where the attribute transA / transB is 1, c
//                                             broadcast to y (at::mm / at::addmm); an operand of rank > 2 is read
//                                             as the 2-D matrix of its rows (its leading axes flattened, a view),
//                                             and y is then [..., n] with a's leading axes where a is not
//                                             transposed (graph/passes/product_views.py); a 1-D a not transposed
//                                             is one row, y then [n] (a column sum: a row of ones)
//   MatMul(a, b) -> y                         ONNX's MatMul (numpy's: batch axes broadcast, a vector operand a row or
//                                             a column), the last two axes of a and b swapped where transA / transB
//                                             is 1 (at::matmul: a transpose is read in place)
//   GemmToFloat(a, b) -> y, MatMulToFloat(a, b) -> y
//                                             the same of float16 or bfloat16 operands (no C), y float32: summed in
//                                             float32 and not rounded to the half dtype (a half weight gradient that
//                                             a Cast widened; on CUDA cuBLAS writes float32 itself, mm's out_dtype)
//
// CTC loss (graph/export/ctc.py), torch's CTC kernels (T: float32 or float64; the targets and lengths int64;
// attributes blank and zero_infinity (ints)):
//   CTCLoss(log_probs, targets, input_lengths, target_lengths) -> loss
//                                             each sequence's negative log-likelihood [batch] (aten::_ctc_loss) of
//                                             log_probs [frames, batch, classes], targets [batch, longest] (padded)
//                                             or concatenated, lengths [batch]; a target value outside [0, classes)
//                                             fails the run (torch's kernels would read past log_probs)
//   CTCLossGrad(grad, log_probs, targets, input_lengths, target_lengths) -> grad_log_probs
//                                             aten::_ctc_loss_backward, after aten::_ctc_loss again (its alignment
//                                             table is not kept between the two)
//
// LSTM layers (graph/export/fused_lstm.py), oneDNN's kernels as torch runs them on the CPU: LSTMLayer and
// LSTMLayerGrad, in torch_rnn.h.
//
// A CNN's convolutions (graph/gradient/conv_ops.py), oneDNN's kernels on the CPU: Conv, BiasConv, ConvGrad,
// ConvWeightGrad, and ReLU gradients, ThresholdGrad, in torch_conv.h. Training-mode batch norm
// (graph/gradient/batch_norm_ops.py): BatchNormTraining and BatchNormGrad, in torch_norm.h. (torch_io.h: what the
// three headers share.)
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/SDPBackend.h>
#include <torch/version.h>

#ifdef ORT_TRAINER_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <array>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ort_abi.h"
#include "ort_io.h"
#include "torch_conv.h"
#include "torch_norm.h"
#include "torch_rnn.h"

#define ORTT_EXPORT extern "C" __attribute__((visibility("default")))

namespace ort_trainer_kernels {
namespace {

using namespace ort_abi;

constexpr uint32_t kOpVersion = 16;

struct Operator : OperatorEntry {
  bool backward, bias, packed;
  bool product, matmul, to_float;  // Gemm, BiasGemm or MatMul (else an attention); MatMul; a float32 output
  bool ctc;                        // CTCLoss or CTCLossGrad
  bool lstm;                       // LSTMLayer or LSTMLayerGrad (torch_rnn.h)
  ConvOp conv;                     // Conv, BiasConv, ConvGrad, ConvWeightGrad or ThresholdGrad (torch_conv.h)
  bool batch_norm;                 // BatchNormGrad or, not backward, BatchNormTraining (torch_norm.h)
  ONNXTensorElementDataType type;
};

struct Kernel {
  const OrtApi* api;
  const Operator* op;
  float scale;
  bool causal;
  bool heads_last;  // the attribute layout: 1
  bool torch_choice;  // the attribute backend: 1 (on CUDA, the kernel torch's attention would pick)
  bool trans_a, trans_b;  // the products'
  float alpha, beta;
  int64_t blank;
  bool zero_infinity;  // CTC's
  bool reverse, train;  // LSTM's
  ConvAttributes conv;  // a convolution's
  float epsilon, momentum;  // a batch norm's
  float threshold;  // ThresholdGrad's
};

at::ScalarType scalar_type(ONNXTensorElementDataType type) {
  return type == ONNX_FLOAT16    ? at::kHalf
         : type == ONNX_BFLOAT16 ? at::kBFloat16
         : type == ONNX_DOUBLE   ? at::kDouble
                                 : at::kFloat;
}

// the efficient kernel reads a bias whose last dim is a multiple of 16 elements, and [batch, heads, seq_q, seq_k]
// (broadcast dims as stride 0): torch's own scaled_dot_product_attention prepares it so
at::Tensor prepared_bias(const at::Tensor& bias, const at::Tensor& q, const at::Tensor& k) {
  at::Tensor b = bias;
  const int64_t keys = k.size(2), padded = (keys + 15) / 16 * 16;
  if (padded != keys) b = at::constant_pad_nd(b, {0, padded - keys}, 0).narrow(3, 0, keys);
  return b.expand({q.size(0), q.size(1), q.size(2), keys});
}

// On CUDA, the kernel that runs an attention (the file's head): torch's choice for these tensors where the node asks
// for it and it is flash attention without a bias or cuDNN's, else the memory-efficient kernel
at::SDPBackend cuda_backend(const Kernel* kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& bias) {
  using at::SDPBackend;
  if (!kernel->torch_choice) return SDPBackend::efficient_attention;
  const auto choice = static_cast<SDPBackend>(at::_fused_sdp_choice(q, k, v, bias, 0.0, kernel->causal, kernel->scale));
  if (choice == SDPBackend::cudnn_attention || (choice == SDPBackend::flash_attention && !bias)) return choice;
  return SDPBackend::efficient_attention;
}

// A run's inputs, its tensors' options (dtype, device) and ONNX Runtime's stream (CUDA), read from the context
struct Run {
  std::vector<Tensor> in;
  at::TensorOptions options;
  void* stream = nullptr;
};

OrtStatus* start(const OrtApi* api, const Operator* op, OrtKernelContext* context, Run* run) {
  run->in.resize(op->inputs);
  for (size_t i = 0; i < op->inputs; ++i) ORTT_RETURN_IF_ERROR(input(api, context, i, &run->in[i]));
  run->options = at::TensorOptions().dtype(scalar_type(op->type));
#ifdef ORT_TRAINER_TORCH_CUDA
  if (op->cuda) {
    ORTT_RETURN_IF_ERROR(
        slot<KernelContextGetGPUComputeStream>(api, kKernelContextGetGPUComputeStream)(context, &run->stream));
    run->options = run->options.device(at::kCUDA, c10::cuda::current_device());
  }
#endif
  return nullptr;
}

// torch's current CUDA stream is ONNX Runtime's run's while one lives (nothing on the CPU)
class OnStream {
 public:
  OnStream(const Operator* op, void* stream) {
#ifdef ORT_TRAINER_TORCH_CUDA
    if (op->cuda)
      guard_.emplace(c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), c10::cuda::current_device()));
#endif
  }

 private:
#ifdef ORT_TRAINER_TORCH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
};

// a · b of half operands into the float32 `out`, summed in float32 and not rounded to half: on CUDA cuBLAS writes
// float32 (mm's out_dtype, torch 2.8 and later) for 2-D operands; else the operands widened (exactly) first
void widened_product(const Operator* op, const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  if (op->cuda && a.dim() == 2 && b.dim() == 2) {
    at::mm_out(out, a, b, at::kFloat);
    return;
  }
#endif
  at::matmul_out(out, a.to(at::kFloat), b.to(at::kFloat));
}

// Gemm, BiasGemm, MatMul (the file's head): torch's product written into ONNX Runtime's output in place
OrtStatus* compute_product(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  const Operator* op = kernel->op;
  Run run;
  ORTT_RETURN_IF_ERROR(start(api, op, context, &run));
  const bool matmul = op->matmul;
  const Tensor &a_in = run.in[0], &b_in = run.in[1];
  const bool row = !matmul && a_in.dims.size() == 1;  // a Gemm's 1-D a: one row, y [n] (a column sum's ones)
  if (matmul ? a_in.dims.empty() || b_in.dims.empty() || (kernel->trans_a && a_in.dims.size() < 2) ||
                   (kernel->trans_b && b_in.dims.size() < 2)
             : (a_in.dims.size() < 2 && !(row && !kernel->trans_a)) || b_in.dims.size() < 2)
    return fail(api, std::string(op->name) + (matmul ? ": a and b must be of rank 1 or more (2 or more transposed)"
                                                     : ": a must be of rank 1 (not transposed) or more, b of rank 2 "
                                                       "or more"));
  try {
    OnStream on_stream(op, run.stream);
    auto wrap = [&](const Tensor& t) { return at::from_blob(t.data, t.dims, run.options); };
    // a Gemm's operand of rank > 2: the matrix of its rows (a view of the contiguous tensor); of rank 1, one row
    auto rows = [&](at::Tensor t) { return matmul || t.dim() == 2 ? t : t.reshape({-1, t.size(-1)}); };
    at::Tensor a = rows(wrap(a_in)), b = rows(wrap(b_in));
    if (kernel->trans_a) a = a.transpose(-2, -1);
    if (kernel->trans_b) b = b.transpose(-2, -1);
    const int64_t rows_of_b = b.dim() == 1 ? b.size(0) : b.size(-2);
    if (a.size(-1) != rows_of_b)
      return fail(api, std::string(op->name) + ": a's columns (" + std::to_string(a.size(-1)) + ") and b's rows (" +
                           std::to_string(rows_of_b) + ") differ, after transA / transB");
    // numpy's: the batch axes broadcast, then a's rows (none for a vector a) and b's columns (none for a vector b)
    std::vector<int64_t> dims;
    if (a.dim() > 2 || b.dim() > 2)
      dims = at::infer_size(a.sizes().slice(0, std::max<int64_t>(a.dim() - 2, 0)),
                            b.sizes().slice(0, std::max<int64_t>(b.dim() - 2, 0)));
    if (!matmul && !kernel->trans_a && a_in.dims.size() > 2)  // [..., n]: a's leading axes
      dims.assign(a_in.dims.begin(), a_in.dims.end() - 1);
    else if (a.dim() > 1 && !row)
      dims.push_back(a.size(-2));
    if (b.dim() > 1) dims.push_back(b.size(-1));
    Tensor y;
    ORTT_RETURN_IF_ERROR(output(api, context, 0, dims, &y));
    if (op->to_float) {
      at::Tensor out = rows(at::from_blob(y.data, y.dims, run.options.dtype(at::kFloat)));
      widened_product(op, a, b, out);
      if (kernel->alpha != 1.0f) out.mul_(kernel->alpha);
      return nullptr;
    }
    at::Tensor out = rows(wrap(y));
    if (matmul)
      at::matmul_out(out, a, b);
    else if (op->bias)
      at::addmm_out(out, wrap(run.in[2]), a, b, kernel->beta, kernel->alpha);
    else if (kernel->alpha == 1.0f)
      at::mm_out(out, a, b);
    else
      at::addmm_out(out, out, a, b, 0.0, kernel->alpha);  // (beta 0: out's values are not read)
    return nullptr;
  } catch (const std::exception& error) {
    return fail(api, std::string(op->name) + ": " + error.what());
  }
}

// the attentions (the file's head)
OrtStatus* compute_attention(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  const Operator* op = kernel->op;
  Run run;
  ORTT_RETURN_IF_ERROR(start(api, op, context, &run));
  const std::vector<Tensor>& in = run.in;
  const at::TensorOptions options = run.options;
  auto wrap = [&](const Tensor& t, at::ScalarType type) {
    return at::from_blob(t.data, t.dims, options.dtype(type));
  };
  // a [batch, heads, seq, dim] view of a q, k, v, out or gradient tensor in the node's layout
  auto heads = [&](const Tensor& t, at::ScalarType type) {
    at::Tensor view = wrap(t, type);
    return kernel->heads_last || op->packed ? view.transpose(1, 2) : view;
  };
  // the i-th of q, k and v: of the node's inputs, or of a packed [batch, seq, 3, heads, dim] one
  auto part = [&](const Tensor& t, int64_t i, at::ScalarType type) {
    return op->packed ? wrap(t, type).select(2, i).transpose(1, 2) : heads(t, type);
  };
  try {
    OnStream on_stream(op, run.stream);
    const at::ScalarType t = scalar_type(op->type);
    const size_t first = op->backward ? 1 : 0, qkv = op->packed ? 1 : 3;  // q's index, the inputs of q, k and v
    for (size_t i = first; i < first + qkv; ++i)
      if (in[i].dims.size() != (op->packed ? 5 : 4) || (op->packed && in[i].dims[2] != 3))
        return fail(api, std::string(op->name) + (op->packed ? ": qkv must be [batch, seq, 3, heads, dim]"
                                                             : ": q, k and v must be 4-D ([batch, heads, seq, dim]; "
                                                               "with the attribute layout 1, [batch, seq, heads, "
                                                               "dim])"));
    const size_t k_at = op->packed ? first : first + 1, v_at = op->packed ? first : first + 2;
    at::Tensor q = part(in[first], 0, t), k = part(in[k_at], 1, t), v = part(in[v_at], 2, t);
    // out's dims in the node's layout: q's
    const std::vector<int64_t> out_dims = op->packed ? std::vector<int64_t>{in[first].dims[0], in[first].dims[1],
                                                                          in[first].dims[3], in[first].dims[4]}
                                                     : in[first].dims;
    std::optional<at::Tensor> bias;
    if (op->bias) {
      bias = wrap(in[first + qkv], t);
      while (bias->dim() < 4) bias = bias->unsqueeze(0);
    }
    const double scale = kernel->scale;
    if (!op->backward) {
      at::Tensor out, lse;
      if (op->cuda) {
        std::optional<at::Tensor> b;
        if (bias) b = prepared_bias(*bias, q, k);
        const at::SDPBackend backend = cuda_backend(kernel, q, k, v, b);
        if (backend == at::SDPBackend::flash_attention) {
          auto result = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, kernel->causal, false, scale);
          out = std::get<0>(result);
          lse = std::get<1>(result);
        } else if (backend == at::SDPBackend::cudnn_attention) {
          auto result = at::_scaled_dot_product_cudnn_attention(q, k, v, b, true, 0.0, kernel->causal, false, scale);
          out = std::get<0>(result);
          lse = std::get<1>(result).reshape({q.size(0), q.size(1), q.size(2)});  // ([batch, heads, seq_q, 1])
        } else {
          auto result = at::_scaled_dot_product_efficient_attention(q, k, v, b, true, 0.0, kernel->causal, scale);
          out = std::get<0>(result);
          lse = std::get<1>(result).narrow(2, 0, q.size(2));  // (padded to a multiple of 32 rows)
        }
      } else {
        auto result = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, kernel->causal, bias, scale);
        out = std::get<0>(result);
        lse = std::get<1>(result);
      }
      Tensor out_t, lse_t;
      ORTT_RETURN_IF_ERROR(output(api, context, 0, out_dims, &out_t));
      ORTT_RETURN_IF_ERROR(output(api, context, 1, {q.size(0), q.size(1), q.size(2)}, &lse_t));
      heads(out_t, t).copy_(out);
      wrap(lse_t, at::kFloat).copy_(lse);
      return nullptr;
    }
    const size_t rest = first + qkv + (op->bias ? 1 : 0);
    at::Tensor dout = heads(in[0], t), out = heads(in[rest], t), lse = wrap(in[rest + 1], at::kFloat);
    at::Tensor dq, dk, dv;
    const at::Tensor b = op->cuda && bias ? prepared_bias(*bias, q, k) : at::Tensor();  // (CUDA's kernels read it so)
    const at::SDPBackend backend =
        op->cuda ? cuda_backend(kernel, q, k, v, b.defined() ? std::optional(b) : std::nullopt) : at::SDPBackend::math;
    if (backend == at::SDPBackend::flash_attention) {
      // (no dropout: the random state is not read; the backward makes out and dout contiguous as it needs them)
      const at::Tensor seed = at::empty({2}, options.dtype(at::kUInt64)), offset = at::empty({}, seed.options());
      auto grads = at::_scaled_dot_product_flash_attention_backward(
          dout, q, k, v, out, lse, at::Tensor(), at::Tensor(), q.size(2), k.size(2), 0.0, kernel->causal, seed, offset,
          scale);
      dq = std::get<0>(grads), dk = std::get<1>(grads), dv = std::get<2>(grads);
    } else if (backend == at::SDPBackend::cudnn_attention) {
      const at::Tensor seed = at::empty({}, options.dtype(at::kLong)), offset = at::empty({}, seed.options());
      // cuDNN's graph takes dout laid out as out, which is as its forward laid it (q's order of strides)
      const at::Tensor dout_as_out = dout.strides() == out.strides() ? dout : at::empty_like(out).copy_(dout);
      auto grads = at::_scaled_dot_product_cudnn_attention_backward(
          dout_as_out, q, k, v, out, lse.reshape({q.size(0), q.size(1), q.size(2), 1}), seed, offset,
          b, at::Tensor(), at::Tensor(), q.size(2), k.size(2), 0.0, kernel->causal, scale);
      dq = std::get<0>(grads), dk = std::get<1>(grads), dv = std::get<2>(grads);
    } else if (op->cuda) {
      const int64_t rows = q.size(2), padded = (rows + 31) / 32 * 32;
      at::Tensor lse_padded = at::zeros({q.size(0), q.size(1), padded}, lse.options());
      lse_padded.narrow(2, 0, rows).copy_(lse);
      const at::Tensor none = at::empty({}, at::TensorOptions().dtype(at::kLong));
      // the kernel reads out as rows of heads · dim values, [batch, seq, heads, dim] as its forward wrote it
      // (its o_strideM is heads · dim, whatever the tensor's stride): layout 1 is that; else a copy in it
      const at::Tensor out_rows =
          out.transpose(1, 2).is_contiguous() ? out : out.transpose(1, 2).contiguous().transpose(1, 2);
      auto grads = at::_scaled_dot_product_efficient_attention_backward(
          dout, q, k, v, b, out_rows, lse_padded, none, none, 0.0, {true, true, true, false}, kernel->causal, scale);
      dq = std::get<0>(grads), dk = std::get<1>(grads), dv = std::get<2>(grads);
    } else {
      auto grads = at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0,
                                                                            kernel->causal, bias, scale);
      dq = std::get<0>(grads), dk = std::get<1>(grads), dv = std::get<2>(grads);
    }
    const at::Tensor* grads[] = {&dq, &dk, &dv};
    if (op->packed) {  // one output: the three in their thirds of it
      Tensor grad;
      ORTT_RETURN_IF_ERROR(output(api, context, 0, in[first].dims, &grad));
      for (int64_t i = 0; i < 3; ++i) part(grad, i, t).copy_(*grads[i]);
      return nullptr;
    }
    for (size_t i = 0; i < 3; ++i) {
      Tensor grad;
      ORTT_RETURN_IF_ERROR(output(api, context, i, in[first + i].dims, &grad));
      heads(grad, t).copy_(*grads[i]);
    }
    return nullptr;
  } catch (const std::exception& error) {
    return fail(api, std::string(op->name) + ": " + error.what());
  }
}

// the targets' values that the lengths select (each row's first target_length of padded [batch, longest] targets,
// else the first sum of the lengths) outside [0, classes): torch's kernels would index log_probs with them
std::optional<int64_t> bad_target(const at::Tensor& targets, const at::Tensor& target_lengths, int64_t classes) {
  const at::Tensor values = targets.cpu(), lengths = target_lengths.cpu();
  const int64_t* value = values.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const bool padded = values.dim() == 2;
  int64_t at = 0;
  for (int64_t i = 0; i < lengths.numel(); ++i) {
    const int64_t start = padded ? i * values.size(1) : at, n = std::max<int64_t>(length[i], 0);
    for (int64_t j = start; j < std::min(start + n, values.numel()); ++j)
      if (value[j] < 0 || value[j] >= classes) return value[j];
    at += n;
  }
  return std::nullopt;
}

// CTCLoss and CTCLossGrad (the file's head)
OrtStatus* compute_ctc(const Kernel* kernel, OrtKernelContext* context) {
  const OrtApi* api = kernel->api;
  const Operator* op = kernel->op;
  Run run;
  ORTT_RETURN_IF_ERROR(start(api, op, context, &run));
  const std::vector<Tensor>& in = run.in;
  const size_t first = op->backward ? 1 : 0;  // log_probs' index
  auto wrap = [&](const Tensor& t, at::ScalarType type) {
    return at::from_blob(t.data, t.dims, run.options.dtype(type));
  };
  if (in[first].dims.size() != 3 || in[first + 2].dims.size() != 1 || in[first + 3].dims.size() != 1 ||
      in[first + 1].dims.empty() || in[first + 1].dims.size() > 2)
    return fail(api, std::string(op->name) + ": log_probs must be [frames, batch, classes], the targets 1-D or 2-D "
                                             "and the lengths 1-D");
  try {
    OnStream on_stream(op, run.stream);
    const at::ScalarType t = scalar_type(op->type);
    const at::Tensor log_probs = wrap(in[first], t), targets = wrap(in[first + 1], at::kLong),
                     input_lengths = wrap(in[first + 2], at::kLong), target_lengths = wrap(in[first + 3], at::kLong);
    if (auto bad = bad_target(targets, target_lengths, log_probs.size(2)))
      return fail(api, std::string(op->name) + ": a target is " + std::to_string(*bad) + ", outside the " +
                           std::to_string(log_probs.size(2)) + " classes of log_probs [0, " +
                           std::to_string(log_probs.size(2)) + ")");
    auto [nll, log_alpha] =
        at::_ctc_loss(log_probs, targets, input_lengths, target_lengths, kernel->blank, kernel->zero_infinity);
    Tensor out;
    if (!op->backward) {
      ORTT_RETURN_IF_ERROR(output(api, context, 0, {log_probs.size(1)}, &out));
      wrap(out, t).copy_(nll);
      return nullptr;
    }
    const at::Tensor grad = at::_ctc_loss_backward(wrap(in[0], t), log_probs, targets, input_lengths, target_lengths,
                                                   nll, log_alpha, kernel->blank, kernel->zero_infinity);
    ORTT_RETURN_IF_ERROR(output(api, context, 0, in[first].dims, &out));
    wrap(out, t).copy_(grad);
    return nullptr;
  } catch (const std::exception& error) {
    return fail(api, std::string(op->name) + ": " + error.what());
  }
}

OrtStatus* compute(void* opaque, OrtKernelContext* context) {
  const Kernel* kernel = static_cast<const Kernel*>(opaque);
  if (kernel->op->ctc) return compute_ctc(kernel, context);
  if (kernel->op->batch_norm && !kernel->op->backward)
    return compute_batch_norm_training(kernel->api, context, kernel->op->name, kernel->epsilon, kernel->momentum);
  if (kernel->op->batch_norm)
    return compute_batch_norm_grad(kernel->api, context, kernel->op->name, kernel->epsilon);
  if (kernel->op->conv == ConvOp::kThresholdGrad)
    return compute_threshold_grad(kernel->api, context, kernel->op->name, kernel->threshold);
  if (kernel->op->conv == ConvOp::kForward)
    return compute_conv(kernel->api, context, kernel->op->name, kernel->op->bias, kernel->conv);
  if (kernel->op->conv != ConvOp::kNone)
    return compute_conv_grad(kernel->api, context, kernel->op->name, kernel->op->conv == ConvOp::kGrad, kernel->conv);
  if (kernel->op->lstm)
    return compute_lstm(kernel->api, context, kernel->op->name, kernel->op->backward, kernel->reverse, kernel->train,
                        kernel);
  return kernel->op->product ? compute_product(kernel, context) : compute_attention(kernel, context);
}

const Operator* as_operator(const OrtCustomOp* op) { return static_cast<const Operator*>(op); }

void* create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {
  // (an attribute the node lacks keeps its default)
  float scale = 1.0f, alpha = 1.0f, beta = 1.0f, epsilon = 1e-5f, momentum = 0.1f,
        threshold = 0.0f;
  int64_t causal = 0, layout = 0, trans_a = 0, trans_b = 0, backend = 0, blank = 0, zero_infinity = 0, reverse = 0,
          train = 0;
  for (auto [name, value] : {std::pair{"scale", &scale}, std::pair{"alpha", &alpha}, std::pair{"beta", &beta},
                             std::pair{"epsilon", &epsilon}, std::pair{"momentum", &momentum},
                             std::pair{"threshold", &threshold}}) {
    OrtStatus* status = slot<KernelInfoGetAttributeFloat>(api, kKernelInfoGetAttributeFloat)(info, name, value);
    if (status != nullptr) slot<ReleaseStatus>(api, kReleaseStatus)(status);
  }
  for (auto [name, value] : {std::pair{"causal", &causal}, std::pair{"layout", &layout},
                             std::pair{"transA", &trans_a}, std::pair{"transB", &trans_b},
                             std::pair{"backend", &backend}, std::pair{"blank", &blank},
                             std::pair{"zero_infinity", &zero_infinity}, std::pair{"reverse", &reverse},
                             std::pair{"train", &train}}) {
    OrtStatus* status = slot<KernelInfoGetAttributeInt64>(api, kKernelInfoGetAttributeInt64)(info, name, value);
    if (status != nullptr) slot<ReleaseStatus>(api, kReleaseStatus)(status);
  }
  Kernel* kernel = new Kernel{api, as_operator(op), scale, causal != 0, layout == 1, backend == 1, trans_a != 0,
                              trans_b != 0, alpha, beta, blank, zero_infinity != 0, reverse != 0, train != 0, {},
                              epsilon, momentum, threshold};
  for (auto [name, values] : {std::pair{"stride", &kernel->conv.stride}, std::pair{"padding", &kernel->conv.padding},
                              std::pair{"dilation", &kernel->conv.dilation},
                              std::pair{"output_padding", &kernel->conv.output_padding}}) {
    size_t size = 0;  // the count first (a null buffer), then the values
    OrtStatus* status =
        slot<KernelInfoGetAttributeArrayInt64>(api, kKernelInfoGetAttributeArrayInt64)(info, name, nullptr, &size);
    if (status == nullptr) {
      values->resize(size);
      status = slot<KernelInfoGetAttributeArrayInt64>(api, kKernelInfoGetAttributeArrayInt64)(info, name,
                                                                                               values->data(), &size);
    }
    if (status != nullptr) slot<ReleaseStatus>(api, kReleaseStatus)(status);
  }
  for (auto [name, value] : {std::pair{"groups", &kernel->conv.groups},
                             std::pair{"transposed", &kernel->conv.transposed}}) {
    OrtStatus* status = slot<KernelInfoGetAttributeInt64>(api, kKernelInfoGetAttributeInt64)(info, name, value);
    if (status != nullptr) slot<ReleaseStatus>(api, kReleaseStatus)(status);
  }
  return kernel;
}
void destroy_kernel(void* kernel) { delete static_cast<Kernel*>(kernel); }

Operator make_operator(const char* op_name, bool backward, bool bias, bool cuda, ONNXTensorElementDataType t,
                       bool packed = false) {
  std::vector<ONNXTensorElementDataType> ins((backward ? 1 : 0) + (packed ? 1 : 3), t), outs;
  if (bias) ins.push_back(t);
  if (backward) {
    ins.push_back(t);           // out
    ins.push_back(ONNX_FLOAT);  // lse
    outs = std::vector<ONNXTensorElementDataType>(packed ? 1 : 3, t);
  } else {
    outs = {t, ONNX_FLOAT};
  }
  Operator op{};
  set_entry(&op, kOpVersion, op_name, cuda, ins, outs, create_kernel, destroy_kernel, compute);
  op.backward = backward;
  op.bias = bias;
  op.packed = packed;
  op.product = op.matmul = op.to_float = op.ctc = false;
  op.type = t;
  return op;
}

// CTCLoss (log_probs, targets, input_lengths, target_lengths) -> loss; CTCLossGrad (grad, ...) -> grad_log_probs
Operator make_ctc(bool backward, bool cuda, ONNXTensorElementDataType t) {
  std::vector<ONNXTensorElementDataType> ins = {t, ONNX_INT64, ONNX_INT64, ONNX_INT64};
  if (backward) ins.insert(ins.begin(), t);
  Operator op{};
  set_entry(&op, kOpVersion, backward ? "CTCLossGrad" : "CTCLoss", cuda, ins, {t}, create_kernel, destroy_kernel,
            compute);
  op.backward = backward;
  op.bias = op.packed = op.product = op.matmul = op.to_float = false;
  op.ctc = true;
  op.type = t;
  return op;
}

// LSTMLayer (7 inputs) -> (y, hy, cy, workspace); LSTMLayerGrad (14 inputs) -> 7 gradients; the CPU's, float32
Operator make_lstm(bool backward) {
  std::vector<ONNXTensorElementDataType> ins(backward ? 14 : 7, ONNX_FLOAT), outs(backward ? 7 : 4, ONNX_FLOAT);
  (backward ? ins[10] : outs[3]) = ONNX_INT64;  // the workspace's key
  Operator op{};
  set_entry(&op, kOpVersion, backward ? "LSTMLayerGrad" : "LSTMLayer", false, ins, outs, create_kernel,
            destroy_kernel, compute);
  op.backward = backward;
  op.lstm = true;
  op.type = ONNX_FLOAT;
  return op;
}

// Conv (x, w) -> y; BiasConv (x, w, b) -> y; ConvGrad (dy, x, w) -> (dx, dw); ConvWeightGrad (dy, x, w) -> dw;
// ThresholdGrad (dy, y) -> dx; the CPU's, float32
Operator make_conv(ConvOp kind, bool bias = false) {
  static const char* const names[] = {"", "Conv", "ConvGrad", "ConvWeightGrad", "ThresholdGrad"};
  const char* name = bias ? "BiasConv" : names[static_cast<int>(kind)];
  const size_t inputs = kind == ConvOp::kForward ? (bias ? 3 : 2) : kind == ConvOp::kThresholdGrad ? 2 : 3,
               outputs = kind == ConvOp::kGrad ? 2 : 1;
  Operator op{};
  set_entry(&op, kOpVersion, name, false, std::vector<ONNXTensorElementDataType>(inputs, ONNX_FLOAT),
            std::vector<ONNXTensorElementDataType>(outputs, ONNX_FLOAT), create_kernel, destroy_kernel, compute);
  op.backward = kind != ConvOp::kForward;
  op.bias = bias;
  op.conv = kind;
  op.type = ONNX_FLOAT;
  return op;
}

// BatchNormGrad (dy, x, w, save_mean, save_invstd) -> (dx, dw, db); BatchNormTraining (x, w, b, running_mean,
// running_var) -> (y, save_mean, save_invstd, new_running_mean, new_running_var); the CPU's, float32
Operator make_batch_norm(bool backward) {
  Operator op{};
  set_entry(&op, kOpVersion, backward ? "BatchNormGrad" : "BatchNormTraining", false,
            std::vector<ONNXTensorElementDataType>(5, ONNX_FLOAT),
            std::vector<ONNXTensorElementDataType>(backward ? 3 : 5, ONNX_FLOAT), create_kernel, destroy_kernel,
            compute);
  op.backward = backward;
  op.batch_norm = true;
  op.type = ONNX_FLOAT;
  return op;
}

// Gemm / MatMul (a, b) -> y, BiasGemm (a, b, c) -> y, all of dtype t; ...ToFloat (a, b) -> y float32
Operator make_product(const char* op_name, bool bias, bool cuda, ONNXTensorElementDataType t) {
  Operator op{};
  const std::string name = op_name;
  op.to_float = name.size() > 7 && name.compare(name.size() - 7, 7, "ToFloat") == 0;
  set_entry(&op, kOpVersion, op_name, cuda, std::vector<ONNXTensorElementDataType>(bias ? 3 : 2, t),
            {op.to_float ? ONNX_FLOAT : t}, create_kernel, destroy_kernel, compute);
  op.backward = op.packed = op.ctc = false;
  op.bias = bias;
  op.product = true;
  op.matmul = name.rfind("MatMul", 0) == 0;
  op.type = t;
  return op;
}

const std::vector<Operator>& operators() {
  static const std::vector<Operator> all = [] {
    std::vector<Operator> ops;
#ifdef ORT_TRAINER_TORCH_CUDA
    const bool providers[] = {false, true};
#else
    const bool providers[] = {false};
#endif
    for (bool cuda : providers)
      for (ONNXTensorElementDataType t : {ONNX_FLOAT, ONNX_DOUBLE})
        for (bool backward : {false, true}) ops.push_back(make_ctc(backward, cuda, t));
    for (bool backward : {false, true}) ops.push_back(make_lstm(backward));
    for (ConvOp kind : {ConvOp::kGrad, ConvOp::kWeightGrad, ConvOp::kThresholdGrad}) ops.push_back(make_conv(kind));
    for (bool bias : {false, true}) ops.push_back(make_conv(ConvOp::kForward, bias));
    for (bool backward : {false, true}) ops.push_back(make_batch_norm(backward));
    for (bool cuda : providers)
      for (ONNXTensorElementDataType t : {ONNX_FLOAT, ONNX_FLOAT16, ONNX_BFLOAT16}) {
        ops.push_back(make_operator("Attention", false, false, cuda, t));
        ops.push_back(make_operator("BiasAttention", false, true, cuda, t));
        ops.push_back(make_operator("AttentionGrad", true, false, cuda, t));
        ops.push_back(make_operator("BiasAttentionGrad", true, true, cuda, t));
        ops.push_back(make_operator("PackedAttention", false, false, cuda, t, true));
        ops.push_back(make_operator("PackedBiasAttention", false, true, cuda, t, true));
        ops.push_back(make_operator("PackedAttentionGrad", true, false, cuda, t, true));
        ops.push_back(make_operator("PackedBiasAttentionGrad", true, true, cuda, t, true));
        ops.push_back(make_product("Gemm", false, cuda, t));
        ops.push_back(make_product("BiasGemm", true, cuda, t));
        ops.push_back(make_product("MatMul", false, cuda, t));
        if (t != ONNX_FLOAT) {
          ops.push_back(make_product("GemmToFloat", false, cuda, t));
          ops.push_back(make_product("MatMulToFloat", false, cuda, t));
        }
      }
    return ops;
  }();
  return all;
}

}  // namespace
}  // namespace ort_trainer_kernels

ORTT_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  using namespace ort_trainer_kernels;
  return register_operators(options, base, kOpVersion, "ort_trainer.torch", operators());
}

ORTT_EXPORT int OrtTrainerTorchOpsHaveCuda() {
#ifdef ORT_TRAINER_TORCH_CUDA
  return 1;
#else
  return 0;
#endif
}
