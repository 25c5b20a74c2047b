// Split-K decode attention over a paged TurboQuantMSE cache in the fragment layout (kvq_frag.cuh),
// on tensor cores: mma.sync.m16n8k16 with the GQA group as N = 8, levels looked up by byte permutes
// straight into the A fragments.
//
// What it computes: gpu.triton.paged's split-and-merge (kvq_ref.attention.attention_decode per
// sequence and KV head), the same plan (gpu.schedule.plan_splits), block tables, per-sequence
// lengths and 16-bit band:
//   1. kvq_frag_split_kernel<D, KB, VB>, grid B H (S + 1), 4 warps: CTA (b, h, s < S) attends the
//      R = T G <= 8 query rows of KV head h to the encoded tokens [s C, (s + 1) C) of sequence b; the
//      CTA (b, h, S) to the band. The query rows are rotated once (R_K q, in shared memory), scaled by
//      sm_scale log2(e) and a power of two that keeps them well inside float16, and held as the B
//      fragments of S^T = K Q^T (16 tokens x 8 rows). Each warp owns tiles of 16 tokens (U = 2 at
//      once below 4 bits), loads a tile's K and V words with 16-byte loads one group ahead, and per tile:
//        * scores: D / 16 MMAs on the decoded K pairs; times the key norm (one multiply per score);
//        * lazy softmax: scores are compared with the running max first; only when one exceeds it
//          (or the tile is the sequence's last, partial one) does the warp reduce the tile max across
//          its lanes and rescale its accumulators, so p = 2^(z - m) <= 1 always;
//        * P^T: p times the value norm (the norm folded into P), rounded to fp16 pairs, transposed to
//          the B fragments of O^T = V^T P^T by two movmatrix;
//        * O^T += V^T P^T: D / 16 MMAs on the decoded V pairs (value-rotation domain).
//      The 4 warps' (m, l, O) merge in shared memory; the CTA writes its partial (log2 domain) to the
//      workspace. The band CTA computes its partial in float32 (original domain).
//   2. kvq_frag_merge_kernel, grid B H: log-sum-exp merge of the S partials, one inverse value
//      rotation, the band partial, the division, the store in the query's dtype.
// Empty splits and masked tokens leave m = -inf, l = 0; every exponent is taken against a finite
// reference, so they merge as nothing; a row that sees no token gets 0.
//
// Precision (tests/gpu/test_cuda_fragment_attention.py derives the tier): levels, rotated queries and
// p * v_norm are rounded to float16 (products exact, float32 accumulation in the tensor cores), key
// norms, softmax and sums are float32, 2^x is MUFU.EX2 (relative error < 2^-22).
//
// One instantiation per library (KVQ_FRAG_D, KVQ_FRAG_KB, KVQ_FRAG_VB; gpu/cuda/frag_binding.py).

#include <math.h>

#include "kvq_common.cuh"
#include "kvq_frag.cuh"

#define KVQ_FRAG_WARPS 4
#define KVQ_FRAG_THREADS (32 * KVQ_FRAG_WARPS)
#define KVQ_FRAG_ROWS 8      // query rows per KV head: the MMA's N
#define KVQ_BAND_TILE 64     // band tokens per step of the float32 band path
#define KVQ_LOG2E 1.4426950408889634f

#ifndef KVQ_FRAG_D
#define KVQ_FRAG_D 128
#endif
#ifndef KVQ_FRAG_KB
#define KVQ_FRAG_KB 4
#endif
#ifndef KVQ_FRAG_VB
#define KVQ_FRAG_VB 4
#endif

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
  int page_size, bt_stride;
  const void* band_k;    // (B, H, band_cap, d), band_dtype
  const void* band_v;
  const int* band_lens;  // (B,)
  int band_dtype, band_cap;
  uint32_t kpool[4], vpool[4];
  KvqMul mul;
  const int* kperm;      // key rotation: perm (d), signs (2, d) = (signs1, signs2), Hadamard block
  const float* ksigns;
  const int* vinv_perm;  // value rotation: inverse perm, signs (2, d), block
  const float* vsigns;
  int khblock, vhblock;
  float sm_scale;
  int splits, chunk;
  float* ws;             // (B, H, S + 1, 8, d + 2): m (log2 units), l, acc[d]
};

