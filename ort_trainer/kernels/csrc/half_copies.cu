// The CUDA kernel of CastsToFloat16 and CastsToBFloat16 (ops.cc): many float32 tensors rounded to one half dtype in
// one launch (up to kMaxHalfCopies tensors a launch), each y zero past its x's values (a padded weight). The grid is
// split among the tensors by size: each block copies one chunk of one tensor, found by a search of the tensors' first
// blocks, which the kernel reads from its parameters as one table (__grid_constant__: no copy to each thread). 4
// elements a thread and step where a tensor's x and y are aligned for them, one otherwise.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"
#include "vector_io.cuh"

namespace ort_trainer_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWidth = 4;                          // elements a thread moves at once, where aligned
constexpr int64_t kChunk = kThreads * kWidth * 8;  // elements a block copies: 8 steps of its threads

// one launch's tensors (passed by value: 64 tensors take 2.6 KB of the 4 KB a launch's parameters may hold)
template <typename T>
struct Copies {
  const float* x[kMaxHalfCopies];
  T* y[kMaxHalfCopies];
  int64_t n[kMaxHalfCopies];
  int64_t padded[kMaxHalfCopies];
  int64_t first_block[kMaxHalfCopies + 1];  // tensor i's blocks: [first_block[i], first_block[i + 1])
  bool vectors[kMaxHalfCopies];
  int count;
};

// elements [begin, end) of y: x's values rounded, zeros from n on, V at a time where all V lie on one side of n
template <int V, typename T>
__device__ __forceinline__ void copy_chunk(const float* x, T* y, int64_t n, int64_t begin, int64_t end) {
  for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * V; i < end; i += static_cast<int64_t>(kThreads) * V) {
    float values[V];
    if (i + V <= end && (i + V <= n || i >= n)) {
      if (i < n) {
        load<V>(x + i, values);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) values[k] = 0.0f;
      }
      store<V>(y + i, values);
    } else {
      for (int64_t j = i; j < i + V && j < end; ++j) y[j] = from_float<T>(j < n ? x[j] : 0.0f);
    }
  }
}

template <typename T>
__global__ void cast_to_half_kernel(const __grid_constant__ Copies<T> copies) {
  const int64_t block = blockIdx.x;
  int low = 0, high = copies.count - 1;  // the last tensor whose first block is <= this block
  while (low < high) {
    const int middle = (low + high + 1) / 2;
    if (copies.first_block[middle] <= block)
      low = middle;
    else
      high = middle - 1;
  }
  const int64_t begin = (block - copies.first_block[low]) * kChunk;
  const int64_t end = begin + kChunk < copies.padded[low] ? begin + kChunk : copies.padded[low];
  if (copies.vectors[low])
    copy_chunk<kWidth>(copies.x[low], copies.y[low], copies.n[low], begin, end);
  else
    copy_chunk<1>(copies.x[low], copies.y[low], copies.n[low], begin, end);
}

template <typename T>
const char* launch(const HalfCopy* all, int count, cudaStream_t s) {
  for (int first = 0; first < count; first += kMaxHalfCopies) {
    Copies<T> copies{};
    int64_t blocks = 0;
    for (int k = first; k < count && k - first < kMaxHalfCopies; ++k) {
      if (all[k].padded <= 0) continue;  // (an empty tensor: no block)
      const int i = copies.count++;
      copies.x[i] = all[k].x;
      copies.y[i] = static_cast<T*>(all[k].y);
      copies.n[i] = all[k].n;
      copies.padded[i] = all[k].padded;
      copies.vectors[i] = aligned_for<kWidth>(all[k].x) && aligned_for<kWidth>(copies.y[i]);
      copies.first_block[i] = blocks;
      blocks += (all[k].padded + kChunk - 1) / kChunk;
    }
    copies.first_block[copies.count] = blocks;
    if (blocks == 0) continue;
    if (blocks > 0x7fffffff) return "too many elements for one launch";
    cast_to_half_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(copies);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return cudaGetErrorString(error);
  }
  return nullptr;
}

}  // namespace

const char* half_copies_cuda(ElementType type, const HalfCopy* copies, int count, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case ElementType::kFloat16: return launch<__half>(copies, count, s);
    case ElementType::kBFloat16: return launch<__nv_bfloat16>(copies, count, s);
    case ElementType::kFloat: break;
  }
  return "y must be float16 or bfloat16";
}

const char* device_copy_cuda(const void* src, void* dst, int64_t bytes, void* stream) {
  const cudaError_t error = cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice,
                                            static_cast<cudaStream_t>(stream));
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
