// TurboQuantMSE quantize-and-pack, and the turbo2/turbo3/turbo4 block formats, in CUDA C++.
//
// One thread block per vector. The kernels reproduce kvq_ref bit for bit (kvq_ref/turboquant.py,
// kvq_ref/turbo_block.py); what has to match, step by step:
//
//   1. Input: float16 or float32 values are widened to double (exact). Everything up to the
//      codes is computed in double with explicitly rounded operations (__dadd_rn, __dmul_rn,
//      __ddiv_rn, __dsqrt_rn), which nvcc never contracts into FMAs, so every step rounds exactly
//      as numpy/numba do on the host.
//   2. Norm ||x||: squares of the inputs (exact in double for float16 and float32 inputs), summed
//      sequentially j = 0, 1, ..., d-1 by one thread (kvq_ref.common.row_norm, the rule of
//      kvq_ref.turboquant.quantize_rotated shared by TurboQuantMSE and the turbo blocks), then
//      sqrt. The same sequential sum of the squared levels gives the norm-corrected scale.
//   3. Unit vector: x * (1/||x||), the reciprocal rounded once and then multiplied (not a
//      division). A zero vector gives a zero unit vector (and codes of y = 0, scale 0).
//   4. Rotation y = D2 . H_b . P . D1 . u (kvq_ref.rotations.HadamardRotation): w[j] = u[perm[j]]
//      * signs1[perm[j]]; butterflies (a, b) -> (a + b, a - b) for h = 1, 2, 4, ... < b within
//      each block of b = hblock coordinates (Sylvester order, stage by stage); then
//      y = (w * (1 / sqrt(b))) * signs2. Sign flips are exact; 1/sqrt(b) is the correctly rounded
//      double, as math.sqrt gives. The turbo blocks' rotation has no permutation (perm = NULL).
//   5. Code of y_j = number of thresholds strictly below y_j (np.searchsorted(..., side="left"):
//      a coordinate exactly on a threshold takes the lower cell). Thresholds are the float64
//      table (gpu.tables.DeviceTable.thresholds), passed as a device array: the float32 values of
//      codebooks/data/default/kvq_tables.h are not enough for bit-exact codes. Zeros: -0.0 and
//      +0.0 compare equal (IEEE), as in numpy; no sign() is taken anywhere.
//   6. Scale: ||x||, or with norm correction ||x|| / ||levels[codes]||, rounded once from double
//      to float16 (__double2half, round to nearest even, like numpy's astype(float16)). Overflow
//      gives inf; the binding refuses it after the launch, as kvq_ref.common.to_fp does.
//   7. Packing: kvq_ref.packing's little-endian bit stream (kvq_common.cuh, kvq_pack_byte).
//      TurboQuantMSE: codes row of ceil(d * bits / 8) bytes and a separate float16 norm.
//      turbo blocks (d = 32 or 128): norm fp16 (little-endian) | [turbo4, 128 values: 2 zero
//      bytes] | qs | [turbo3: signs]; qs = 2-bit stream of (code & 3) (turbo2/3) or 4-bit stream
//      of the code (turbo4), signs = 1-bit stream of code >> 2.
//
// Limits: 2 <= d <= 256 (hblock = d & -d), 1 <= bits <= 4 (the binding takes 2/3/4-bit tables
// and 1-bit ones), turbo blocks d in {32, 128}.

#include "kvq_quant.cuh"

// TurboQuantMSE: codes (n_vec, ceil(d * bits / 8)) uint8, norms (n_vec,) float16.
extern "C" __global__ void kvq_quantize_mse_kernel(const void* x, int in_dtype, int d, int bits,
                                                   const double* thresholds, const double* levels,
                                                   const float* signs1, const float* signs2, const int* perm,
                                                   int hblock, int norm_correction, uint8_t* codes, __half* norms) {
  __shared__ QuantShared sm;
  kvq_rotate_and_code(sm, x, in_dtype, (size_t)blockIdx.x * (size_t)d, d, bits, thresholds, levels, signs1, signs2,
                      perm, hblock, norm_correction);
  const int row_bytes = kvq_packed_size(d, bits);
  uint8_t* out = codes + (size_t)blockIdx.x * (size_t)row_bytes;
  for (int p = threadIdx.x; p < row_bytes; p += blockDim.x) out[p] = kvq_pack_byte(sm.codes, d, bits, 0, p);
  if (threadIdx.x == 0) norms[blockIdx.x] = __double2half(sm.scale);
}

// Bytes per turbo block: turbo2 2 + d/4, turbo3 2 + d/4 + d/8, turbo4 (2 + 2 unused at d = 128) + d/2.
__host__ __device__ __forceinline__ int kvq_turbo_qs_offset(int d, int bits) { return bits == 4 && d == 128 ? 4 : 2; }
__host__ __device__ __forceinline__ int kvq_turbo_block_bytes(int d, int bits) {
  return bits == 4 ? kvq_turbo_qs_offset(d, bits) + d / 2 : 2 + d / 4 + (bits == 3 ? d / 8 : 0);
}