template <int D, int KB, int VB>
struct FragCfg {
  static constexpr int U = (KB == 4 || VB == 4) ? 1 : 2;  // tiles a warp takes per step
  static constexpr int KS = D / 16;                       // k-steps (K) = m-tiles (V)
  static constexpr int TB = kvq_frag_tile_bytes(D, KB, VB);
  static constexpr int NWK = KvqSide<D, KB>::kWords, NWV = KvqSide<D, VB>::kWords;
};

__device__ __forceinline__ float kvq_load_as_float(const void* p, int dtype, size_t i) {
  if (dtype == KVQ_DT_F32) return ((const float*)p)[i];
  const unsigned short u = ((const unsigned short*)p)[i];
  return dtype == KVQ_DT_F16 ? __half2float(__ushort_as_half(u)) : kvq_bf16(u);
}

__device__ __forceinline__ float* kvq_frag_partial(const FragArgs& a, size_t bh, int s, int r, int d) {
  return a.ws + ((bh * (size_t)(a.splits + 1) + (size_t)s) * KVQ_FRAG_ROWS + (size_t)r) * (size_t)(d + 2);
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

template <int D, int KB, int VB>
struct TileRegs {
  uint32_t kw[FragCfg<D, KB, VB>::NWK];
  uint32_t vw[FragCfg<D, KB, VB>::NWV];
  uint2 nrm;
};

template <int D, int KB, int VB>
__device__ __forceinline__ void kvq_frag_fetch(const FragArgs& a, int b, int h, int tile, int lane,
                                               TileRegs<D, KB, VB>& r) {
  using C = FragCfg<D, KB, VB>;
  const int tok = 16 * tile;
  const int page = a.block_table[(size_t)b * a.bt_stride + tok / a.page_size];
  const uint8_t* base = a.kv + (((size_t)page * a.H + h) * (size_t)(a.page_size / 16) + (tok % a.page_size) / 16) *
                                   (size_t)C::TB;
  kvq_frag_load<C::NWK>(base, lane, r.kw);
  kvq_frag_load<C::NWV>(base + KvqSide<D, KB>::kBytes, lane, r.vw);
  r.nrm = *(const uint2*)(base + KvqSide<D, KB>::kBytes + KvqSide<D, VB>::kBytes + 8 * (lane / 4));
}

// The float32 band partial (original domain) of CTA (b, h, S).
template <int D>
__device__ void kvq_frag_band(const FragArgs& a, int b, int h, float* s_buf) {
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
  const int nb = a.band_lens[b];
  const size_t rows0 = ((size_t)b * a.H + h) * (size_t)a.band_cap;
  const int u = tid % KVQ_BAND_TILE, half = tid / KVQ_BAND_TILE;  // 128 threads = 2 halves of d
  for (int t0 = 0; t0 < nb; t0 += KVQ_BAND_TILE) {
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
    float* p = kvq_frag_partial(a, bh, a.splits, r, D);
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

template <int D, int KB, int VB>
__global__ void __launch_bounds__(KVQ_FRAG_THREADS) kvq_frag_split_kernel(FragArgs a) {
  using C = FragCfg<D, KB, VB>;
  constexpr int U = C::U, KS = C::KS;
  __shared__ float s_buf[KVQ_FRAG_WARPS * KVQ_FRAG_ROWS * D];  // q and its rotation, then the warps' O
  __shared__ float s_m[KVQ_FRAG_WARPS][KVQ_FRAG_ROWS], s_l[KVQ_FRAG_WARPS][KVQ_FRAG_ROWS];
  __shared__ float s_qmax[KVQ_FRAG_WARPS];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int S = a.splits;
  const int b = (int)(blockIdx.x / (unsigned)(a.H * (S + 1)));
  const int h = (int)(blockIdx.x / (unsigned)(S + 1) % (unsigned)a.H);
  const int s = (int)(blockIdx.x % (unsigned)(S + 1));
  if (s == S) {
    kvq_frag_band<D>(a, b, h, s_buf);
    return;
  }
  const size_t bh = (size_t)b * a.H + h;

  // ---- the rotated, scaled query as the B fragments of the score MMAs ----
  float* s_q = s_buf;
  float* s_w = s_buf + KVQ_FRAG_ROWS * D;
  kvq_frag_load_q<D>(a, b, h, 1.0f, s_q);
  __syncthreads();
  for (int i = tid; i < KVQ_FRAG_ROWS * D; i += KVQ_FRAG_THREADS) {  // w = P D1 q
    const int r = i / D, p = a.kperm[i % D];
    s_w[i] = s_q[r * D + p] * a.ksigns[p];
  }
  for (int hh = 1; hh < a.khblock; hh <<= 1) {  // butterflies (x, y) -> (x + y, x - y)
    __syncthreads();
    for (int i = tid; i < KVQ_FRAG_ROWS * D / 2; i += KVQ_FRAG_THREADS) {
      const int r = i / (D / 2), p = i % (D / 2);
      const int j = r * D + (p / hh) * 2 * hh + (p % hh);
      const float lo = s_w[j], hi = s_w[j + hh];
      s_w[j] = lo + hi;
      s_w[j + hh] = lo - hi;
    }
  }
  __syncthreads();
  const float qscale_in = a.sm_scale * KVQ_LOG2E / sqrtf((float)a.khblock);
  float mx = 0.0f;
  for (int i = tid; i < KVQ_FRAG_ROWS * D; i += KVQ_FRAG_THREADS) {
    const float v = s_w[i] * a.ksigns[D + i % D] * qscale_in;
    s_w[i] = v;
    mx = fmaxf(mx, fabsf(v));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, off));
  if (lane == 0) s_qmax[warp] = mx;
  __syncthreads();
  mx = fmaxf(fmaxf(s_qmax[0], s_qmax[1]), fmaxf(s_qmax[2], s_qmax[3]));
  int e = 0;
  frexpf(mx, &e);                                      // mx < 2^e: scaled entries < 2^14
  const float qs = mx > 0.0f ? ldexpf(1.0f, 14 - e) : 1.0f;
  const float kscale = 1.0f / qs;                      // exact: a power of two
  uint32_t qb[KS][2];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const float* row = s_w + g * D + 16 * ks + 2 * t;
    qb[ks][0] = kvq_pack_half2(row[0] * qs, row[1] * qs);
    qb[ks][1] = kvq_pack_half2(row[8] * qs, row[9] * qs);
  }

  // ---- the encoded tokens of this split ----
  uint32_t kpool[4], vpool[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    kpool[i] = a.kpool[i];
    vpool[i] = a.vpool[i];
  }
  const KvqMul mul = a.mul;
  const int n = a.seq_lens[b];
  const int t0 = min(n, s * a.chunk), t1 = min(n, (s + 1) * a.chunk);
  // t0 is a multiple of 16 unless the split is empty (t0 = t1 = n): then it has no tile
  const int tile0 = t0 / KVQ_FRAG_TILE, tile1 = t1 > t0 ? (t1 + KVQ_FRAG_TILE - 1) / KVQ_FRAG_TILE : tile0;
  const int groups = (tile1 - tile0 + U - 1) / U;
  float acc[KS][4];
#pragma unroll
  for (int i = 0; i < KS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max of query rows 2t, 2t + 1 (log2 units)
  float rf0 = 0.0f, rf1 = 0.0f;          // the finite reference p is taken against
  float l0 = 0.0f, l1 = 0.0f;            // this lane's part of the running sums
  TileRegs<D, KB, VB> nxt[U] = {};
  if (warp < groups) {
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (tile0 + warp * U + u < tile1) kvq_frag_fetch<D, KB, VB>(a, b, h, tile0 + warp * U + u, lane, nxt[u]);
  }
  for (int grp = warp; grp < groups; grp += KVQ_FRAG_WARPS) {
    TileRegs<D, KB, VB> cur[U];
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = nxt[u];
    const int first = tile0 + grp * U;
    if (grp + KVQ_FRAG_WARPS < groups) {  // the warp's next group, one step ahead
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int tl = first + KVQ_FRAG_WARPS * U + u;
        if (tl < tile1) kvq_frag_fetch<D, KB, VB>(a, b, h, tl, lane, nxt[u]);
      }
    }
    // scores S^T = K Q^T, times the key norms
    float z[U][4], vn[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint32_t hk[D / 4];
      kvq_frag_decode<D, KB>(cur[u].kw, kpool, mul, hk);
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) kvq_mma(sc, hk[4 * ks], hk[4 * ks + 1], hk[4 * ks + 2], hk[4 * ks + 3], qb[ks][0], qb[ks][1]);
      const float kn0 = kvq_half_lo(cur[u].nrm.x) * kscale, kn1 = kvq_half_hi(cur[u].nrm.x) * kscale;
      z[u][0] = sc[0] * kn0;
      z[u][1] = sc[1] * kn0;
      z[u][2] = sc[2] * kn1;
      z[u][3] = sc[3] * kn1;
      vn[u][0] = kvq_half_lo(cur[u].nrm.y);
      vn[u][1] = kvq_half_hi(cur[u].nrm.y);
    }
    // the split's last group: mask tokens >= t1 (past the sequence, their slots may hold anything; or
    // the next split's, or a tile of the group past the split, which was not loaded)
    const bool partial = KVQ_FRAG_TILE * (first + U) > t1;
    if (partial) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int tok = KVQ_FRAG_TILE * (first + u) + g;
        if (tok >= t1) {
          z[u][0] = z[u][1] = -INFINITY;
          vn[u][0] = 0.0f;
        }
        if (tok + 8 >= t1) {
          z[u][2] = z[u][3] = -INFINITY;
          vn[u][1] = 0.0f;
        }
      }
    }
    float mx0 = fmaxf(z[0][0], z[0][2]), mx1 = fmaxf(z[0][1], z[0][3]);
