// Fused decode attention over a TurboQuantMSE-coded KV cache, in CUDA C++ (float32 arithmetic).
//
// What it computes (kvq_ref.attention.attention_decode over a kvq_ref.attention.QuantizedKV whose
// key and value methods are TurboQuantMSE with the Hadamard rotation): for every query row q of a
// group g, over the group's n_band float16 band tokens and n_mid coded tokens,
//
//     logit_t = sm_scale * <q, k_t>                         band token (float16 key row)
//     logit_t = sm_scale * k_norm_t * <R_K q, c_K[kcode_t]>    coded token (rotated domain)
//     out     = sum_t p_t v_t  (softmax p over all tokens)
//             = sum_band p_t v_t + R_V^T ( sum_mid p_t * v_norm_t * c_V[vcode_t] )
//
// Conventions (the caller must follow them; gpu/cuda/binding.py does):
//   * Query rotation is the caller's: q_rot = R_K q (kvq_ref.rotations.HadamardRotation(d, seed)
//     of the key method) is an input, together with the original q (for band tokens; may be NULL
//     when n_band = 0).
//   * The inverse value rotation is done here, for every d of the m * 2^k form (not only powers of
//     two): R_V^T y = D1 P^T H_b D2 y, i.e. t = y * signs2, butterflies in blocks of hblock, times
//     1/sqrt(hblock), then x[j] = t[inv_perm[j]] * signs1[j] (HadamardRotation.inverse). The
//     output is in the original domain.
//   * Levels are float32 device arrays (gpu.tables.DeviceTable.levels32, the values of
//     codebooks/data/default/kvq_tables.h); key and value tables may have different bits.
//   * Codes are kvq_ref.packing's little-endian bit stream, ceil(d * bits / 8) bytes per token
//     (kvq_common.cuh, kvq_unpack_code); norms are float16 scales as TurboQuantMSE stores them
//     (plain or norm-corrected: the kernel just multiplies).
//   * Softmax is online over tiles of KVQ_ATTN_THREADS tokens (running max m, running sum l;
//     both accumulators are rescaled by exp(m_old - m_new)); band tokens come first, token order
//     does not change the result beyond rounding.
// Accuracy: float32 throughout (kvq_ref uses float64), relative error ~1e-6; tests/gpu/test_cuda.py
// states the tolerances.
//
// Layout (C-contiguous, G = n_groups, h = queries per group):
//   q_rot, q, out : (G, h, d) float32;  k_codes, v_codes : (G, n_mid, bytes) uint8;
//   k_norms, v_norms : (G, n_mid) float16;  band_k, band_v : (G, n_band, d) float16.
// One thread block per query row (grid = G * h), 128 threads; thread t scores token t of a tile
// and accumulates output coordinates t and t + 128. Limits: d <= 256, bits 1..4.

#include <math.h>

#include "kvq_common.cuh"

#define KVQ_ATTN_THREADS 128                                 // tokens per tile, a power of two
#define KVQ_ATTN_COORDS (KVQ_MAX_DIM / KVQ_ATTN_THREADS)     // output coordinates per thread

struct AttnArgs {
  int h, d, n_mid, n_band;
  const float* q_rot;
  const float* q;
  const uint8_t* k_codes;
  const __half* k_norms;
  const float* k_levels;
  int k_bits;
  const uint8_t* v_codes;
  const __half* v_norms;
  const float* v_levels;
  int v_bits;
  const __half* band_k;
  const __half* band_v;
  const float* signs1;   // value rotation D1, +-1
  const float* signs2;   // value rotation D2, +-1
  const int* inv_perm;   // value rotation P^-1 (identity for powers of two)
  int hblock;            // value rotation's Hadamard block size
  float sm_scale;
  float* out;
};

// Block-wide max / sum through shared scratch `red` (blockDim.x entries, a power of two). Every
// thread gets the same result; the trailing barrier lets the scratch be reused at once.
__device__ float kvq_block_max(float v, float* red) {
  const int tid = threadIdx.x;
  red[tid] = v;
  __syncthreads();
  for (int off = blockDim.x / 2; off > 0; off >>= 1) {
    if (tid < off) red[tid] = fmaxf(red[tid], red[tid + off]);
    __syncthreads();
  }
  const float r = red[0];
  __syncthreads();
  return r;
}

__device__ float kvq_block_sum(float v, float* red) {
  const int tid = threadIdx.x;
  red[tid] = v;
  __syncthreads();
  for (int off = blockDim.x / 2; off > 0; off >>= 1) {
    if (tid < off) red[tid] += red[tid + off];
    __syncthreads();
  }
  const float r = red[0];
  __syncthreads();
  return r;
}

