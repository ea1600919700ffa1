// A CUDA runtime on the host, for tests: ort_trainer's kernels (ort_trainer/kernels/csrc/*.cu), compiled by the C++
// compiler with their launches `k<<<grid, block, shared, stream>>>(args)` rewritten to
// `::emu::launcher(k, "k", grid, block, shared, stream)(args)` (tests/test_cuda_emulated.py), run here on the CPU.
//
// The blocks of a grid run one after another; the threads of a block are fibers (ucontext) of one host thread: a wait
// at a __syncthreads or a warp's shuffle ends when every thread of its block (or warp) that has not ended has arrived,
// as on the GPU. The scheduler runs the first thread that can go on, in the order of threadIdx (even blocks) or its
// reverse (odd blocks), until it waits or ends: a thread, and its warp, run as far ahead of the others as the barriers
// let them, which shows a read of another thread's write, or a write over what another has yet to read, that lacks a
// barrier between them (as a GPU's warps may run that far apart). What the GPU leaves undefined is the launch's error
// (cudaGetLastError): a configuration CUDA refuses, a shuffle that reads a lane that ended or runs in a partial warp
// under the full mask, and a wait that the other threads never join.
// A static __shared__ array is one array of the kernel for every block: it starts as the last block left it.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <cmath>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__  // (a kernel's parameters: the launch's copy, read by every thread)

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }

// device intrinsics on the host: an add never contracted (the tests compile with -ffp-contract=off), 1 / sqrt
inline float __fadd_rn(float a, float b) { return a + b; }
inline float rsqrtf(float v) { return 1.0f / sqrtf(v); }

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9,
                   cudaErrorLaunchFailure = 719 };
typedef struct CUstream_st* cudaStream_t;

// the running thread's (set before each fiber resumes)
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {

struct Fiber;
inline Fiber* current = nullptr;
inline ucontext_t scheduler;
inline long progress = 0;  // barriers passed and threads ended: a round of the block without any is a hang

// the threads of a block or a warp: a wait ends when every one of them that has not ended has arrived
struct Barrier {
  explicit Barrier(int n) : count(n) {}
  void arrive_and_wait();
  void leave() {
    --count;
    if (arrived > 0 && arrived >= count) advance();
  }
  void advance() {
    arrived = 0;
    ++generation;
    ++progress;
  }
  int count, arrived = 0;
  long generation = 0;
};

struct Warp {
  explicit Warp(int lanes) : size(lanes), barrier(lanes) {}
  int size;
  Barrier barrier;
  uint64_t slots[32] = {};
  bool exited[32] = {};
};

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  uint3 thread;
  Warp* warp;
  int lane;
  bool done;
  Barrier* waiting_on;  // and the generation it waits past (nullptr: it can run)
  long waiting_for;

  bool runnable() const { return !done && (waiting_on == nullptr || waiting_on->generation != waiting_for); }
};

// back to the scheduler, which resumes this thread where it left
inline void yield() { swapcontext(&current->context, &scheduler); }

inline void Barrier::arrive_and_wait() {
  const long generation_before = generation;
  if (++arrived >= count) return advance();
  current->waiting_on = this;
  current->waiting_for = generation_before;
  yield();  // (resumed once the generation has passed)
  current->waiting_on = nullptr;
}

constexpr size_t kStackBytes = 256 * 1024;

struct Errors {
  cudaError_t last = cudaSuccess;
  std::string message;
  void set(cudaError_t error, const std::string& text) {
    if (last != cudaSuccess) return;
    last = error;
    message = text;
  }
};
inline Errors errors;
inline std::mutex launches;  // one grid at a time in a process

inline Barrier* block_barrier = nullptr;
inline const char* kernel_name = "";
inline void (*invoke)(const void*) = nullptr;
inline const void* closure = nullptr;

inline void entry() {
  Fiber* self = current;
  try {
    invoke(closure);
  } catch (const std::exception& e) {
    errors.set(cudaErrorLaunchFailure, std::string(kernel_name) + ": " + e.what());
  }
  self->done = true;
  self->warp->exited[self->lane] = true;
  self->warp->barrier.leave();
  block_barrier->leave();
  ++progress;
}  // (returns to the scheduler: uc_link)

inline std::vector<Fiber>& fibers() {
  static std::vector<Fiber> pool(1024);
  return pool;
}

