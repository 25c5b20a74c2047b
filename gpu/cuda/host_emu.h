// Host emulation of the CUDA subset used by the kvq kernels, for checking them without a GPU.
//
// Build (gpu/cuda/binding.py, build_host_emulation):
//     g++ -std=c++20 -O2 -ffp-contract=off -fPIC -shared -pthread -x c++ -include host_emu.h *.cu
//
// Model: a launch runs the grid's blocks one after another; each block is run by blockDim.x
// std::threads (the same threads for every block), __syncthreads() is a std::barrier over them,
// and a __shared__ array is a function-static array (one block at a time uses it; a barrier
// separates consecutive blocks). Floating point: IEEE binary64/binary32 with contraction off, so
// double-precision steps written with __dadd_rn/__dmul_rn/... round exactly as on the GPU; float
// expf/sqrtf come from the C library (they may differ from CUDA's in the last ulp or two, which
// is why attention results are compared with tolerances). __half is GCC's _Float16, whose
// conversion from double rounds once to nearest-even, like cvt.rn.f16.f64.
//
// Not emulated (the kernels must not use them): warp shuffles/votes, atomics, dynamic shared
// memory, multi-dimensional grids, concurrent launches (launches are serialized by a mutex).
#ifndef KVQ_HOST_EMU_H
#define KVQ_HOST_EMU_H

#define KVQ_HOST_EMULATION 1

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <barrier>
#include <cmath>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
inline std::barrier<>* kvq_emu_barrier = nullptr;

inline void __syncthreads() { kvq_emu_barrier->arrive_and_wait(); }

// CUDA's integer min/max of device code.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// ---- half precision ---------------------------------------------------------------------------
typedef _Float16 __half;
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half_rn(float f) { return (__half)f; }
inline __half __double2half(double d) { return (__half)d; }
inline unsigned short __half_as_ushort(__half h) {
  unsigned short u;
  memcpy(&u, &h, sizeof u);
  return u;
}

// ---- correctly rounded double operations (never contracted into FMA) ---------------------------
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }

// ---- runtime API stand-ins ----------------------------------------------------------------------
typedef void* cudaStream_t;
typedef int cudaError_t;
#define cudaSuccess 0
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error (host emulation)" : "error (host emulation)";
}

namespace kvq_emu {
inline std::mutex launch_mutex;

// KVQ_LAUNCH(kernel, grid, block, stream)(args...): run every block of a 1-D grid.
template <typename Kernel>
auto launcher(dim3 grid, dim3 block, Kernel kernel, void* /*stream: one launch at a time*/) {
  return [=](auto... args) {
    std::lock_guard<std::mutex> guard(launch_mutex);
    blockDim = block;
    gridDim = grid;
    std::barrier<> bar(block.x);
    kvq_emu_barrier = &bar;
    std::vector<std::thread> threads;
    threads.reserve(block.x);
    for (unsigned t = 0; t < block.x; ++t) {
      threads.emplace_back([&, t] {
        threadIdx = dim3(t);
        for (unsigned b = 0; b < grid.x; ++b) {
          blockIdx = dim3(b);
          kernel(args...);
          __syncthreads();  // the next block reuses the function-static "shared" arrays
        }
      });
    }
    for (auto& th : threads) th.join();
    kvq_emu_barrier = nullptr;
  };
}
}  // namespace kvq_emu

#define KVQ_LAUNCH(kernel, grid, block, stream) kvq_emu::launcher(dim3(grid), dim3(block), kernel, (stream))

#endif  // KVQ_HOST_EMU_H