// Online-softmax step for one tile: this thread's logit (ignored when !valid) -> its weight
// exp(logit - m_new); updates the running max m and sum l and returns the rescale factor of the
// earlier accumulators in *alpha. m starts at -INFINITY (then alpha = exp(-inf) = 0).
__device__ float kvq_tile_softmax(float logit, bool valid, float* red, float& m, float& l, float* alpha) {
  const float m_new = fmaxf(m, kvq_block_max(valid ? logit : -INFINITY, red));
  const float p = valid ? expf(logit - m_new) : 0.0f;
  *alpha = expf(m - m_new);
  l = l * *alpha + kvq_block_sum(p, red);
  m = m_new;
  return p;
}

extern "C" __global__ void kvq_decode_attention_kernel(AttnArgs a) {
  __shared__ float s_qr[KVQ_MAX_DIM];            // rotated query (coded tokens)
  __shared__ float s_q[KVQ_MAX_DIM];             // original query (band tokens)
  __shared__ float s_klev[KVQ_MAX_LEVELS];
  __shared__ float s_vlev[KVQ_MAX_LEVELS];
  __shared__ float s_red[KVQ_ATTN_THREADS];      // reduction scratch
  __shared__ float s_w[KVQ_ATTN_THREADS];        // per-token value weight of the current tile
  __shared__ float s_y[KVQ_MAX_DIM];             // rotated-domain sum, for the inverse rotation

  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int d = a.d;
  const size_t row = blockIdx.x;          // query row (g * h + i)
  const size_t g = row / (size_t)a.h;     // its KV group
  const int k_bytes = kvq_packed_size(d, a.k_bits);
  const int v_bytes = kvq_packed_size(d, a.v_bits);

  for (int j = tid; j < d; j += nt) {
    s_qr[j] = a.q_rot[row * d + j];
    s_q[j] = a.n_band > 0 ? a.q[row * d + j] : 0.0f;
  }
  if (a.n_mid > 0) {  // no coded tokens: the tables may be absent
    for (int i = tid; i < (1 << a.k_bits); i += nt) s_klev[i] = a.k_levels[i];
    for (int i = tid; i < (1 << a.v_bits); i += nt) s_vlev[i] = a.v_levels[i];
  }
  __syncthreads();

  float m = -INFINITY, l = 0.0f, alpha;
  float acc_band[KVQ_ATTN_COORDS], acc_mid[KVQ_ATTN_COORDS];  // output coordinates tid + c * nt
  for (int c = 0; c < KVQ_ATTN_COORDS; ++c) acc_band[c] = acc_mid[c] = 0.0f;

  // ---- band tokens: float16 rows, original domain --------------------------------------------
  const __half* bk = a.band_k + g * (size_t)a.n_band * d;
  const __half* bv = a.band_v + g * (size_t)a.n_band * d;
  for (int t0 = 0; t0 < a.n_band; t0 += nt) {
    const int t = t0 + tid;
    const bool valid = t < a.n_band;
    float logit = 0.0f;
    if (valid) {
      float dot = 0.0f;
      for (int j = 0; j < d; ++j) dot += s_q[j] * __half2float(bk[(size_t)t * d + j]);
      logit = dot * a.sm_scale;
    }
    s_w[tid] = kvq_tile_softmax(logit, valid, s_red, m, l, &alpha);
    __syncthreads();
    const int tile = min(nt, a.n_band - t0);
    for (int c = 0; c < KVQ_ATTN_COORDS; ++c) {
      const int j = tid + c * nt;
      acc_band[c] *= alpha;
      acc_mid[c] *= alpha;
      if (j < d)
        for (int u = 0; u < tile; ++u) acc_band[c] += s_w[u] * __half2float(bv[(size_t)(t0 + u) * d + j]);
    }
    __syncthreads();  // s_w is rewritten by the next tile
  }

  // ---- coded tokens: level lookups times float16 norms, rotated domain -----------------------
  const uint8_t* kc = a.k_codes + g * (size_t)a.n_mid * k_bytes;
  const uint8_t* vc = a.v_codes + g * (size_t)a.n_mid * v_bytes;
  const __half* kn = a.k_norms + g * (size_t)a.n_mid;
  const __half* vn = a.v_norms + g * (size_t)a.n_mid;
  for (int t0 = 0; t0 < a.n_mid; t0 += nt) {
    const int t = t0 + tid;
    const bool valid = t < a.n_mid;
    float logit = 0.0f;
    if (valid) {
      const uint8_t* krow = kc + (size_t)t * k_bytes;
      float dot = 0.0f;
      for (int j = 0; j < d; ++j) dot += s_qr[j] * s_klev[kvq_unpack_code(krow, j, a.k_bits)];
      logit = dot * __half2float(kn[t]) * a.sm_scale;
    }
    const float p = kvq_tile_softmax(logit, valid, s_red, m, l, &alpha);
    s_w[tid] = valid ? p * __half2float(vn[t]) : 0.0f;  // fold the value scale into the weight
    __syncthreads();
    const int tile = min(nt, a.n_mid - t0);
    for (int c = 0; c < KVQ_ATTN_COORDS; ++c) {
      const int j = tid + c * nt;
      acc_band[c] *= alpha;
      acc_mid[c] *= alpha;
      if (j < d)
        for (int u = 0; u < tile; ++u)
          acc_mid[c] += s_w[u] * s_vlev[kvq_unpack_code(vc + (size_t)(t0 + u) * v_bytes, j, a.v_bits)];
    }
    __syncthreads();
  }

  // ---- inverse value rotation of the coded part: R_V^T y = D1 P^T (H_b / sqrt(b)) D2 y --------
  for (int c = 0; c < KVQ_ATTN_COORDS; ++c) {
    const int j = tid + c * nt;
    if (j < d) s_y[j] = acc_mid[c] * a.signs2[j];
  }
  for (int h = 1; h < a.hblock; h <<= 1) {  // butterflies (a, b) -> (a + b, a - b), as in the quantizer
    __syncthreads();
    for (int p = tid; p < d / 2; p += nt) {
      const int i = (p / h) * 2 * h + (p % h);
      const float lo = s_y[i], hi = s_y[i + h];
      s_y[i] = lo + hi;
      s_y[i + h] = lo - hi;
    }
  }
  __syncthreads();
  const float hscale = 1.0f / sqrtf((float)a.hblock);
  const float inv_l = 1.0f / l;
  for (int c = 0; c < KVQ_ATTN_COORDS; ++c) {
    const int j = tid + c * nt;
    if (j < d) {
      const float x = s_y[a.inv_perm[j]] * hscale * a.signs1[j];
      a.out[row * d + j] = (acc_band[c] + x) * inv_l;
    }
  }
}

