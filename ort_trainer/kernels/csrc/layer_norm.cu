// The CUDA kernels of LayerNormTo* (the forward, a row a block: its mean, then its variance about it, then y in the
// half dtype) and of LayerNormGrad and LayerNormGradAdd (ops.cc; the arithmetic: layer_norm.h), in float32
// whatever the tensors' dtypes (T: x, mean, rstd, the residual and dx; D: dy; C: dx's cast; G: gamma, dgamma and
// dbeta):
//   rows:    one block a row: the row's two sums (of g and of g * xhat) reduced in the block, then dx (plus the
//            residual, and its cast to D); 4 consecutive columns a thread and step where every row starts on a
//            boundary of 4 elements of each tensor (a multiple of 4 columns, aligned tensors), one otherwise
//   columns: dgamma and dbeta's sums over each chunk of rows, a (32 columns x 8 rows) block a chunk and 32
//            columns, into partials [chunks, 2, cols]
//   finish:  partials summed over the chunks, in order: the same bits on every run
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_types.cuh"
#include "kernels.h"
#include "layer_norm.h"
#include "vector_io.cuh"

namespace ort_trainer_kernels {
namespace {

// the sum of each of v's two values over the block (blockDim.x a multiple of 32, at most 1024), in every thread
__device__ float2 block_sum(float2 v) {
  __shared__ float2 warp_sums[32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, offset);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, offset);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = threadIdx.x < (blockDim.x >> 5) ? warp_sums[lane] : make_float2(0.0f, 0.0f);
    for (int offset = 16; offset > 0; offset >>= 1) {
      v.x += __shfl_xor_sync(0xffffffffu, v.x, offset);
      v.y += __shfl_xor_sync(0xffffffffu, v.y, offset);
    }
    if (lane == 0) warp_sums[0] = v;
  }
  __syncthreads();
  return warp_sums[0];
}

// dy, gamma and x at columns c .. c + V - 1 of a row, widened
template <int V, typename T, typename G, typename D>
__device__ __forceinline__ void load_columns(const D* dy_row, const G* gamma, const T* x_row, int64_t c, float (&d)[V],
                                             float (&gm)[V], float (&xs)[V]) {
  load<V>(dy_row + c, d);
  load<V>(gamma + c, gm);
  load<V>(x_row + c, xs);
}

// V columns a thread and step (1, or 4 where every row's start is aligned for them)
template <typename T, typename G, typename D, typename C, int V>
__global__ void rows_kernel(const D* dy, const T* x, const T* mean, const T* rstd, const G* gamma, const T* residual,
                            T* dx, C* dx_cast, int64_t cols) {
  const int64_t row = blockIdx.x;
  const D* dy_row = dy + row * cols;
  const T* x_row = x + row * cols;
  T* dx_row = dx + row * cols;
  const float m = to_float(mean[row]), r = to_float(rstd[row]);
  float2 sums = make_float2(0.0f, 0.0f);
  for (int64_t c = threadIdx.x * static_cast<int64_t>(V); c < cols; c += static_cast<int64_t>(blockDim.x) * V) {
    float d[V], gm[V], xs[V];
    load_columns(dy_row, gamma, x_row, c, d, gm, xs);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = d[k] * gm[k];
      sums.x += g;
      sums.y += g * ((xs[k] - m) * r);
    }
  }
  sums = block_sum(sums);
  const float mean_g = sums.x / static_cast<float>(cols), mean_gx = sums.y / static_cast<float>(cols);
  for (int64_t c = threadIdx.x * static_cast<int64_t>(V); c < cols; c += static_cast<int64_t>(blockDim.x) * V) {
    float d[V], gm[V], xs[V], out[V];
    load_columns(dy_row, gamma, x_row, c, d, gm, xs);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = d[k] * gm[k];
      const float xhat = (xs[k] - m) * r;
      out[k] = to_float(from_float<T>(r * (g - mean_g - xhat * mean_gx)));
    }
    if (residual != nullptr) {  // the Add node's one rounded add (__fadd_rn: never contracted into the product above)
      float res[V];
      load<V>(residual + row * cols + c, res);
#pragma unroll
      for (int k = 0; k < V; ++k) out[k] = to_float(from_float<T>(__fadd_rn(res[k], out[k])));
    }
    store<V>(dx_row + c, out);  // (each out[k] a value of T: stored exactly)
    if (dx_cast != nullptr) store<V>(dx_cast + row * cols + c, out);
  }
}

