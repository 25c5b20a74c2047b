// Split-sequence (flash-decoding) attention over a TurboQuantMSE-coded KV cache, in CUDA C++
// (float32 arithmetic).
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
// Schedule (the Triton kernels' split-and-merge, gpu/triton/paged.py):
//   1. kvq_decode_split_kernel, one block per (group g, split s), grid G * (S + 1): split s < S
//      attends the group's h query rows to the coded tokens [s * chunk, (s + 1) * chunk), split S to
//      the band. The KV is read once per GQA group: each tile of KVQ_TILE tokens is staged in shared
//      memory with coalesced word loads (16-byte when the row length and the pointer allow, else
//      4-byte, else bytes), then every query row uses it. The split writes its running max m, sum l
//      and (rotated-domain, for s < S) value sum to the workspace.
//   2. kvq_decode_merge_kernel, one block per group: log-sum-exp merge of the S coded partials,
//      one inverse value rotation, then the band partial, the division. Empty splits (m = -inf,
//      l = 0) merge as nothing; exponents are taken against a finite reference.
//
// Conventions (the caller must follow them; gpu/cuda/binding.py does):
//   * Query rotation is the caller's: q_rot = R_K q (kvq_ref.rotations.HadamardRotation(d, seed)
//     of the key method) is an input, together with the original q (for band tokens; may be NULL
//     when n_band = 0).
//   * The inverse value rotation is done here, for every d of the m * 2^k form (not only powers of
//     two): R_V^T y = D1 P^T H_b D2 y, i.e. t = y * signs2, butterflies in blocks of hblock, times
//     1/sqrt(hblock), then x[j] = t[inv_perm[j]] * signs1[j] (HadamardRotation.inverse).
//   * Levels are float32 device arrays (gpu.tables.DeviceTable.levels32, the values of
//     codebooks/data/default/kvq_tables.h); key and value tables may have different bits.
//   * Codes are kvq_ref.packing's little-endian bit stream, ceil(d * bits / 8) bytes per token
//     (kvq_common.cuh, kvq_unpack_code); norms are float16 scales as TurboQuantMSE stores them.
// Accuracy: float32 throughout (kvq_ref uses float64), relative error ~1e-6; tests/gpu/test_cuda.py
// states the tolerances.
//
// Layout (C-contiguous, G = n_groups, h = queries per group <= KVQ_MAX_GROUP):
//   q_rot, q, out : (G, h, d) float32;  k_codes, v_codes : (G, n_mid, bytes) uint8;
//   k_norms, v_norms : (G, n_mid) float16;  band_k, band_v : (G, n_band, d) float16;
//   workspace : (G, S + 1, h, d + 2) float32 = (m, l, acc[d]) per query row.
// 128 threads a block; d <= 256, bits 1..4.

#include <math.h>

#include "kvq_common.cuh"

#define KVQ_ATTN_THREADS 128                                 // threads per block
#define KVQ_TILE 64                                          // tokens per staged tile
#define KVQ_MAX_GROUP 16                                     // query rows per KV group
#define KVQ_ATTN_COORDS (KVQ_MAX_DIM / KVQ_ATTN_THREADS)     // output coordinates per thread
#define KVQ_MAX_ROW (KVQ_MAX_DIM * KVQ_MAX_BITS / 8)         // bytes of the longest packed row

struct alignas(16) kvq_u128 {
  uint32_t w[4];
};

struct AttnArgs {
  int h, d, n_mid, n_band, splits, chunk;
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
  float* ws;
  float* out;
};

// Copy `rows` packed rows of `rb` bytes (contiguous from `src`) into shared `dst`, every thread
// taking every blockDim.x-th unit: 16-byte units when rb and src allow it, else 4-byte words,
// else bytes (consecutive threads read consecutive units: coalesced).
__device__ void kvq_stage_rows(uint8_t* dst, const uint8_t* src, int rows, int rb) {
  const int total = rows * rb;
  const uintptr_t addr = (uintptr_t)src;
  if (rb % 16 == 0 && addr % 16 == 0) {
    const kvq_u128* s = (const kvq_u128*)src;
    kvq_u128* d = (kvq_u128*)dst;
    for (int i = threadIdx.x; i < total / 16; i += blockDim.x) d[i] = s[i];
  } else if (rb % 4 == 0 && addr % 4 == 0) {
    const uint32_t* s = (const uint32_t*)src;
    uint32_t* d = (uint32_t*)dst;
    for (int i = threadIdx.x; i < total / 4; i += blockDim.x) d[i] = s[i];
  } else {
    for (int i = threadIdx.x; i < total; i += blockDim.x) dst[i] = src[i];
  }
}

