// V consecutive elements of a tensor in one load or store (the CUDA kernels' rows): a thread that moves 8 or 16 bytes
// at a time keeps more of a memory-bound kernel's bytes in flight than one that moves 2 or 4. Each element is widened
// to float32 as it is loaded (cuda_types.cuh's to_float) and rounded to the tensor's dtype as it is stored.
#pragma once

#include <stdint.h>

#include "cuda_types.cuh"

namespace ort_trainer_kernels {

// V elements of T, aligned as one access of their size
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <int V, typename T>
__device__ __forceinline__ void load(const T* p, float (&out)[V]) {
  const Pack<T, V> pack = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] = to_float(pack.v[k]);
}

template <int V, typename T>
__device__ __forceinline__ void store(T* p, const float (&values)[V]) {
  Pack<T, V> pack;
#pragma unroll
  for (int k = 0; k < V; ++k) pack.v[k] = from_float<T>(values[k]);
  *reinterpret_cast<Pack<T, V>*>(p) = pack;
}

// whether a pointer (nullptr: none, which passes) lies on the boundary of V elements of T: rows of a multiple of V
// elements then keep every row's start there
template <int V, typename T>
inline bool aligned_for(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * V) == 0;
}

// launch.template operator()<V>() where `vectors`, else launch.template operator()<1>(): a kernel launched at its
// vector width, or an element at a time
template <int V, typename Launch>
void at_width(bool vectors, Launch&& launch) {
  if (vectors)
    launch.template operator()<V>();
  else
    launch.template operator()<1>();
}

}  // namespace ort_trainer_kernels
