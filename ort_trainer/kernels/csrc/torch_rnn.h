// LSTM layers by oneDNN's kernels, as eager PyTorch trains nn.LSTM on the CPU (graph/export/fused_lstm.py); part of
// the torch operators' library (torch_ops.cc includes it). CPU, float32; attributes reverse and train (ints 0/1):
//   LSTMLayer(x, w_ih, w_hh, b_ih, b_hh, h0, c0) -> (y, hy, cy, workspace)
//                                             one layer in one direction (reverse: from the last step) over x
//                                             [steps, batch, features] from h0, c0 [batch, hidden] (aten::
//                                             mkldnn_rnn_layer): y [steps, batch, hidden], the final states, and
//                                             the key (int64 [1]) of oneDNN's workspace, which the library keeps
//                                             for the backward (0: none, unless train)
//   LSTMLayerGrad(x, w_ih, w_hh, b_ih, b_hh, h0, c0, y, hy, cy, workspace, dy, dhy, dcy)
//       -> (dx, dw_ih, dw_hh, db_ih, db_hh, dh0, dc0)
//                                             aten::mkldnn_rnn_layer_backward from the workspace the key names,
//                                             which it then releases
// A workspace is tens of MB (oneDNN keeps every step's gates and states: 49 MB for 50 steps of 64 sequences, 128
// features, hidden 256): ONNX Runtime's outputs are its own buffers, and copying it into one held it twice. So
// torch keeps it, one per forward node (a node's next forward replaces what a failed run left), until the backward.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ort_io.h"
#include "torch_io.h"

namespace ort_trainer_kernels {

constexpr int64_t kOneDnnLstm = 2;  // ideep::rnn_kind::LSTM, the mode ATen's oneDNN RNN kernels take

// The workspaces the forward nodes keep for their backwards, by key: the forward node's own (its kernel's address)
class Workspaces {
 public:
  static Workspaces& all() {
    static Workspaces workspaces;
    return workspaces;
  }
  void keep(int64_t key, at::Tensor workspace) {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_[key] = std::move(workspace);
  }
  std::optional<at::Tensor> take(int64_t key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = kept_.find(key);
    if (found == kept_.end()) return std::nullopt;
    at::Tensor workspace = std::move(found->second);
    kept_.erase(found);
    return workspace;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<int64_t, at::Tensor> kept_;
};

// LSTMLayer, or LSTMLayerGrad where `backward` (the file's head); `node`: the kernel's address
inline OrtStatus* compute_lstm(const OrtApi* api, OrtKernelContext* context, const std::string& name, bool backward,
                               bool reverse, bool train, const void* node) {
  const size_t count = backward ? 14 : 7;
  std::vector<Tensor> in(count);
  for (size_t i = 0; i < count; ++i) ORTT_RETURN_IF_ERROR(input(api, context, i, &in[i]));
  if (in[0].dims.size() != 3 || in[2].dims.size() != 2 || in[5].dims.size() != 2 || in[6].dims.size() != 2 ||
      (backward && in[10].size != 1))
    return fail(api, name + ": x must be [steps, batch, features], w_hh [4 x hidden, hidden], h0 and c0 [batch, "
                            "hidden] (and the workspace's key [1])");
  try {
    std::vector<at::Tensor> t;
    for (size_t i = 0; i < count; ++i) t.push_back(i == 10 ? at::Tensor() : float32_tensor(in[i]));
    const int64_t hidden = t[2].size(1);
    c10::AutoGradMode grad_mode(true);  // the forward keeps its workspace only where autograd may ask for it
    std::vector<at::Tensor> results;
    if (!backward) {
      auto [y, hy, cy, workspace] = at::mkldnn_rnn_layer(t[0], t[1], t[2], t[3], t[4], t[5], t[6], reverse, {},
                                                         kOneDnnLstm, hidden, 1, true, false, false, train);
      int64_t key = 0;
      if (train && workspace.defined()) {
        key = static_cast<int64_t>(reinterpret_cast<intptr_t>(node));
        Workspaces::all().keep(key, std::move(workspace));
      }
      results = {y, hy, cy, at::full({1}, key, at::TensorOptions().dtype(at::kLong))};
    } else {
      std::optional<at::Tensor> workspace = Workspaces::all().take(*static_cast<const int64_t*>(in[10].data));
      if (!workspace)
        return fail(api, name + ": the forward node kept no workspace for this backward (its attribute train is 0, "
                                "or another run took it)");
      auto grads = at::mkldnn_rnn_layer_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[11],
                                                 t[12], t[13], reverse, kOneDnnLstm, hidden, 1, true, true, false, {},
                                                 false, *workspace);
      results = {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads), std::get<3>(grads),
                 std::get<4>(grads), std::get<5>(grads), std::get<6>(grads)};
    }
    return write_outputs(api, context, results);
  } catch (const std::exception& error) {
    return fail(api, name + ": " + error.what());
  }
}

}  // namespace ort_trainer_kernels
