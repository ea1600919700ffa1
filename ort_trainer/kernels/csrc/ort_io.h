// What a custom operator's run reads and writes through ONNX Runtime's C ABI (ort_abi.h): its inputs' and outputs'
// data and shapes, and a failed run's status. Shared by the kernel library (ops.cc) and the torch operators
// (torch_ops.cc).
#pragma once

#include <stdint.h>

#include <string>
#include <vector>

#include "ort_abi.h"

namespace ort_trainer_kernels {

inline OrtStatus* fail(const OrtApi* api, const std::string& message) {
  using namespace ort_abi;
  return slot<CreateStatus>(api, kCreateStatus)(ORT_RUNTIME_EXCEPTION, ("ort_trainer kernels: " + message).c_str());
}

#define ORTT_RETURN_IF_ERROR(expression)   \
  do {                                     \
    OrtStatus* status_ = (expression);     \
    if (status_ != nullptr) return status_; \
  } while (0)

struct Tensor {
  void* data = nullptr;
  std::vector<int64_t> dims;
  int64_t size = 1;  // elements
};

inline OrtStatus* input(const OrtApi* api, OrtKernelContext* context, size_t index, Tensor* tensor) {
  using namespace ort_abi;
  const OrtValue* value = nullptr;
  ORTT_RETURN_IF_ERROR(slot<KernelContextGetInput>(api, kKernelContextGetInput)(context, index, &value));
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ORTT_RETURN_IF_ERROR(slot<GetTensorTypeAndShape>(api, kGetTensorTypeAndShape)(value, &info));
  size_t rank = 0;
  OrtStatus* status = slot<GetDimensionsCount>(api, kGetDimensionsCount)(info, &rank);
  if (status == nullptr) {
    tensor->dims.resize(rank);
    status = slot<GetDimensions>(api, kGetDimensions)(info, tensor->dims.data(), rank);
  }
  slot<ReleaseTensorTypeAndShapeInfo>(api, kReleaseTensorTypeAndShapeInfo)(info);
  ORTT_RETURN_IF_ERROR(status);
  tensor->size = 1;
  for (int64_t d : tensor->dims) tensor->size *= d;
  return slot<GetTensorMutableData>(api, kGetTensorMutableData)(const_cast<OrtValue*>(value), &tensor->data);
}

inline OrtStatus* output(const OrtApi* api, OrtKernelContext* context, size_t index, const std::vector<int64_t>& dims,
                         Tensor* tensor) {
  using namespace ort_abi;
  OrtValue* value = nullptr;
  ORTT_RETURN_IF_ERROR(
      slot<KernelContextGetOutput>(api, kKernelContextGetOutput)(context, index, dims.data(), dims.size(), &value));
  tensor->dims = dims;
  tensor->size = 1;
  for (int64_t d : dims) tensor->size *= d;
  return slot<GetTensorMutableData>(api, kGetTensorMutableData)(value, &tensor->data);
}

}  // namespace ort_trainer_kernels
