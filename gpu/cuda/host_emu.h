// Host emulation of the CUDA subset used by the kvq kernels, for checking them without a GPU.
//
// Build (gpu/cuda/binding.py, build_host_emulation):
//     g++ -std=c++20 -O2 -fno-ipa-icf -ffp-contract=off -fPIC -shared -pthread -x c++ -include host_emu.h *.cu
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
// Warp collectives (the fragment kernels' subset): __shfl_xor_sync, __shfl_sync, __any_sync,
// __all_sync, __syncwarp, and mma.sync / movmatrix through kvq_emu::mma_m16n8k16_f16 and
// kvq_emu::movmatrix_trans (called by kvq_frag.cuh in place of its inline PTX). Each warp (32
// consecutive threads of the block) has a barrier and a double-buffered staging area: a collective
// writes the lane's operands to the area of its parity, waits at the warp barrier, then reads what it
// needs. Two consecutive collectives use different areas, and a lane can only reach the second but
// next one after every lane has passed the one in between, so one barrier per collective is enough.
// Every lane of a warp must call the same collectives in the same order (convergence), as on the GPU
// with a full mask. Semantics follow the PTX ISA: mma.m16n8k16 (.row.col, f16 inputs, f32
// accumulate) with the fragment layouts of the ISA's figures (products are exact; the 16 products
// and the accumulator are summed in double and rounded once to float, a tighter rounding than the
// tensor cores'); movmatrix.m8n8.trans.b16; __byte_perm (selector nibbles' bits 0-2, CUDA's
// definition; the kernels never set bit 3); __umulhi.
//
// Not emulated (the kernels must not use them): atomics, dynamic shared memory, multi-dimensional
// grids, concurrent launches (launches are serialized by a mutex).
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
#define __launch_bounds__(...)

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