// V columns a thread and step (1, or 4 where every row's start is aligned for them)
template <typename H, int V>
__global__ void forward_kernel(const float* x, const H* branch, float* sum, const float* gamma, const float* beta,
                               H* y, float* y32, float* mean, float* rstd, int64_t cols, float epsilon) {
  const int64_t row = blockIdx.x;
  const float* x_row = x + row * cols;
  const int64_t first = threadIdx.x * static_cast<int64_t>(V), step = static_cast<int64_t>(blockDim.x) * V;
  float2 sums = make_float2(0.0f, 0.0f);
  if (branch != nullptr) {
    // x + branch written to sum, which the passes below read (each thread the elements it wrote)
    float* sum_row = sum + row * cols;
    for (int64_t c = first; c < cols; c += step) {
      float xs[V], bs[V];
      load<V>(x_row + c, xs);
      load<V>(branch + row * cols + c, bs);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        xs[k] = __fadd_rn(xs[k], bs[k]);
        sums.x += xs[k];
      }
      store<V>(sum_row + c, xs);
    }
    x_row = sum_row;
  } else {
    for (int64_t c = first; c < cols; c += step) {
      float xs[V];
      load<V>(x_row + c, xs);
#pragma unroll
      for (int k = 0; k < V; ++k) sums.x += xs[k];
    }
  }
  const float m = block_sum(sums).x / static_cast<float>(cols);
  __syncthreads();  // (every thread has read the first sum before block_sum's buffer takes the second)
  sums = make_float2(0.0f, 0.0f);
  for (int64_t c = first; c < cols; c += step) {
    float xs[V];
    load<V>(x_row + c, xs);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float d = xs[k] - m;
      sums.x += d * d;
    }
  }
  const float r = rsqrtf(block_sum(sums).x / static_cast<float>(cols) + epsilon);
  for (int64_t c = first; c < cols; c += step) {
    float xs[V], gs[V], bs[V];
    load<V>(x_row + c, xs);
    load<V>(gamma + c, gs);
    load<V>(beta + c, bs);
#pragma unroll
    for (int k = 0; k < V; ++k) xs[k] = (xs[k] - m) * r * gs[k] + bs[k];
    store<V>(y + row * cols + c, xs);
    if (y32 != nullptr) store<V>(y32 + row * cols + c, xs);
  }
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

constexpr int kColumnWidth = 32, kColumnDepth = 8;

template <typename T, typename D>
__global__ void columns_kernel(const D* dy, const T* x, const T* mean, const T* rstd, float* partials, int64_t rows,
                               int64_t cols, int64_t rows_per_chunk) {
  __shared__ float sums_g[kColumnDepth][kColumnWidth + 1], sums_b[kColumnDepth][kColumnWidth + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnWidth + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  float g = 0.0f, b = 0.0f;
  if (c < cols) {
    for (int64_t row = begin + threadIdx.y; row < end; row += kColumnDepth) {
      const float d = to_float(dy[row * cols + c]);
      g += d * ((to_float(x[row * cols + c]) - to_float(mean[row])) * to_float(rstd[row]));
      b += d;
    }
  }
  sums_g[threadIdx.y][threadIdx.x] = g;
  sums_b[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int k = 1; k < kColumnDepth; ++k) {
      g += sums_g[k][threadIdx.x];
      b += sums_b[k][threadIdx.x];
    }
    partials[(static_cast<int64_t>(blockIdx.y) * 2) * cols + c] = g;
    partials[(static_cast<int64_t>(blockIdx.y) * 2 + 1) * cols + c] = b;
  }
}

template <typename G>
__global__ void finish_kernel(const float* partials, G* dgamma, G* dbeta, int64_t cols, int64_t chunks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float g = 0.0f, b = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) {
    g += partials[(k * 2) * cols + c];
    b += partials[(k * 2 + 1) * cols + c];
  }
  dgamma[c] = from_float<G>(g);
  dbeta[c] = from_float<G>(b);
}

}  // namespace