// Row r of the workspace partial of (group g, split s): m at [0], l at [1], acc at [2 .. d+2).
__device__ __forceinline__ float* kvq_partial(const AttnArgs& a, size_t g, int s, int r) {
  return a.ws + ((g * (size_t)(a.splits + 1) + (size_t)s) * (size_t)a.h + (size_t)r) * (size_t)(a.d + 2);
}

extern "C" __global__ void kvq_decode_split_kernel(AttnArgs a) {
  __shared__ float s_qv[KVQ_MAX_GROUP * KVQ_MAX_DIM];          // rotated (coded) or plain (band) queries
  alignas(16) __shared__ uint8_t s_codes[KVQ_TILE * KVQ_MAX_ROW];  // one staged tile of K or V rows
  __shared__ float s_klev[KVQ_MAX_LEVELS];
  __shared__ float s_vlev[KVQ_MAX_LEVELS];
  __shared__ float s_part[2 * KVQ_MAX_GROUP * KVQ_TILE];        // partial dots, two halves of d
  __shared__ float s_w[KVQ_MAX_GROUP * KVQ_TILE];                // value weights of the tile
  __shared__ float s_kn[KVQ_TILE];
  __shared__ float s_vn[KVQ_TILE];
  __shared__ float s_m[KVQ_MAX_GROUP], s_l[KVQ_MAX_GROUP], s_alpha[KVQ_MAX_GROUP];

  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int d = a.d, h = a.h;
  const size_t g = blockIdx.x / (unsigned)(a.splits + 1);
  const int s = (int)(blockIdx.x % (unsigned)(a.splits + 1));
  const bool band = s == a.splits;
  const int k_bytes = kvq_packed_size(d, a.k_bits);
  const int v_bytes = kvq_packed_size(d, a.v_bits);
  const int t_begin = band ? 0 : min(a.n_mid, s * a.chunk);
  const int t_end = band ? a.n_band : min(a.n_mid, (s + 1) * a.chunk);

  const float* qsrc = band ? a.q : a.q_rot;
  for (int i = tid; i < h * d; i += nt) s_qv[i] = (t_end > t_begin) ? qsrc[g * (size_t)h * d + i] : 0.0f;
  if (!band && a.n_mid > 0) {
    for (int i = tid; i < (1 << a.k_bits); i += nt) s_klev[i] = a.k_levels[i];
    for (int i = tid; i < (1 << a.v_bits); i += nt) s_vlev[i] = a.v_levels[i];
  }
  for (int r = tid; r < h; r += nt) {
    s_m[r] = -INFINITY;
    s_l[r] = 0.0f;
  }
  float acc[KVQ_MAX_GROUP][KVQ_ATTN_COORDS];
#pragma unroll
  for (int r = 0; r < KVQ_MAX_GROUP; ++r)
#pragma unroll
    for (int c = 0; c < KVQ_ATTN_COORDS; ++c) acc[r][c] = 0.0f;
  __syncthreads();

  const int u = tid % KVQ_TILE;            // token of the tile this thread scores
  const int half = tid / KVQ_TILE;         // which half of the coordinates (128 threads = 2 x 64)
  const int j0 = half == 0 ? 0 : d / 2, j1 = half == 0 ? d / 2 : d;
  for (int t0 = t_begin; t0 < t_end; t0 += KVQ_TILE) {
    const int tile = min(KVQ_TILE, t_end - t0);
    // ---- scores: K tile staged once, every query row of the group uses it ----
    if (!band) {
      kvq_stage_rows(s_codes, a.k_codes + (g * (size_t)a.n_mid + (size_t)t0) * k_bytes, tile, k_bytes);
      for (int i = tid; i < tile; i += nt) {
        s_kn[i] = __half2float(a.k_norms[g * (size_t)a.n_mid + t0 + i]);
        s_vn[i] = __half2float(a.v_norms[g * (size_t)a.n_mid + t0 + i]);
      }
      __syncthreads();
    }
    float dot[KVQ_MAX_GROUP];
#pragma unroll
    for (int r = 0; r < KVQ_MAX_GROUP; ++r) dot[r] = 0.0f;
    if (u < tile && half < 2) {
      if (band) {
        const __half* krow = a.band_k + (g * (size_t)a.n_band + (size_t)(t0 + u)) * d;
        for (int j = j0; j < j1; ++j) {
          const float kv = __half2float(krow[j]);
#pragma unroll
          for (int r = 0; r < KVQ_MAX_GROUP; ++r)
            if (r < h) dot[r] += s_qv[r * d + j] * kv;
        }
      } else {
        const uint8_t* krow = s_codes + u * k_bytes;
        for (int j = j0; j < j1; ++j) {
          const float lev = s_klev[kvq_unpack_code(krow, j, a.k_bits)];
#pragma unroll
          for (int r = 0; r < KVQ_MAX_GROUP; ++r)
            if (r < h) dot[r] += s_qv[r * d + j] * lev;
        }
      }
    }
    if (half < 2)
#pragma unroll
      for (int r = 0; r < KVQ_MAX_GROUP; ++r)  // constant indices keep dot[] in registers
        if (r < h) s_part[(half * KVQ_MAX_GROUP + r) * KVQ_TILE + u] = dot[r];
    __syncthreads();
    // ---- online softmax, one thread per query row ----
    if (tid < h) {
      const int r = tid;
      float tmax = -INFINITY;
      for (int v = 0; v < tile; ++v) {
        const float z = (s_part[r * KVQ_TILE + v] + s_part[(KVQ_MAX_GROUP + r) * KVQ_TILE + v]) * a.sm_scale *
                        (band ? 1.0f : s_kn[v]);
        s_w[r * KVQ_TILE + v] = z;
        tmax = fmaxf(tmax, z);
      }
      const float m_new = fmaxf(s_m[r], tmax);
      const float ref = m_new == -INFINITY ? 0.0f : m_new;  // finite reference
      const float alpha = expf(s_m[r] - ref);
      float sum = 0.0f;
      for (int v = 0; v < tile; ++v) {
        const float p = expf(s_w[r * KVQ_TILE + v] - ref);
        sum += p;
        s_w[r * KVQ_TILE + v] = band ? p : p * s_vn[v];  // fold the value scale into the weight
      }
      s_l[r] = s_l[r] * alpha + sum;
      s_m[r] = m_new;
      s_alpha[r] = alpha;
    }
    if (!band)  // s_codes is free once every thread has scored (the barrier above)
      kvq_stage_rows(s_codes, a.v_codes + (g * (size_t)a.n_mid + (size_t)t0) * v_bytes, tile, v_bytes);
    __syncthreads();
    // ---- values: each thread owns coordinates tid + c * nt of every query row ----
#pragma unroll
    for (int c = 0; c < KVQ_ATTN_COORDS; ++c) {
      const int j = tid + c * nt;
#pragma unroll
      for (int r = 0; r < KVQ_MAX_GROUP; ++r)
        if (r < h) acc[r][c] *= s_alpha[r];
      if (j >= d) continue;
      for (int v = 0; v < tile; ++v) {
        const float val = band ? __half2float(a.band_v[(g * (size_t)a.n_band + (size_t)(t0 + v)) * d + j])
                               : s_vlev[kvq_unpack_code(s_codes + v * v_bytes, j, a.v_bits)];
#pragma unroll
        for (int r = 0; r < KVQ_MAX_GROUP; ++r)
          if (r < h) acc[r][c] += s_w[r * KVQ_TILE + v] * val;
      }
    }
    __syncthreads();  // s_codes, s_w, s_alpha are rewritten by the next tile
  }
#pragma unroll
  for (int r = 0; r < KVQ_MAX_GROUP; ++r) {
    if (r >= h) break;
    float* p = kvq_partial(a, g, s, r);
    if (tid == 0) {
      p[0] = s_m[r];
      p[1] = s_l[r];
    }
#pragma unroll
    for (int c = 0; c < KVQ_ATTN_COORDS; ++c) {
      const int j = tid + c * nt;
      if (j < d) p[2 + j] = acc[r][c];
    }
  }
}

