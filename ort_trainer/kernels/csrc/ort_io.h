// A custom-operator library's side of ONNX Runtime's C ABI (ort_abi.h): what a run reads and writes (its inputs' and
// outputs' data and shapes, a failed run's status), each operator's entry in ONNX Runtime's table, and the
// registration of a library's operators. Shared by the kernel library (ops.cc) and the torch operators
// (torch_ops.cc).
#pragma once

#include <stdint.h>

#include <algorithm>
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

// how many tensors the node gives the run (a variadic last input's count of them included)
inline OrtStatus* input_count(const OrtApi* api, OrtKernelContext* context, size_t* count) {
  using namespace ort_abi;
  return slot<KernelContextGetInputCount>(api, kKernelContextGetInputCount)(context, count);
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

// ---- an operator's entry in ONNX Runtime's table ----------------------------------------------------------------
// Its name, provider and dtypes; each library's operator struct derives from it and adds what its kernels read.
struct OperatorEntry : OrtCustomOp {
  const char* name;
  bool cuda;  // the CUDA provider's, else the CPU's
  size_t inputs, outputs;
  bool variadic;         // the last input variadic: one or more tensors of its dtype
  bool variadic_output;  // the last output variadic likewise
  ONNXTensorElementDataType input_types[16], output_types[16];  // (LSTMLayerGrad has 14 inputs)
};

namespace entry {
inline const OperatorEntry* of(const OrtCustomOp* op) { return static_cast<const OperatorEntry*>(op); }
inline const char* name(const OrtCustomOp* op) { return of(op)->name; }
inline const char* provider(const OrtCustomOp* op) { return of(op)->cuda ? "CUDAExecutionProvider" : nullptr; }
inline ONNXTensorElementDataType input_type(const OrtCustomOp* op, size_t index) { return of(op)->input_types[index]; }
inline ONNXTensorElementDataType output_type(const OrtCustomOp* op, size_t index) {
  return of(op)->output_types[index];
}
inline size_t input_count(const OrtCustomOp* op) { return of(op)->inputs; }
inline size_t output_count(const OrtCustomOp* op) { return of(op)->outputs; }
inline OrtCustomOpInputOutputCharacteristic input_characteristic(const OrtCustomOp* op, size_t index) {
  return of(op)->variadic && index + 1 == of(op)->inputs ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
}
inline OrtCustomOpInputOutputCharacteristic output_characteristic(const OrtCustomOp* op, size_t index) {
  return of(op)->variadic_output && index + 1 == of(op)->outputs ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
}
inline OrtMemType device_memory(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
inline int variadic_min_arity(const OrtCustomOp*) { return 1; }
inline int variadic_homogeneous(const OrtCustomOp*) { return 1; }
}  // namespace entry

// `op`'s entry: struct version `version` (16: KernelComputeV2, whose errors reach the session as a failed run), its
// name, provider and input and output dtypes, and the library's kernel functions
inline void set_entry(OperatorEntry* op, uint32_t version, const char* name, bool cuda,
                      const std::vector<ONNXTensorElementDataType>& ins,
                      const std::vector<ONNXTensorElementDataType>& outs,
                      void* (*create)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*),
                      void (*destroy)(void*), OrtStatus* (*compute)(void*, OrtKernelContext*)) {
  op->version = version;
  op->CreateKernel = create;
  op->GetName = entry::name;
  op->GetExecutionProviderType = entry::provider;
  op->GetInputType = entry::input_type;
  op->GetInputTypeCount = entry::input_count;
  op->GetOutputType = entry::output_type;
  op->GetOutputTypeCount = entry::output_count;
  op->KernelCompute = nullptr;
  op->KernelDestroy = destroy;
  op->GetInputCharacteristic = entry::input_characteristic;
  op->GetOutputCharacteristic = entry::output_characteristic;
  op->GetInputMemoryType = entry::device_memory;
  op->GetVariadicInputMinArity = entry::variadic_min_arity;
  op->GetVariadicInputHomogeneity = entry::variadic_homogeneous;
  op->GetVariadicOutputMinArity = entry::variadic_min_arity;
  op->GetVariadicOutputHomogeneity = entry::variadic_homogeneous;
  op->CreateKernelV2 = nullptr;
  op->KernelComputeV2 = compute;
  op->name = name;
  op->cuda = cuda;
  op->inputs = ins.size();
  op->outputs = outs.size();
  op->variadic = false;
  op->variadic_output = false;
  std::copy(ins.begin(), ins.end(), op->input_types);
  std::copy(outs.begin(), outs.end(), op->output_types);
}

// a library's RegisterCustomOps: `ops` (kept by ONNX Runtime for the process's life) in the domain `domain_name`,
// added to `options`; nothing registered with a runtime older than `version` (a session of a graph with these
// operators then says they are missing)
template <typename Operator>
OrtStatus* register_operators(OrtSessionOptions* options, const OrtApiBase* base, uint32_t version,
                              const char* domain_name, const std::vector<Operator>& ops) {
  using namespace ort_abi;
  const OrtApi* api = base->GetApi(version);
  if (api == nullptr) return nullptr;
  OrtCustomOpDomain* domain = nullptr;
  ORTT_RETURN_IF_ERROR(slot<CreateCustomOpDomain>(api, kCreateCustomOpDomain)(domain_name, &domain));
  for (const auto& op : ops) ORTT_RETURN_IF_ERROR(slot<CustomOpDomainAdd>(api, kCustomOpDomainAdd)(domain, &op));
  // the domain is left to the process (ONNX Runtime's sessions refer to it; one a registration)
  return slot<AddCustomOpDomain>(api, kAddCustomOpDomain)(options, domain);
}

}  // namespace ort_trainer_kernels
