// The fragment kernels' arguments, float32 band partial and merge kernel (kvq_frag_attention.cu
// includes it; the split kernel and the launch functions are there).
#ifndef KVQ_FRAG_PARTS_CUH
#define KVQ_FRAG_PARTS_CUH

#include <math.h>

#include "kvq_common.cuh"
#include "kvq_frag.cuh"

#define KVQ_FRAG_WARPS 4
#define KVQ_FRAG_THREADS (32 * KVQ_FRAG_WARPS)
#define KVQ_FRAG_ROWS 8      // query rows per KV head: the MMA's N
#define KVQ_BAND_TILE 64     // band tokens per step of the float32 band path
#define KVQ_LOG2E 1.4426950408889634f
// CTAs per SM the register budget must allow: 4 (<= 128 registers); at head_dim 256 the accumulators
// and query fragments alone take 96 registers, so 3 (<= 168) rather than spilling, and 2 with the
// int8 keys' 32 more registers of quads
#define KVQ_FRAG_MIN_BLOCKS(D, KB) ((D) >= 256 ? ((KB) == 2 ? 2 : 3) : 4)

// dtype codes of q, out and the band
#define KVQ_DT_F32 0
#define KVQ_DT_F16 1
#define KVQ_DT_BF16 2

struct FragArgs {
  int B, T, H, G, R, d;
  const void* q;         // (B, T, H, G, d), q_dtype
  int q_dtype, out_dtype;
  void* out;             // (B, T, H, G, d), out_dtype
  const uint8_t* kv;     // (pages, H, page_size / 16, tile_bytes)
  const int* block_table;
  const int* seq_lens;
  int page_size, log_page, bt_stride;  // page_size = 2^log_page >= 32
  unsigned page_bytes;   // H * page_size / 16 * tile_bytes: bytes from one page to the next
  unsigned log_tpp, tpp_mask;  // log2(page_size / 16), page_size / 16 - 1
  const void* band_k;    // (B, H, band_cap, d), band_dtype
  const void* band_v;
  const int* band_lens;  // (B,)
  int band_dtype, band_cap;
  uint32_t kpool[4], vpool[4];
  KvqMul mul;            // from the host (a kernel argument, so ptxas cannot fold it)
  float ksigma;          // 2-bit keys: the int8 levels are ksigma * level (gpu.cuda.lookup.int8_levels)
  const int* kperm;      // key rotation: perm (d), signs (2, d) = (signs1, signs2), Hadamard block
  const float* ksigns;
  const int* vinv_perm;  // value rotation: inverse perm, signs (2, d), block
  const float* vsigns;
  int khblock, vhblock;
  float sm_scale;
  int splits, chunk;
  float* ws;             // (B, H, S + NB, 8, d + 2): m (log2 units), l, acc[d]; splits, then band steps
  int dependent_launch;  // 1: the merge is a programmatic dependent launch of the split kernel
  int band_ctas;         // NB: CTAs per (b, h) for the band, KVQ_BAND_TILE tokens each (NB * 64 >= band_cap)
};


__device__ __forceinline__ float kvq_load_as_float(const void* p, int dtype, size_t i) {
  if (dtype == KVQ_DT_F32) return ((const float*)p)[i];
  const unsigned short u = ((const unsigned short*)p)[i];
  return dtype == KVQ_DT_F16 ? __half2float(__ushort_as_half(u)) : kvq_bf16(u);
}

// Partial s of (b, h): s < S a split's (value-rotation domain), S + c band step c's (original domain).
__device__ __forceinline__ float* kvq_frag_partial(const FragArgs& a, size_t bh, int s, int r, int d) {
  return a.ws + ((bh * (size_t)(a.splits + a.band_ctas) + (size_t)s) * KVQ_FRAG_ROWS + (size_t)r) * (size_t)(d + 2);
}