extern "C" __global__ void kvq_decode_merge_kernel(AttnArgs a) {
  __shared__ float s_y[KVQ_MAX_DIM];  // merged rotated-domain sum, for the inverse rotation
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int d = a.d;
  const size_t g = blockIdx.x;
  const float hscale = 1.0f / sqrtf((float)a.hblock);
  for (int r = 0; r < a.h; ++r) {
    float m = -INFINITY;
    for (int s = 0; s < a.splits; ++s) m = fmaxf(m, kvq_partial(a, g, s, r)[0]);
    const float ref = m == -INFINITY ? 0.0f : m;
    float l = 0.0f, acc[KVQ_ATTN_COORDS];
    for (int c = 0; c < KVQ_ATTN_COORDS; ++c) acc[c] = 0.0f;
    for (int s = 0; s < a.splits; ++s) {
      const float* p = kvq_partial(a, g, s, r);
      const float w = expf(p[0] - ref);
      l += w * p[1];
      for (int c = 0; c < KVQ_ATTN_COORDS; ++c) {
        const int j = tid + c * nt;
        if (j < d) acc[c] += w * p[2 + j];
      }
    }
    // ---- inverse value rotation of the coded part: R_V^T y = D1 P^T (H_b / sqrt(b)) D2 y ----
    for (int c = 0; c < KVQ_ATTN_COORDS; ++c) {
      const int j = tid + c * nt;
      if (j < d) s_y[j] = acc[c] * a.signs2[j];
    }
    for (int hh = 1; hh < a.hblock; hh <<= 1) {  // butterflies (a, b) -> (a + b, a - b)
      __syncthreads();
      for (int p = tid; p < d / 2; p += nt) {
        const int i = (p / hh) * 2 * hh + (p % hh);
        const float lo = s_y[i], hi = s_y[i + hh];
        s_y[i] = lo + hi;
        s_y[i + hh] = lo - hi;
      }
    }
    __syncthreads();
    // ---- the band partial (original domain), then the division ----
    const float* pb = kvq_partial(a, g, a.splits, r);
    const float mt = fmaxf(m, pb[0]);
    const float rt = mt == -INFINITY ? 0.0f : mt;
    const float ce = expf(m - rt), cb = expf(pb[0] - rt);
    const float den = l * ce + pb[1] * cb;
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;  // a row that sees no token gets 0
    for (int c = 0; c < KVQ_ATTN_COORDS; ++c) {
      const int j = tid + c * nt;
      if (j < d) {
        const float x = s_y[a.inv_perm[j]] * hscale * a.signs1[j];
        a.out[(g * (size_t)a.h + (size_t)r) * d + j] = (x * ce + pb[2 + j] * cb) * inv;
      }
    }
    __syncthreads();  // s_y is rewritten for the next row
  }
}