#pragma unroll
    for (int u = 1; u < U; ++u) {
      mx0 = fmaxf(mx0, fmaxf(z[u][0], z[u][2]));
      mx1 = fmaxf(mx1, fmaxf(z[u][1], z[u][3]));
    }
    // lazy rescaling: only when a score exceeds the running max (or on the masked tile)
    if (__any_sync(0xFFFFFFFFu, partial || mx0 > m0 || mx1 > m1)) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xFFFFFFFFu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xFFFFFFFFu, mx1, off));
      }
      const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
      const float r0 = n0 == -INFINITY ? 0.0f : n0, r1 = n1 == -INFINITY ? 0.0f : n1;
      const float al0 = kvq_ex2(m0 - r0), al1 = kvq_ex2(m1 - r1);
      m0 = n0;
      m1 = n1;
      rf0 = r0;
      rf1 = r1;
      l0 *= al0;
      l1 *= al1;
#pragma unroll
      for (int i = 0; i < KS; ++i) {
        acc[i][0] *= al0;
        acc[i][1] *= al1;
        acc[i][2] *= al0;
        acc[i][3] *= al1;
      }
    }
    // P^T (value norms folded in) and O^T += V^T P^T
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float p0 = kvq_ex2(z[u][0] - rf0), p1 = kvq_ex2(z[u][1] - rf1);
      const float p2 = kvq_ex2(z[u][2] - rf0), p3 = kvq_ex2(z[u][3] - rf1);
      l0 += p0 + p2;
      l1 += p1 + p3;
      const uint32_t b01 = kvq_movmatrix(kvq_pack_half2(p0 * vn[u][0], p1 * vn[u][0]));
      const uint32_t b23 = kvq_movmatrix(kvq_pack_half2(p2 * vn[u][1], p3 * vn[u][1]));
      uint32_t hv[D / 4];
      kvq_frag_decode<D, VB>(cur[u].vw, vpool, mul, hv);