// Rows r < R of the query of (b, h), times `scale`, into s_q[8][D] (rows >= R zero).
template <int D>
__device__ void kvq_frag_load_q(const FragArgs& a, int b, int h, float scale, float* s_q) {
  for (int i = threadIdx.x; i < KVQ_FRAG_ROWS * D; i += blockDim.x) {
    const int r = i / D, j = i % D;
    float v = 0.0f;
    if (r < a.R) {
      const int t = r / a.G, g = r % a.G;
      const size_t row = (((size_t)b * a.T + t) * a.H + h) * a.G + g;
      v = kvq_load_as_float(a.q, a.q_dtype, row * D + j) * scale;
    }
    s_q[i] = v;
  }
}


// The float32 band partial (original domain) of CTA (b, h, S + c): band tokens [64 c, 64 (c + 1)). The
// band is spread over NB CTAs of one step each so that at batch 1, where every CTA of the call runs in
// one wave, a long band (320 tokens for a 64,256 band) does not outlast the splits' loops; a CTA past
// the band's length writes the empty partial (m = -inf, l = 0, acc = 0).
template <int D>
__device__ void kvq_frag_band(const FragArgs& a, int b, int h, int c, float* s_buf) {
  __shared__ float s_part[2][KVQ_FRAG_ROWS][KVQ_BAND_TILE];
  __shared__ float s_p[KVQ_FRAG_ROWS][KVQ_BAND_TILE];
  __shared__ float s_m[KVQ_FRAG_ROWS], s_l[KVQ_FRAG_ROWS], s_alpha[KVQ_FRAG_ROWS];
  constexpr int NC = (D + KVQ_FRAG_THREADS - 1) / KVQ_FRAG_THREADS;  // output coordinates per thread
  const int tid = threadIdx.x;
  float* s_q = s_buf;
  kvq_frag_load_q<D>(a, b, h, a.sm_scale * KVQ_LOG2E, s_q);
  if (tid < KVQ_FRAG_ROWS) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.0f;
  }
  float acc[KVQ_FRAG_ROWS][NC];
#pragma unroll
  for (int r = 0; r < KVQ_FRAG_ROWS; ++r)
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f;
  __syncthreads();
  const int nb = min(a.band_lens[b], (c + 1) * KVQ_BAND_TILE);
  const size_t rows0 = ((size_t)b * a.H + h) * (size_t)a.band_cap;
  const int u = tid % KVQ_BAND_TILE, half = tid / KVQ_BAND_TILE;  // 128 threads = 2 halves of d
  for (int t0 = c * KVQ_BAND_TILE; t0 < nb; t0 += KVQ_BAND_TILE) {
    const int tile = min(KVQ_BAND_TILE, nb - t0);
    float dot[KVQ_FRAG_ROWS];
#pragma unroll
    for (int r = 0; r < KVQ_FRAG_ROWS; ++r) dot[r] = 0.0f;
    if (u < tile) {
      const size_t krow = (rows0 + t0 + u) * D;
      for (int j = half * (D / 2); j < (half + 1) * (D / 2); ++j) {
        const float kj = kvq_load_as_float(a.band_k, a.band_dtype, krow + j);
#pragma unroll
        for (int r = 0; r < KVQ_FRAG_ROWS; ++r) dot[r] += s_q[r * D + j] * kj;
      }
    }
#pragma unroll
    for (int r = 0; r < KVQ_FRAG_ROWS; ++r) s_part[half][r][u] = dot[r];
    __syncthreads();
    if (tid < a.R) {
      const int r = tid;
      float tmax = -INFINITY;
      for (int v = 0; v < tile; ++v) tmax = fmaxf(tmax, s_part[0][r][v] + s_part[1][r][v]);
      const float m_new = fmaxf(s_m[r], tmax);
      const float ref = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = kvq_ex2(s_m[r] - ref);
      float sum = 0.0f;
      for (int v = 0; v < tile; ++v) {
        const float p = kvq_ex2(s_part[0][r][v] + s_part[1][r][v] - ref);
        s_p[r][v] = p;
        sum += p;
      }
      s_l[r] = s_l[r] * alpha + sum;
      s_m[r] = m_new;
      s_alpha[r] = alpha;
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int j = tid + c * KVQ_FRAG_THREADS;
#pragma unroll
      for (int r = 0; r < KVQ_FRAG_ROWS; ++r)
        if (r < a.R) acc[r][c] *= s_alpha[r];
      if (j >= D) continue;
      for (int v = 0; v < tile; ++v) {
        const float val = kvq_load_as_float(a.band_v, a.band_dtype, (rows0 + t0 + v) * D + j);
#pragma unroll
        for (int r = 0; r < KVQ_FRAG_ROWS; ++r)
          if (r < a.R) acc[r][c] += s_p[r][v] * val;
      }
    }
    __syncthreads();
  }
  const size_t bh = (size_t)b * a.H + h;