// turbo2/3/4 blocks (bits 2/3/4): (n_vec, kvq_turbo_block_bytes) uint8, kvq_ref/turbo_block.py layout.
extern "C" __global__ void kvq_quantize_turbo_kernel(const void* x, int in_dtype, int d, int bits,
                                                     const double* thresholds, const double* levels,
                                                     const float* signs1, const float* signs2, uint8_t* blocks) {
  __shared__ QuantShared sm;
  kvq_rotate_and_code(sm, x, in_dtype, (size_t)blockIdx.x * (size_t)d, d, bits, thresholds, levels, signs1, signs2,
                      /*perm=*/nullptr, /*hblock=*/d, /*norm_correction=*/1);
  const int q = kvq_turbo_qs_offset(d, bits);
  const int qs_bytes = bits == 4 ? d / 2 : d / 4;
  uint8_t* out = blocks + (size_t)blockIdx.x * (size_t)kvq_turbo_block_bytes(d, bits);
  const int tid = threadIdx.x;
  if (tid == 0) {
    // gamma as one 16-bit little-endian store (out is 2-byte aligned: every block size is even and
    // the binding allocates the rows). Not two byte stores of __half_as_ushort(gamma): ptxas of
    // CUDA 13.0 turned the low byte's st.u8 of the f16 register into F2I.U8.F16, storing
    // min(255, trunc(gamma)) instead of the bits (seen on the H200; host emulation was exact).
    // tests/gpu/test_cuda.py checks the SASS for f16-to-integer conversions.
    *reinterpret_cast<__half*>(out) = __double2half(sm.scale);
    if (q == 4) out[2] = out[3] = 0;  // turbo4's unused fp16 field
  }
  for (int p = tid; p < qs_bytes; p += blockDim.x)
    out[q + p] = bits == 4 ? kvq_pack_byte(sm.codes, d, 4, 0, p) : kvq_pack_byte(sm.codes, d, 2, 0, p);
  if (bits == 3)
    for (int p = tid; p < d / 8; p += blockDim.x) out[q + qs_bytes + p] = kvq_pack_byte(sm.codes, d, 1, 2, p);
}

static int kvq_quant_args_ok(long long n_vec, int in_dtype, int d, int bits) {
  return n_vec >= 0 && n_vec <= 0x7FFFFFFFLL && (in_dtype == KVQ_IN_F16 || in_dtype == KVQ_IN_F32) && d >= 2 &&
         d <= KVQ_MAX_DIM && bits >= 1 && bits <= KVQ_MAX_BITS;
}

// Launch functions: raw device pointers; `stream` is a cudaStream_t (NULL: the default stream).
// Returns KVQ_OK, KVQ_EINVAL (refused, nothing launched) or the launch's cudaError_t.
extern "C" int kvq_quantize_mse(const void* x, int in_dtype, long long n_vec, int d, int bits, const double* thresholds,
                                const double* levels, const float* signs1, const float* signs2, const int* perm,
                                int hblock, int norm_correction, uint8_t* codes, void* norms, void* stream) {
  if (!kvq_quant_args_ok(n_vec, in_dtype, d, bits) || hblock < 1 || (hblock & (hblock - 1)) || d % hblock)
    return KVQ_EINVAL;
  if (n_vec == 0) return KVQ_OK;
  KVQ_LAUNCH(kvq_quantize_mse_kernel, (unsigned)n_vec, KVQ_QUANT_THREADS, (cudaStream_t)stream)
  (x, in_dtype, d, bits, thresholds, levels, signs1, signs2, perm, hblock, norm_correction, codes, (__half*)norms);
  return (int)cudaGetLastError();
}

extern "C" int kvq_quantize_turbo(const void* x, int in_dtype, long long n_vec, int d, int bits,
                                  const double* thresholds, const double* levels, const float* signs1,
                                  const float* signs2, uint8_t* blocks, void* stream) {
  if (!kvq_quant_args_ok(n_vec, in_dtype, d, bits) || (d != 32 && d != 128) || bits < 2) return KVQ_EINVAL;
  if (n_vec == 0) return KVQ_OK;
  KVQ_LAUNCH(kvq_quantize_turbo_kernel, (unsigned)n_vec, KVQ_QUANT_THREADS, (cudaStream_t)stream)
  (x, in_dtype, d, bits, thresholds, levels, signs1, signs2, blocks);
  return (int)cudaGetLastError();
}

extern "C" int kvq_turbo_block_bytes_of(int d, int bits) { return kvq_turbo_block_bytes(d, bits); }

// Makes `device` current for this library's CUDA runtime (it may be a different runtime instance
// from torch's, with its own current device).
extern "C" int kvq_cuda_set_device(int device) { return (int)cudaSetDevice(device); }

extern "C" const char* kvq_cuda_error_string(int code) {
  if (code == KVQ_EINVAL) return "invalid arguments (refused before launch)";
  return cudaGetErrorString((cudaError_t)code);
}