namespace {

// the tensors of one launch
struct Arguments {
  const void *dy, *x, *mean, *rstd, *gamma, *residual;
  void *dx, *dx_cast, *dgamma, *dbeta;
  float* partials;
  int64_t rows, cols, chunks;
};

// a row's block: a thread for each step of V columns, in whole warps, at most 256
int row_threads(int64_t cols, int vector) {
  const int64_t rounded = ((cols + vector - 1) / vector + 31) / 32 * 32;
  return static_cast<int>(rounded < 256 ? rounded : 256);
}

template <typename T, typename G, typename D, typename C>
void launch(const Arguments& a, cudaStream_t s) {
  constexpr int kVector = 4;
  const bool vectors = a.cols % kVector == 0 && aligned_for<kVector>(static_cast<const D*>(a.dy)) &&
                       aligned_for<kVector>(static_cast<const T*>(a.x)) &&
                       aligned_for<kVector>(static_cast<const G*>(a.gamma)) &&
                       aligned_for<kVector>(static_cast<const T*>(a.residual)) &&
                       aligned_for<kVector>(static_cast<T*>(a.dx)) && aligned_for<kVector>(static_cast<C*>(a.dx_cast));
  at_width<kVector>(vectors, [&]<int V>() {
    rows_kernel<T, G, D, C, V><<<static_cast<unsigned>(a.rows), row_threads(a.cols, V), 0, s>>>(
        static_cast<const D*>(a.dy), static_cast<const T*>(a.x), static_cast<const T*>(a.mean),
        static_cast<const T*>(a.rstd), static_cast<const G*>(a.gamma), static_cast<const T*>(a.residual),
        static_cast<T*>(a.dx), static_cast<C*>(a.dx_cast), a.cols);
  });
  const int64_t rows_per_chunk = (a.rows + a.chunks - 1) / a.chunks;
  const dim3 grid(static_cast<unsigned>((a.cols + kColumnWidth - 1) / kColumnWidth), static_cast<unsigned>(a.chunks));
  columns_kernel<T, D><<<grid, dim3(kColumnWidth, kColumnDepth), 0, s>>>(
      static_cast<const D*>(a.dy), static_cast<const T*>(a.x), static_cast<const T*>(a.mean),
      static_cast<const T*>(a.rstd), a.partials, a.rows, a.cols, rows_per_chunk);
  finish_kernel<G><<<static_cast<unsigned>((a.cols + 255) / 256), 256, 0, s>>>(
      a.partials, static_cast<G*>(a.dgamma), static_cast<G*>(a.dbeta), a.cols, a.chunks);
}

// calls run.template operator()<float / __half / __nv_bfloat16>() for `type`
template <typename Run>
void with_type(ElementType type, Run&& run) {
  switch (type) {
    case ElementType::kFloat: run.template operator()<float>(); break;
    case ElementType::kFloat16: run.template operator()<__half>(); break;
    case ElementType::kBFloat16: run.template operator()<__nv_bfloat16>(); break;
  }
}

bool known(ElementType type) {
  return type == ElementType::kFloat || type == ElementType::kFloat16 || type == ElementType::kBFloat16;
}

}  // namespace

const char* layer_norm_cast_cuda(ElementType type, const float* x, const void* branch, float* sum, const float* gamma,
                                 const float* beta, void* y, float* y32, float* mean, float* rstd, int64_t rows,
                                 int64_t cols, float epsilon, void* stream) {
  if (rows == 0 || cols == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (type != ElementType::kFloat16 && type != ElementType::kBFloat16) return "unsupported dtype";
  with_type(type, [&]<typename H>() {
    constexpr int kVector = 4;
    const H* b = static_cast<const H*>(branch);
    H* out = static_cast<H*>(y);
    const bool vectors = cols % kVector == 0 && aligned_for<kVector>(x) && aligned_for<kVector>(b) &&
                         aligned_for<kVector>(sum) && aligned_for<kVector>(gamma) && aligned_for<kVector>(beta) &&
                         aligned_for<kVector>(out) && aligned_for<kVector>(y32);
    at_width<kVector>(vectors, [&]<int V>() {
      forward_kernel<H, V><<<static_cast<unsigned>(rows), row_threads(cols, V), 0, s>>>(
          x, b, sum, gamma, beta, out, y32, mean, rstd, cols, epsilon);
    });
  });
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

const char* layer_norm_grad_cuda(ElementType t, ElementType d, ElementType c, ElementType g, const void* dy,
                                 const void* x, const void* mean, const void* rstd, const void* gamma,
                                 const void* residual, void* dx, void* dx_cast, void* dgamma, void* dbeta,
                                 float* partials, int64_t rows, int64_t cols, int64_t chunks, void* stream) {
  if (cols == 0) return nullptr;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const Arguments arguments{dy, x, mean, rstd, gamma, residual, dx, dx_cast, dgamma, dbeta, partials, rows, cols,
                            chunks};
  if (!known(t) || !known(d) || !known(c) || !known(g)) return "unsupported dtype";
  if (rows == 0) {  // an empty batch: no dx to write, dgamma and dbeta zeros (the sums of nothing), as on the CPU
    const cudaError_t cleared = cudaMemsetAsync(partials, 0, sizeof(float) * 2 * chunks * cols, s);
    if (cleared != cudaSuccess) return cudaGetErrorString(cleared);
    with_type(g, [&]<typename G>() {
      finish_kernel<G><<<static_cast<unsigned>((cols + 255) / 256), 256, 0, s>>>(
          partials, static_cast<G*>(dgamma), static_cast<G*>(dbeta), cols, chunks);
    });
    const cudaError_t error = cudaGetLastError();
    return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
  }
  if (c != d) {  // (LayerNormGradTo*: a float32 LayerNorm's gradient cast to half)
    if (t != ElementType::kFloat || g != ElementType::kFloat || d != ElementType::kFloat) return "unsupported dtype";
    with_type(c, [&]<typename C>() { launch<float, float, float, C>(arguments, s); });
  } else {
    with_type(t, [&]<typename T>() {
      with_type(g, [&]<typename G>() {
        with_type(d, [&]<typename D>() { launch<T, G, D, D>(arguments, s); });
      });
    });
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace ort_trainer_kernels