#pragma unroll
  for (int r = 0; r < KVQ_FRAG_ROWS; ++r) {
    if (r >= a.R) break;
    float* p = kvq_frag_partial(a, bh, a.splits + c, r, D);
    if (tid == 0) {
      p[0] = s_m[r];
      p[1] = s_l[r];
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int j = tid + c * KVQ_FRAG_THREADS;
      if (j < D) p[2 + j] = acc[r][c];
    }
  }
}


// Grid B H R, one CTA per query row: merge of the S partials, inverse value rotation, the NB band
// partials, division, store. The merge is on the critical path of a call (at batch 1, where S is about 50, the
// longest part of it after the split kernel), so it is short and wide:
//   * it is launched as a programmatic dependent of the split kernel (kvq_launch_dependent; the split
//     CTAs release it as they start), so its launch and its reads of the call's constants (the value
//     rotation's signs and permutation) overlap the split kernel, and kvq_wait_prerequisites holds it
//     until every partial is written;
//   * one pass over the partials: KVQ_MERGE_THREADS threads = SG groups of splits x D coordinates, each
//     thread with a running maximum and rescaled sums over its group's splits, taken in batches of
//     KVQ_MERGE_BATCH = 16 whose 48 loads are all issued before the first is used: ceil(S / (16 SG))
//     dependent round trips (one at d = 128 up to 64 splits, which covers batch 1, where S is about 50),
//     after the band's NB partials (one for a band of up to 64 tokens); the SG groups' (m, l, acc)
//     merge in shared memory.
// (The host emulation runs 2 D threads, SG = 2: the same code, a quarter of the OS threads at d = 128.)
#define KVQ_MERGE_BATCH 16  // splits a merge thread loads before it uses the first (gpu/cuda/roofline.py)
#ifdef KVQ_HOST_EMULATION
#define KVQ_MERGE_THREADS (2 * KVQ_FRAG_D)
#else
#define KVQ_MERGE_THREADS 512
#endif
template <int D>
__global__ void __launch_bounds__(KVQ_MERGE_THREADS) kvq_frag_merge_kernel(FragArgs a) {
  constexpr int SG = KVQ_MERGE_THREADS / D;
  static_assert(SG >= 1 && KVQ_MERGE_THREADS % 32 == 0, "the merge needs a thread per coordinate");
  __shared__ float s_m[SG], s_l[SG];
  __shared__ float s_acc[SG][D];
  __shared__ float s_y[D];
  const int tid = threadIdx.x, sg = tid / D, j = tid % D;
  const size_t bh = blockIdx.x / (unsigned)a.R;
  const int r = (int)(blockIdx.x % (unsigned)a.R);
  const int b = (int)(bh / (unsigned)a.H), h = (int)(bh % (unsigned)a.H);
  // the call's inputs, which the split kernel does not write: read while it may still run
  const float sign1 = a.vsigns[j], sign2 = a.vsigns[D + j];
  const int src = a.vinv_perm[j];
  kvq_wait_prerequisites();  // from here every partial is written and visible
  float mb = -INFINITY, lb = 0.0f, ob = 0.0f;  // the band steps' partials, merged (group 0 only)
  if (sg == 0) {
    for (int c = 0; c < a.band_ctas; ++c) {
      const float* pb = kvq_frag_partial(a, bh, a.splits + c, r, D);
      const float mc = pb[0], mn = fmaxf(mb, mc);
      const float ref = mn == -INFINITY ? 0.0f : mn;
      const float c_old = kvq_ex2(mb - ref), cc = kvq_ex2(mc - ref);
      lb = lb * c_old + cc * pb[1];
      ob = ob * c_old + cc * pb[2 + j];
      mb = mn;
    }
  }
  // splits sg, sg + SG, ...: the running maximum m and the sums l, acc against max(m, 0 if m = -inf),
  // in batches of KVQ_MERGE_BATCH splits whose loads all go out before any is used (one round trip a batch)
  constexpr int NB = KVQ_MERGE_BATCH;
  float m = -INFINITY, acc = 0.0f, l = 0.0f;
  for (int s0 = sg; s0 < a.splits; s0 += NB * SG) {
    float ms[NB], ls[NB], os[NB];
#pragma unroll
    for (int u = 0; u < NB; ++u) {
      const int s = s0 + u * SG;
      ms[u] = -INFINITY;  // past the last split: weighs nothing
      ls[u] = os[u] = 0.0f;
      if (s < a.splits) {
        const float* p = kvq_frag_partial(a, bh, s, r, D);
        ms[u] = p[0];
        ls[u] = p[1];
        os[u] = p[2 + j];
      }
    }
    float mn = m;
#pragma unroll
    for (int u = 0; u < NB; ++u) mn = fmaxf(mn, ms[u]);
    const float ref = mn == -INFINITY ? 0.0f : mn;  // empty splits (m = -inf, l = 0) weigh nothing
    const float c_old = kvq_ex2(m - ref);
    acc *= c_old;
    l *= c_old;
#pragma unroll
    for (int u = 0; u < NB; ++u) {
      const float c = kvq_ex2(ms[u] - ref);
      acc += c * os[u];
      l += c * ls[u];
    }
    m = mn;
  }
  if (j == 0) {
    s_m[sg] = m;
    s_l[sg] = l;
  }
  s_acc[sg][j] = acc;
  __syncthreads();
  m = s_m[0];
#pragma unroll
  for (int g = 1; g < SG; ++g) m = fmaxf(m, s_m[g]);
  const float ref = m == -INFINITY ? 0.0f : m;
  if (sg == 0) {  // R_V^T y = D1 P^T (H_b / sqrt(b)) D2 y
    float y = 0.0f;
    l = 0.0f;
#pragma unroll
    for (int g = 0; g < SG; ++g) {
      const float c = kvq_ex2(s_m[g] - ref);
      y += c * s_acc[g][j];
      l += c * s_l[g];
    }
    s_y[j] = y * sign2;
  }
  for (int hh = 1; hh < a.vhblock; hh <<= 1) {
    __syncthreads();
    for (int p = tid; p < D / 2; p += KVQ_MERGE_THREADS) {
      const int i = (p / hh) * 2 * hh + (p % hh);
      const float lo = s_y[i], hi = s_y[i + hh];
      s_y[i] = lo + hi;
      s_y[i + hh] = lo - hi;
    }
  }
  __syncthreads();
  if (sg != 0) return;
  const float mt = fmaxf(m, mb);
  const float rt = mt == -INFINITY ? 0.0f : mt;
  const float ce = kvq_ex2(m - rt), cb = kvq_ex2(mb - rt);
  const float den = l * ce + lb * cb;
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;  // a row that sees no token gets 0
  const int t = r / a.G, g = r % a.G;
  const size_t orow = ((((size_t)b * a.T + t) * a.H + h) * a.G + g) * D;
  const float x = s_y[src] * (1.0f / sqrtf((float)a.vhblock)) * sign1;
  const float o = (x * ce + ob * cb) * inv;
  if (a.out_dtype == KVQ_DT_F32) {
    ((float*)a.out)[orow + j] = o;
  } else if (a.out_dtype == KVQ_DT_F16) {
    ((unsigned short*)a.out)[orow + j] = __half_as_ushort(__float2half_rn(o));
  } else {
    ((unsigned short*)a.out)[orow + j] = kvq_to_bf16(o);
  }
}

#endif  // KVQ_FRAG_PARTS_CUH
