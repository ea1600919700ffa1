// The CUDA kernel of AddHalf (ops.cc): a float32 (or half-precision) sum plus half-precision tensors, each widened,
// one float32 add an element and tensor, in order, as Casts to float32 and a chain of Adds compute it (one read of
// each input, one write). 4 elements a thread and step where every tensor is aligned for them and the count a
// multiple of 4, one otherwise.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"
#include "vector_io.cuh"

namespace ort_trainer_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // a grid-stride loop covers the rest
constexpr int kMaxAddends = 8;           // the tensors one launch adds (passed by value); more: further launches

template <typename T>
struct Addends {
  const T* x[kMaxAddends];
  int count;
};

// V elements a thread and step (n a multiple of V)
template <typename S, typename T, int V>
__global__ void add_half_elements(const S* sum, Addends<T> xs, float* out, int64_t n) {
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * V; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x * V) {
    float total[V];
    load<V>(sum + i, total);
    // (unrolled over the struct's fixed size: a loop to the run-time count would copy the parameters to local memory)
#pragma unroll
    for (int k = 0; k < kMaxAddends; ++k)
      if (k < xs.count) {
        float x[V];
        load<V>(xs.x[k] + i, x);
#pragma unroll
        for (int j = 0; j < V; ++j) total[j] = __fadd_rn(total[j], x[j]);
      }
    store<V>(out + i, total);
  }
}

template <int V, typename S, typename T>
void launch_elements(const S* sum, const Addends<T>& addends, float* out, int64_t n, cudaStream_t s) {
  int64_t blocks = (n / V + kThreads - 1) / kThreads;
  blocks = blocks > kMaxBlocks ? kMaxBlocks : blocks;
  add_half_elements<S, T, V><<<blocks, kThreads, 0, s>>>(sum, addends, out, n);
}

// sum (of S) plus the xs in launches of up to kMaxAddends, each after the first adding to out
template <typename S, typename T>
void launch(const void* sum, const void* const* xs, int count, float* out, int64_t n, cudaStream_t s) {
  constexpr int V = 4;
  bool vectors = n % V == 0 && aligned_for<V>(static_cast<const S*>(sum)) && aligned_for<V>(out);
  for (int k = 0; k < count; ++k) vectors = vectors && aligned_for<V>(static_cast<const T*>(xs[k]));
  for (int first = 0; first < count; first += kMaxAddends) {
    Addends<T> addends{};
    addends.count = count - first < kMaxAddends ? count - first : kMaxAddends;
    for (int k = 0; k < addends.count; ++k) addends.x[k] = static_cast<const T*>(xs[first + k]);
    at_width<V>(vectors, [&]<int W>() {
      if (first == 0)
        launch_elements<W>(static_cast<const S*>(sum), addends, out, n, s);
      else
        launch_elements<W>(static_cast<const float*>(out), addends, out, n, s);
    });
  }
}

}  // namespace

const char* add_half_cuda(ElementType type, ElementType sum_type, const void* sum, const void* const* xs, int count,
                          float* out, int64_t n, void* stream) {
  if (n == 0 || count == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // a float32 sum and xs of any dtype, or a half sum and xs of its dtype
  if (sum_type == ElementType::kFloat) {
    switch (type) {
      case ElementType::kFloat: launch<float, float>(sum, xs, count, out, n, s); break;
      case ElementType::kFloat16: launch<float, __half>(sum, xs, count, out, n, s); break;
      case ElementType::kBFloat16: launch<float, __nv_bfloat16>(sum, xs, count, out, n, s); break;
    }
  } else if (sum_type != type) {
    return "unsupported dtypes";
  } else if (type == ElementType::kFloat16) {
    launch<__half, __half>(sum, xs, count, out, n, s);
  } else {
    launch<__nv_bfloat16, __nv_bfloat16>(sum, xs, count, out, n, s);
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