#pragma unroll
      for (int ms = 0; ms < KS; ++ms) kvq_mma(acc[ms], hv[4 * ms], hv[4 * ms + 1], hv[4 * ms + 2], hv[4 * ms + 3], b01, b23);
    }
  }
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xFFFFFFFFu, l0, off);
    l1 += __shfl_xor_sync(0xFFFFFFFFu, l1, off);
  }

  // ---- the four warps' partials, merged in shared memory ----
  __syncthreads();  // s_buf's query copies are dead
  float* s_o = s_buf + warp * KVQ_FRAG_ROWS * D;
  if (g == 0) {
    s_m[warp][2 * t] = m0;
    s_m[warp][2 * t + 1] = m1;
    s_l[warp][2 * t] = l0;
    s_l[warp][2 * t + 1] = l1;
  }
#pragma unroll
  for (int i = 0; i < KS; ++i) {
    s_o[(2 * t) * D + 16 * i + g] = acc[i][0];
    s_o[(2 * t + 1) * D + 16 * i + g] = acc[i][1];
    s_o[(2 * t) * D + 16 * i + g + 8] = acc[i][2];
    s_o[(2 * t + 1) * D + 16 * i + g + 8] = acc[i][3];
  }
  __syncthreads();
  for (int i = tid; i < a.R * (D + 2); i += KVQ_FRAG_THREADS) {
    const int r = i / (D + 2), j = i % (D + 2);
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < KVQ_FRAG_WARPS; ++w) mm = fmaxf(mm, s_m[w][r]);
    const float ref = mm == -INFINITY ? 0.0f : mm;
    float v = 0.0f;
    if (j == 0) {
      v = mm;
    } else {
#pragma unroll
      for (int w = 0; w < KVQ_FRAG_WARPS; ++w) {
        const float c = kvq_ex2(s_m[w][r] - ref);
        v += c * (j == 1 ? s_l[w][r] : s_buf[(w * KVQ_FRAG_ROWS + r) * D + j - 2]);
      }
    }
    kvq_frag_partial(a, bh, s, r, D)[j] = v;
  }
}