// Launch function: raw device pointers (layouts above); `stream` is a cudaStream_t (NULL: the
// default stream). Returns KVQ_OK, KVQ_EINVAL (refused, nothing launched) or the cudaError_t.
extern "C" int kvq_decode_attention(long long n_groups, int h, int d, const float* q_rot, const float* q, int n_mid,
                                    const uint8_t* k_codes, const void* k_norms, const float* k_levels, int k_bits,
                                    const uint8_t* v_codes, const void* v_norms, const float* v_levels, int v_bits,
                                    int n_band, const void* band_k, const void* band_v, const float* signs1,
                                    const float* signs2, const int* inv_perm, int hblock, float sm_scale, float* out,
                                    void* stream) {
  const long long rows = n_groups * (long long)h;
  if (n_groups < 0 || h < 1 || rows > 0x7FFFFFFFLL || d < 2 || d > KVQ_MAX_DIM || n_mid < 0 || n_band < 0 ||
      n_mid + n_band < 1 || hblock < 1 || (hblock & (hblock - 1)) || d % hblock)
    return KVQ_EINVAL;
  if (n_mid > 0 && (k_bits < 1 || k_bits > KVQ_MAX_BITS || v_bits < 1 || v_bits > KVQ_MAX_BITS)) return KVQ_EINVAL;
  if (n_band > 0 && (q == nullptr || band_k == nullptr || band_v == nullptr)) return KVQ_EINVAL;
  if (rows == 0) return KVQ_OK;
  AttnArgs a;
  a.h = h;
  a.d = d;
  a.n_mid = n_mid;
  a.n_band = n_band;
  a.q_rot = q_rot;
  a.q = q;
  a.k_codes = k_codes;
  a.k_norms = (const __half*)k_norms;
  a.k_levels = k_levels;
  a.k_bits = k_bits;
  a.v_codes = v_codes;
  a.v_norms = (const __half*)v_norms;
  a.v_levels = v_levels;
  a.v_bits = v_bits;
  a.band_k = (const __half*)band_k;
  a.band_v = (const __half*)band_v;
  a.signs1 = signs1;
  a.signs2 = signs2;
  a.inv_perm = inv_perm;
  a.hblock = hblock;
  a.sm_scale = sm_scale;
  a.out = out;
  KVQ_LAUNCH(kvq_decode_attention_kernel, (unsigned)rows, KVQ_ATTN_THREADS, (cudaStream_t)stream)(a);
  return (int)cudaGetLastError();
}
