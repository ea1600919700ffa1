// ONNX Runtime's CUDA memory from torch's caching allocator (device.torch_allocator): the three functions whose
// addresses the CUDA execution provider's gpu_external_alloc, gpu_external_free and gpu_external_empty_cache
// options take (ONNX Runtime then allocates through them, without an arena of its own). Built against the torch
// of the process that loads it (../torch_allocator.py), linked to its libc10_cuda. Not part of the kernel library.
//
// An allocation torch cannot make throws torch's OutOfMemoryError through ONNX Runtime, whose run fails with its
// message (what was asked for, what is free, what torch holds).
//
// Under device.cuda_graph ONNX Runtime captures a run with cudaStreamCaptureModeGlobal, in which a cudaMalloc from
// any thread ends the capture with an error. torch allows one during a capture of its current stream (its own
// captures), but ONNX Runtime's stream is not torch's current one: an allocation here switches this thread to the
// relaxed mode, in which cudaMalloc may run during a capture (the memory then stays the capture's: the trainer routes
// the capturing run's allocations to a private pool of torch's, devices.CUDADevice.capture_memory).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <cstddef>

#define ORTT_EXPORT extern "C" __attribute__((visibility("default")))

ORTT_EXPORT void* OrtTrainerTorchAlloc(size_t bytes) {
  c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
  return c10::cuda::CUDACachingAllocator::raw_alloc(bytes);
}

ORTT_EXPORT void OrtTrainerTorchFree(void* pointer) { c10::cuda::CUDACachingAllocator::raw_delete(pointer); }

ORTT_EXPORT void OrtTrainerTorchEmptyCache() { c10::cuda::CUDACachingAllocator::emptyCache(); }