// Grid B H: merge of the S partials, inverse value rotation, band partial, division, store.
template <int D>
__global__ void __launch_bounds__(KVQ_FRAG_THREADS) kvq_frag_merge_kernel(FragArgs a) {
  __shared__ float s_y[D];
  constexpr int NC = (D + KVQ_FRAG_THREADS - 1) / KVQ_FRAG_THREADS;
  const int tid = threadIdx.x;
  const size_t bh = blockIdx.x;
  const int b = (int)(bh / (unsigned)a.H), h = (int)(bh % (unsigned)a.H);
  const float hscale = 1.0f / sqrtf((float)a.vhblock);
  for (int r = 0; r < a.R; ++r) {
    float m = -INFINITY;
    for (int s = 0; s < a.splits; ++s) m = fmaxf(m, kvq_frag_partial(a, bh, s, r, D)[0]);
    const float ref = m == -INFINITY ? 0.0f : m;
    float l = 0.0f, acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    for (int s = 0; s < a.splits; ++s) {
      const float* p = kvq_frag_partial(a, bh, s, r, D);
      const float w = kvq_ex2(p[0] - ref);
      l += w * p[1];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int j = tid + c * KVQ_FRAG_THREADS;
        if (j < D) acc[c] += w * p[2 + j];
      }
    }
    // R_V^T y = D1 P^T (H_b / sqrt(b)) D2 y
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int j = tid + c * KVQ_FRAG_THREADS;
      if (j < D) s_y[j] = acc[c] * a.vsigns[D + j];
    }
    for (int hh = 1; hh < a.vhblock; hh <<= 1) {
      __syncthreads();
      for (int p = tid; p < D / 2; p += KVQ_FRAG_THREADS) {
        const int i = (p / hh) * 2 * hh + (p % hh);
        const float lo = s_y[i], hi = s_y[i + hh];
        s_y[i] = lo + hi;
        s_y[i + hh] = lo - hi;
      }
    }
    __syncthreads();
    const float* pb = kvq_frag_partial(a, bh, a.splits, r, D);
    const float mt = fmaxf(m, pb[0]);
    const float rt = mt == -INFINITY ? 0.0f : mt;
    const float ce = kvq_ex2(m - rt), cb = kvq_ex2(pb[0] - rt);
    const float den = l * ce + pb[1] * cb;
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    const int t = r / a.G, g = r % a.G;
    const size_t orow = ((((size_t)b * a.T + t) * a.H + h) * a.G + g) * D;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int j = tid + c * KVQ_FRAG_THREADS;
      if (j >= D) continue;
      const float x = s_y[a.vinv_perm[j]] * hscale * a.vsigns[j];
      const float o = (x * ce + pb[2 + j] * cb) * inv;
      if (a.out_dtype == KVQ_DT_F32) {
        ((float*)a.out)[orow + j] = o;
      } else if (a.out_dtype == KVQ_DT_F16) {
        ((unsigned short*)a.out)[orow + j] = __half_as_ushort(__float2half_rn(o));
      } else {
        ((unsigned short*)a.out)[orow + j] = kvq_to_bf16(o);
      }
    }
    __syncthreads();  // s_y is rewritten for the next row
  }
}

