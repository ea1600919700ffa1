// The part of ONNX Runtime's C ABI that ops.cc calls, declared from the ABI's facts (the runtime ships no
// headers with its Python wheels): the API table's slots by index and the custom operator's struct. ONNX Runtime
// only appends to both (its onnxruntime_c_api.cc asserts the offsets of older slots), so an index below holds in
// every release from the version the operator struct declares (16: ONNX Runtime 1.16) on.
#pragma once

#include <stddef.h>
#include <stdint.h>

struct OrtStatus;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtCustomOp;

enum OrtErrorCode { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, ORT_RUNTIME_EXCEPTION = 6 };
// (ONNX_UNDEFINED: an input of any dtype)
enum ONNXTensorElementDataType {
  ONNX_UNDEFINED = 0,
  ONNX_FLOAT = 1,
  ONNX_INT64 = 7,
  ONNX_BOOL = 9,
  ONNX_FLOAT16 = 10,
  ONNX_DOUBLE = 11,
  ONNX_BFLOAT16 = 16
};
enum OrtCustomOpInputOutputCharacteristic { INPUT_OUTPUT_REQUIRED = 0, INPUT_OUTPUT_VARIADIC = 2 };
enum OrtMemType { OrtMemTypeDefault = 0 };

// the API table: a slot is one function pointer, named here by its index
struct OrtApi {
  void* slots[204];
};

// the slots ops.cc calls (index: signature). 193 (the CUDA path's only one): onnxruntime_c_api.cc's table asserts
// that version 8 ends at 169; version 9 appends 22 entries (TensorRT options, custom-op switch, allocators,
// sparse tensors), and version 10 begins HasValue (192), KernelContext_GetGPUComputeStream (193). 163: version 8's
// eight entries (162-169) begin KernelInfoGetAttributeArray_float, KernelInfoGetAttributeArray_int64
namespace ort_abi {
using CreateStatus = OrtStatus* (*)(OrtErrorCode, const char*);                                   // 0
using CreateCustomOpDomain = OrtStatus* (*)(const char*, OrtCustomOpDomain**);                     // 26
using CustomOpDomainAdd = OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*);                 // 27
using AddCustomOpDomain = OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*);                  // 28
using GetTensorMutableData = OrtStatus* (*)(OrtValue*, void**);                                    // 51
using GetTensorElementType = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, ONNXTensorElementDataType*);  // 60
using GetDimensionsCount = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*);              // 61
using GetDimensions = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t);          // 62
using GetTensorShapeElementCount = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*);      // 64
using GetTensorTypeAndShape = OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**);        // 65
using KernelInfoGetAttributeFloat = OrtStatus* (*)(const OrtKernelInfo*, const char*, float*);     // 85
using KernelInfoGetAttributeInt64 = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*);   // 86
using KernelContextGetInputCount = OrtStatus* (*)(const OrtKernelContext*, size_t*);              // 88
using KernelContextGetInput = OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**);   // 90
using KernelContextGetOutput = OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);  // 91
using ReleaseStatus = void (*)(OrtStatus*);                                                        // 93
using ReleaseTensorTypeAndShapeInfo = void (*)(OrtTensorTypeAndShapeInfo*);                        // 99
// (out nullptr: the count in *size; else up to *size values, the count in *size; an error where more)
using KernelInfoGetAttributeArrayInt64 = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*, size_t*);  // 163
using KernelContextGetGPUComputeStream = OrtStatus* (*)(const OrtKernelContext*, void**);          // 193

enum Slot : int {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetTensorElementType = 60,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorShapeElementCount = 64,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInputCount = 88,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelInfoGetAttributeArrayInt64 = 163,
  kKernelContextGetGPUComputeStream = 193,
};

template <typename Function>
Function slot(const OrtApi* api, Slot index) {
  return reinterpret_cast<Function>(api->slots[index]);
}
}  // namespace ort_abi

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// a custom operator: `version`, then function pointers that ONNX Runtime reads up to the version's
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);  // nullptr: the CPU provider
  ONNXTensorElementDataType (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  ONNXTensorElementDataType (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);  // used where KernelComputeV2 is nullptr
  void (*KernelDestroy)(void* kernel);
  OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);   // 8
  OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);  // 8
  OrtMemType (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);                                 // 13
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);                                                // 14
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,  // 16
                                void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);  // 16
  // version 17: shape inference (none here) and the opset range
  void* InferOutputShapeFn;
  int (*GetStartVersion)(const OrtCustomOp* op);
  int (*GetEndVersion)(const OrtCustomOp* op);
  // version 18: the outputs that may reuse an input's buffer (in-place) and those that are an input's buffer
  // (aliases: the output is the input, never written), as two arrays of indices the operator allocates, their
  // length the result, freed by the Release function
  size_t (*GetMayInplace)(int** input_index, int** output_index);
  void (*ReleaseMayInplace)(int* input_index, int* output_index);
  size_t (*GetAliasMap)(int** input_index, int** output_index);
  void (*ReleaseAliasMap)(int* input_index, int* output_index);
};