// ---- integer intrinsics ---------------------------------------------------------------------------
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }  // round to nearest even
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long pool = (unsigned long long)x | ((unsigned long long)y << 32);
  unsigned out = 0;
  for (int n = 0; n < 4; ++n) out |= (unsigned)((pool >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return out;
}
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline float __int_as_float(int i) {
  float f;
  memcpy(&f, &i, sizeof f);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  memcpy(&i, &f, sizeof i);
  return i;
}

// ---- warp collectives -----------------------------------------------------------------------------
namespace kvq_emu {
constexpr int kStageWords = 12;
struct Warp {
  std::barrier<> bar{32};
  unsigned stage[2][32][kStageWords];
};
inline std::vector<Warp>* warps = nullptr;  // one per warp of the running launch
inline thread_local unsigned parity = 0;   // collectives this lane has done (mod 2)

inline int lane_id() { return (int)(threadIdx.x & 31u); }
// Publish `n` words of this lane, wait for the warp; returns the staging area to read from.
inline unsigned (*exchange(const unsigned* mine, int n))[kStageWords] {
  Warp& w = (*warps)[threadIdx.x / 32];
  unsigned (*area)[kStageWords] = w.stage[parity];
  parity ^= 1u;
  memcpy(area[lane_id()], mine, sizeof(unsigned) * n);
  w.bar.arrive_and_wait();
  return area;
}
inline unsigned bits_of(float f) {
  unsigned u;
  memcpy(&u, &f, sizeof u);
  return u;
}
inline float float_of(unsigned u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
inline double half_at(unsigned word, int h) {
  const unsigned short u = (unsigned short)(word >> (16 * h));
  _Float16 v;
  memcpy(&v, &u, sizeof v);
  return (double)v;
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 d, a, b, c (d may alias c).
inline void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, const float (&c)[4]) {
  unsigned mine[10] = {a[0], a[1], a[2], a[3], b0, b1, bits_of(c[0]), bits_of(c[1]), bits_of(c[2]), bits_of(c[3])};
  unsigned (*st)[kStageWords] = exchange(mine, 10);
  const int g = lane_id() / 4, t = lane_id() % 4;
  auto A = [&](int row, int k) { return half_at(st[(row % 8) * 4 + (k % 8) / 2][(row / 8) + 2 * (k / 8)], k % 2); };
  auto B = [&](int k, int n) { return half_at(st[n * 4 + (k % 8) / 2][4 + k / 8], k % 2); };
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + (e % 2);
    double acc = (double)c[e];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[e] = (float)acc;
  }
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 d, a, b, d: A row g (+8) holds k 4t..4t+3 (+16)
// in a0 (a1), a2 (a3); B column g holds k 4t..4t+3 in b0, +16 in b1; exact int32 sums.
inline void mma_m16n8k32_s8(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  unsigned mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  unsigned (*st)[kStageWords] = exchange(mine, 6);
  const int g = lane_id() / 4, t = lane_id() % 4;
  auto byte = [](unsigned w, int j) { return (int)(signed char)((w >> (8 * j)) & 0xFFu); };
  auto A = [&](int row, int k) { return byte(st[(row % 8) * 4 + (k % 16) / 4][(row / 8) + 2 * (k / 16)], k % 4); };
  auto B = [&](int k, int n) { return byte(st[n * 4 + (k % 16) / 4][4 + k / 16], k % 4); };
  int out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + (e % 2);
    long long acc = d[e];
    for (int k = 0; k < 32; ++k) acc += A(row, k) * B(k, col);
    out[e] = (int)acc;
  }
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// movmatrix.sync.aligned.m8n8.trans.b16 d, a: lane (r, c) holds row r = lane / 4, columns 2c, 2c + 1.
inline unsigned movmatrix_trans(unsigned a) {
  unsigned (*st)[kStageWords] = exchange(&a, 1);
  const int r = lane_id() / 4, c = lane_id() % 4;
  unsigned out = 0;
  for (int h = 0; h < 2; ++h) {  // out[r][2c + h] = in[2c + h][r]
    const int row = 2 * c + h;
    const unsigned word = st[row * 4 + r / 2][0];
    out |= ((word >> (16 * (r % 2))) & 0xFFFFu) << (16 * h);
  }
  return out;
}
}  // namespace kvq_emu

inline void __syncwarp(unsigned = 0xFFFFFFFFu) {
  unsigned dummy = 0;
  kvq_emu::exchange(&dummy, 1);
}
inline float __shfl_xor_sync(unsigned, float v, int m) {
  unsigned u = kvq_emu::bits_of(v);
  unsigned (*st)[kvq_emu::kStageWords] = kvq_emu::exchange(&u, 1);
  return kvq_emu::float_of(st[(kvq_emu::lane_id() ^ m) & 31][0]);
}
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int m) {
  unsigned (*st)[kvq_emu::kStageWords] = kvq_emu::exchange(&v, 1);
  return st[(kvq_emu::lane_id() ^ m) & 31][0];
}
inline float __shfl_sync(unsigned, float v, int src) {
  unsigned u = kvq_emu::bits_of(v);
  unsigned (*st)[kvq_emu::kStageWords] = kvq_emu::exchange(&u, 1);
  return kvq_emu::float_of(st[src & 31][0]);
}
inline int __any_sync(unsigned, int pred) {
  unsigned u = pred != 0;
  unsigned (*st)[kvq_emu::kStageWords] = kvq_emu::exchange(&u, 1);
  for (int l = 0; l < 32; ++l)
    if (st[l][0]) return 1;
  return 0;
}
inline int __all_sync(unsigned, int pred) {
  unsigned u = pred != 0;
  unsigned (*st)[kvq_emu::kStageWords] = kvq_emu::exchange(&u, 1);
  for (int l = 0; l < 32; ++l)
    if (!st[l][0]) return 0;
  return 1;
}

// CUDA's integer min/max of device code.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// ---- half precision ---------------------------------------------------------------------------
typedef _Float16 __half;
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half_rn(float f) { return (__half)f; }
inline __half __double2half(double d) { return (__half)d; }
inline __half __ushort_as_half(unsigned short u) {
  __half h;
  memcpy(&h, &u, sizeof h);
  return h;
}
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
    std::vector<Warp> warp_state((block.x + 31) / 32);  // warp collectives need whole warps
    warps = &warp_state;
    std::vector<std::thread> threads;
    threads.reserve(block.x);
    for (unsigned t = 0; t < block.x; ++t) {
      threads.emplace_back([&, t] {
        threadIdx = dim3(t);
        parity = 0;
        for (unsigned b = 0; b < grid.x; ++b) {
          blockIdx = dim3(b);
          kernel(args...);
          __syncthreads();  // the next block reuses the function-static "shared" arrays
        }
      });
    }
    for (auto& th : threads) th.join();
    kvq_emu_barrier = nullptr;
    warps = nullptr;
  };
}
}  // namespace kvq_emu

#define KVQ_LAUNCH(kernel, grid, block, stream) kvq_emu::launcher(dim3(grid), dim3(block), kernel, (stream))

// kvq_common.cuh's programmatic dependent launch: launches run one after another here, so it is a plain
// launch (and griddepcontrol, kvq_launch_dependents / kvq_wait_prerequisites, compiles to nothing).
template <typename Kernel, typename... A>
inline cudaError_t kvq_launch_dependent(Kernel kernel, unsigned grid, unsigned block, cudaStream_t stream,
                                        bool /*programmatic*/, A... args) {
  kvq_emu::launcher(dim3(grid), dim3(block), kernel, stream)(args...);
  return cudaSuccess;
}

#endif  // KVQ_HOST_EMU_H