template <typename F>
void run_grid(const char* name, dim3 grid, dim3 block, const F& body) {
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535 ||
      threads == 0 || threads > 1024 || block.z > 64) {
    errors.set(cudaErrorInvalidConfiguration,
               std::string(name) + ": grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " +
                   std::to_string(grid.z) + ") of blocks (" + std::to_string(block.x) + ", " +
                   std::to_string(block.y) + ", " + std::to_string(block.z) + ")");
    return;
  }
  std::lock_guard<std::mutex> one_at_a_time(launches);
  kernel_name = name;
  invoke = [](const void* f) { (*static_cast<const F*>(f))(); };
  closure = &body;
  blockDim = block;
  gridDim = grid;
  std::vector<Fiber>& pool = fibers();
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = uint3{bx, by, bz};
        Barrier sync(static_cast<int>(threads));
        block_barrier = &sync;
        std::vector<std::unique_ptr<Warp>> warps;
        for (unsigned long long first = 0; first < threads; first += 32)
          warps.push_back(std::make_unique<Warp>(static_cast<int>(threads - first < 32 ? threads - first : 32)));
        for (unsigned long long t = 0; t < threads; ++t) {
          Fiber& f = pool[t];
          if (!f.stack) f.stack.reset(new char[kStackBytes]);
          f.thread = uint3{static_cast<unsigned>(t % block.x), static_cast<unsigned>(t / block.x % block.y),
                           static_cast<unsigned>(t / (1ull * block.x * block.y))};
          f.warp = warps[t / 32].get();
          f.lane = static_cast<int>(t % 32);
          f.done = false;
          f.waiting_on = nullptr;
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = f.stack.get();
          f.context.uc_stack.ss_size = kStackBytes;
          f.context.uc_link = &scheduler;
          makecontext(&f.context, entry, 0);
        }
        const bool descending = ((1ull * bz * grid.y + by) * grid.x + bx) % 2 == 1;
        auto at = [&](unsigned long long k) -> Fiber& { return pool[descending ? threads - 1 - k : k]; };
        long seen = progress;
        for (unsigned long long live = threads, k = 0; live > 0;) {
          unsigned long long scanned = 0;  // the first runnable thread from k on (those before it wait, as before)
          while (scanned < threads && !at(k).runnable()) {
            ++scanned;
            k = (k + 1) % threads;
          }
          if (scanned == threads) {  // every thread left waits for one that never comes: the block is abandoned
            errors.set(cudaErrorLaunchFailure, std::string(name) + ": a __syncthreads or shuffle that not every "
                                                                   "thread of its block or warp reached");
            return;
          }
          Fiber& f = at(k);
          current = &f;
          threadIdx = f.thread;
          swapcontext(&scheduler, &f.context);
          live -= f.done ? 1 : 0;
          // after a barrier passed or a thread ended, the first thread in order again; else the next one
          k = progress != seen ? 0 : (k + 1) % threads;
          seen = progress;
        }
      }
}

// what `kernel<<<grid, block, shared, stream>>>` is rewritten to: the grid, run when given the arguments
template <typename... Parameters>
struct Launch {
  void (*kernel)(Parameters...);
  const char* name;
  dim3 grid, block;
  template <typename... Arguments>
  void operator()(Arguments&&... arguments) const {
    auto body = [&] { kernel(arguments...); };
    run_grid(name, grid, block, body);
  }
};

template <typename... Parameters>
Launch<Parameters...> launcher(void (*kernel)(Parameters...), const char* name, dim3 grid, dim3 block,
                               size_t shared = 0, cudaStream_t = nullptr) {
  if (shared != 0) errors.set(cudaErrorInvalidValue, std::string(name) + ": dynamic shared memory is not emulated");
  return Launch<Parameters...>{kernel, name, grid, block};
}

}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

// v of lane (this lane ^ lane_mask): every lane of the warp writes its v, waits for the others, reads, waits again
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves at most 8 bytes");
  emu::Warp& w = *emu::current->warp;
  const int lane = emu::current->lane;
  if (mask != 0xffffffffu || w.size != 32)
    throw std::runtime_error("a shuffle under mask " + std::to_string(mask) + " in a warp of " +
                             std::to_string(w.size) + " threads (only full masks of full warps are emulated)");
  memcpy(&w.slots[lane], &v, sizeof v);
  w.barrier.arrive_and_wait();
  const int source = lane ^ (lane_mask & 31);
  const bool gone = w.exited[source];
  T value;
  memcpy(&value, &w.slots[source], sizeof value);
  w.barrier.arrive_and_wait();
  if (gone) throw std::runtime_error("a shuffle read lane " + std::to_string(source) + ", which had exited");
  return value;
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t error = emu::errors.last;
  emu::errors.last = cudaSuccess;
  return error;
}

inline const char* cudaGetErrorString(cudaError_t error) {
  static std::string text;
  text = "emulated CUDA error " + std::to_string(static_cast<int>(error)) + ": " + emu::errors.message;
  return text.c_str();
}

inline cudaError_t cudaMemsetAsync(void* pointer, int value, size_t bytes, cudaStream_t = nullptr) {
  memset(pointer, value, bytes);
  return cudaSuccess;
}

enum cudaMemcpyKind { cudaMemcpyDeviceToDevice = 3 };
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t = nullptr) {
  memcpy(dst, src, bytes);
  return cudaSuccess;
}