// Launch function: raw device pointers (layouts above); `splits` >= 1 chunks of `chunk` coded
// tokens (gpu/schedule.py plans them); `workspace` holds G * (splits + 1) * h * (d + 2) floats;
// `stream` is a cudaStream_t (NULL: the default stream). Returns KVQ_OK, KVQ_EINVAL (refused,
// nothing launched) or the cudaError_t.
extern "C" int kvq_decode_attention(long long n_groups, int h, int d, const float* q_rot, const float* q, int n_mid,
                                    const uint8_t* k_codes, const void* k_norms, const float* k_levels, int k_bits,
                                    const uint8_t* v_codes, const void* v_norms, const float* v_levels, int v_bits,
                                    int n_band, const void* band_k, const void* band_v, const float* signs1,
                                    const float* signs2, const int* inv_perm, int hblock, float sm_scale, int splits,
                                    int chunk, float* workspace, float* out, void* stream) {
  if (n_groups < 0 || h < 1 || h > KVQ_MAX_GROUP || d < 2 || d > KVQ_MAX_DIM || n_mid < 0 || n_band < 0 ||
      n_mid + n_band < 1 || hblock < 1 || (hblock & (hblock - 1)) || d % hblock || splits < 1 || chunk < 1 ||
      (long long)splits * chunk < n_mid || n_groups * (long long)(splits + 1) > 0x7FFFFFFFLL)
    return KVQ_EINVAL;
  if (n_mid > 0 && (k_bits < 1 || k_bits > KVQ_MAX_BITS || v_bits < 1 || v_bits > KVQ_MAX_BITS)) return KVQ_EINVAL;
  if (n_band > 0 && (q == nullptr || band_k == nullptr || band_v == nullptr)) return KVQ_EINVAL;
  if (n_groups == 0) return KVQ_OK;
  if (workspace == nullptr) return KVQ_EINVAL;
  AttnArgs a;
  a.h = h;
  a.d = d;
  a.n_mid = n_mid;
  a.n_band = n_band;
  a.splits = splits;
  a.chunk = chunk;
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
  a.ws = workspace;
  a.out = out;
  KVQ_LAUNCH(kvq_decode_split_kernel, (unsigned)(n_groups * (splits + 1)), KVQ_ATTN_THREADS,
             (cudaStream_t)stream)(a);
  int rc = (int)cudaGetLastError();
  if (rc) return rc;
  KVQ_LAUNCH(kvq_decode_merge_kernel, (unsigned)n_groups, KVQ_ATTN_THREADS, (cudaStream_t)stream)(a);
  return (int)cudaGetLastError();
}