// Tests: the pairs every lane decodes from each tile (the kernel's loads and lookups, nothing else):
// out_k, out_v (ntiles, 32, D / 4) uint32. Grid ntiles, one warp.
template <int D, int KB, int VB>
__global__ void kvq_frag_decode_kernel(const uint8_t* tiles, FragArgs a, uint32_t* out_k, uint32_t* out_v) {
  using C = FragCfg<D, KB, VB>;
  const int lane = threadIdx.x % 32;
  const uint8_t* base = tiles + (size_t)blockIdx.x * C::TB;
  TileRegs<D, KB, VB> r;
  kvq_frag_load<C::NWK>(base, lane, r.kw);
  kvq_frag_load<C::NWV>(base + KvqSide<D, KB>::kBytes, lane, r.vw);
  uint32_t hk[D / 4], hv[D / 4];
  kvq_frag_decode<D, KB>(r.kw, a.kpool, a.mul, hk);
  kvq_frag_decode<D, VB>(r.vw, a.vpool, a.mul, hv);
  for (int i = 0; i < D / 4; ++i) {
    out_k[((size_t)blockIdx.x * 32 + lane) * (D / 4) + i] = hk[i];
    out_v[((size_t)blockIdx.x * 32 + lane) * (D / 4) + i] = hv[i];
  }
}

#define KVQ_FRAG_CFG KVQ_FRAG_D, KVQ_FRAG_KB, KVQ_FRAG_VB

extern "C" int kvq_frag_args_size() { return (int)sizeof(FragArgs); }
extern "C" int kvq_frag_config(int which) { return which == 0 ? KVQ_FRAG_D : which == 1 ? KVQ_FRAG_KB : KVQ_FRAG_VB; }

// Split + merge. Returns KVQ_OK, KVQ_EINVAL (refused, nothing launched) or the cudaError_t.
extern "C" int kvq_frag_attention(const FragArgs* args, void* stream) {
  const FragArgs& a = *args;
  if (a.d != KVQ_FRAG_D || a.B < 0 || a.H < 1 || a.T < 1 || a.G < 1 || a.R != a.T * a.G || a.R > KVQ_FRAG_ROWS ||
      a.page_size < 16 || a.page_size % 16 || a.splits < 1 || a.chunk < 16 || a.chunk % 16 || a.band_cap < 1 ||
      a.khblock < 1 || KVQ_FRAG_D % a.khblock || a.vhblock < 1 || KVQ_FRAG_D % a.vhblock || a.ws == nullptr ||
      (long long)a.B * a.H * (a.splits + 1) > 0x7FFFFFFFLL)
    return KVQ_EINVAL;
  if (a.B == 0) return KVQ_OK;
  auto* split = &kvq_frag_split_kernel<KVQ_FRAG_CFG>;
  auto* merge = &kvq_frag_merge_kernel<KVQ_FRAG_D>;
  KVQ_LAUNCH(split, (unsigned)(a.B * a.H * (a.splits + 1)), KVQ_FRAG_THREADS, (cudaStream_t)stream)(a);
  int rc = (int)cudaGetLastError();
  if (rc) return rc;
  KVQ_LAUNCH(merge, (unsigned)(a.B * a.H), KVQ_FRAG_THREADS, (cudaStream_t)stream)(a);
  return (int)cudaGetLastError();
}

extern "C" int kvq_frag_decode_tiles(const uint8_t* tiles, int ntiles, const FragArgs* args, uint32_t* out_k,
                                     uint32_t* out_v, void* stream) {
  if (ntiles < 0) return KVQ_EINVAL;
  if (ntiles == 0) return KVQ_OK;
  auto* decode = &kvq_frag_decode_kernel<KVQ_FRAG_CFG>;
  KVQ_LAUNCH(decode, (unsigned)ntiles, 32, (cudaStream_t)stream)(tiles, *args, out_k, out_v);
  return (int)cudaGetLastError();
}

// This library's own CUDA runtime (nvcc links one per shared library): device and error strings.
extern "C" int kvq_frag_set_device(int device) { return (int)cudaSetDevice(device); }
extern "C" const char* kvq_frag_error_string(int code) {
  if (code == KVQ_EINVAL) return "invalid arguments (refused before launch)";
  return cudaGetErrorString((cudaError_t)code);
}
