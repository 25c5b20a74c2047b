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
//   2. kvq_frag_merge_kernel, grid B H R (a CTA per query row, 512 threads): log-sum-exp merge of the
//      S partials, one inverse value rotation, the band partial, the division, the store in q's dtype.
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
// CTAs per SM the register budget must allow: 4 (<= 128 registers); at head_dim 256 the accumulators
// and query fragments alone take 96 registers, so 3 (<= 168) rather than spilling, and 2 with the
// int8 keys' 32 more registers of quads
#define KVQ_FRAG_MIN_BLOCKS(D, KB) ((D) >= 256 ? ((KB) == 2 ? 2 : 3) : 4)

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
  float* ws;             // (B, H, S + 1, 8, d + 2): m (log2 units), l, acc[d]
};

// Per configuration: U tiles a warp takes per step (2 below 4 bits: one lazy-softmax check for two
// tiles), and STAGES shared-memory slots per warp for cp.async (STAGES - 1 groups in flight); the
// largest of (U, STAGES) = (2, 4), (2, 2), (1, 4), (1, 2) whose ring fits 44 KB of static shared memory.
template <int D, int KB, int VB>
struct FragCfg {
  static constexpr int KS = D / 16;                       // k-steps (K) = m-tiles (V)
  static constexpr int TB = kvq_frag_tile_bytes(D, KB, VB);
  static constexpr int NWK = KvqSide<D, KB>::kWords, NWV = KvqSide<D, VB>::kWords;
  static constexpr int CODES = 2 * D * (KB + VB);         // K and V bytes of a tile
  static constexpr int SLOT = CODES + 32 * 8;             // a tile in the ring: codes, then 32 lanes' norms
  static constexpr int RING_MAX = 44 * 1024;
  static constexpr bool fits(int u, int st) { return KVQ_FRAG_WARPS * st * u * SLOT <= RING_MAX; }
  static constexpr int U = (KB < 4 && VB < 4 && (fits(2, 4) || fits(2, 2))) ? 2 : 1;
  static constexpr int STAGES = fits(U, 4) ? 4 : 2;
  static constexpr int RING = KVQ_FRAG_WARPS * STAGES * U * SLOT;
  static_assert(fits(U, STAGES), "the cp.async ring does not fit");
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

// Where sequence b's tiles of KV head h live, and this lane's offsets into them: tile i is at
// kv + page_bytes * table[i >> log_tpp] + (i & (tpp - 1)) * tile_bytes (page_size a power of two: no
// division in the loop). g16/g8/g4 are kv + the head's offset + 16/8/4 lane, gn the lane's norm group;
// s16/s8/s4 the lane's offsets into the warp's ring.
struct FragSeq {
  const int* table;
  const uint8_t *g16, *g8, *g4, *gn;
  kvq_saddr s16, s8, s4;
  unsigned page_bytes, log_tpp, tpp_mask;
};

// Start the copies of a group of U tiles (the first, `tile`, in page `page`; the group never crosses a
// page: U divides page_size / 16 and the group's first tile) into the ring slot at byte `soff`.
template <int D, int KB, int VB>
__device__ __forceinline__ void kvq_frag_issue(const FragSeq& sq, unsigned page, unsigned tile, unsigned soff) {
  using C = FragCfg<D, KB, VB>;
  constexpr int KBY = KvqSide<D, KB>::kBytes;
  const unsigned long long delta = (unsigned long long)page * sq.page_bytes + (tile & sq.tpp_mask) * (unsigned)C::TB;
  const uint8_t *g16 = sq.g16 + delta, *g8 = sq.g8 + delta, *g4 = sq.g4 + delta, *gn = sq.gn + delta;
  const kvq_saddr s16 = sq.s16 + soff, s8 = sq.s8 + soff, s4 = sq.s4 + soff;
#pragma unroll
  for (int u = 0; u < C::U; ++u) {
    const int so = u * C::SLOT, go = u * C::TB;
    kvq_frag_copy_l<C::NWK>(s16 + so, g16 + go, s8 + so, g8 + go, s4 + so, g4 + go);
    kvq_frag_copy_l<C::NWV>(s16 + so + KBY, g16 + go + KBY, s8 + so + KBY, g8 + go + KBY, s4 + so + KBY, g4 + go + KBY);
    kvq_cp<8>(s8 + so + C::CODES, gn + go);  // the lane's own copy of its norm group
  }
}

// A warp's running softmax state: rows 2t, 2t + 1 of the C fragments (logits in log2 units).
template <int KS>
struct FragState {
  float acc[KS][4];   // O^T: (coord 16 i + g (+8), row 2t (+1))
  float m0, m1;       // running max, -inf before the first token
  float rf0, rf1;     // the finite reference p is taken against (m, or 0 while m = -inf)
  float l0, l1;       // this lane's part of the running sums
};

// Scores of a group: d = s kn / qs - rf (log2 units) for S^T = K Q^T (D / 16 MMAs a tile).
template <int D, int KB, int VB>
__device__ __forceinline__ void kvq_frag_scores(const FragState<D / 16>& st, const FragSeq& sq, unsigned soff,
                                                const uint32_t (&qb)[D / 16][2], const uint32_t (&kpool)[4],
                                                const KvqMul& mul, float kscale, float (&dd)[FragCfg<D, KB, VB>::U][4],
                                                uint32_t (&vn)[FragCfg<D, KB, VB>::U]) {
  using C = FragCfg<D, KB, VB>;
  constexpr int U = C::U, KS = D / 16;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    uint32_t kw[C::NWK];
    const int so = soff + u * C::SLOT;
    kvq_frag_lds_l<C::NWK>(sq.s16 + so, sq.s8 + so, sq.s4 + so, kw);
    const uint2 nrm = kvq_lds64(sq.s8 + so + C::CODES);
    float sc[4];
    if constexpr (KB == 2) {  // int8 keys: two passes (query high and low bytes), exact int32 sums
      uint32_t q8[D / 8];
      kvq_frag_decode_i8<D>(kw, kpool, mul, q8);
      int acc[4] = {0, 0, 0, 0};
#pragma unroll
      for (int ks = 0; ks < D / 32; ++ks) kvq_mma_s8(acc, q8[4 * ks], q8[4 * ks + 1], q8[4 * ks + 2], q8[4 * ks + 3], qb[ks][0], qb[ks][1]);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] *= 256;
#pragma unroll
      for (int ks = 0; ks < D / 32; ++ks)
        kvq_mma_s8(acc, q8[4 * ks], q8[4 * ks + 1], q8[4 * ks + 2], q8[4 * ks + 3], qb[D / 32 + ks][0], qb[D / 32 + ks][1]);
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[e] = (float)acc[e];
    } else {
      uint32_t hk[D / 4];
      kvq_frag_decode<D, KB>(kw, kpool, mul, hk);
      sc[0] = sc[1] = sc[2] = sc[3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) kvq_mma(sc, hk[4 * ks], hk[4 * ks + 1], hk[4 * ks + 2], hk[4 * ks + 3], qb[ks][0], qb[ks][1]);
    }
    const float kn0 = kvq_half_lo(nrm.x) * kscale, kn1 = kvq_half_hi(nrm.x) * kscale;
    vn[u] = nrm.y;
    dd[u][0] = sc[0] * kn0 - st.rf0;
    dd[u][1] = sc[1] * kn0 - st.rf1;
    dd[u][2] = sc[2] * kn1 - st.rf0;
    dd[u][3] = sc[3] * kn1 - st.rf1;
  }
}

// Lazy softmax and O^T += V^T P^T of a group whose scores are dd. Tokens at or past t1 are masked
// when `partial` (warp-uniform; the split's last group).
template <int D, int KB, int VB>
__device__ __forceinline__ void kvq_frag_values(FragState<D / 16>& st, const FragSeq& sq, unsigned soff,
                                                float (&dd)[FragCfg<D, KB, VB>::U][4], uint32_t (&vn)[FragCfg<D, KB, VB>::U],
                                                const uint32_t (&vpool)[4], const KvqMul& mul, int first, int t1,
                                                bool partial, int g) {
  using C = FragCfg<D, KB, VB>;
  constexpr int U = C::U, KS = D / 16;
  if (partial) {  // tokens >= t1 (past the split, or not loaded) weigh nothing
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = KVQ_FRAG_TILE * (first + u) + g;
      if (tok >= t1) {
        dd[u][0] = dd[u][1] = -INFINITY;
        vn[u] &= 0xFFFF0000u;
      }
      if (tok + 8 >= t1) {
        dd[u][2] = dd[u][3] = -INFINITY;
        vn[u] &= 0x0000FFFFu;
      }
    }
  }
  // lazy rescaling: only when a score reaches the reference (the sign bit of some d is clear), or on
  // the masked group (whose reference may still be the placeholder 0)
  uint32_t all_neg = 0xFFFFFFFFu;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) all_neg &= (uint32_t)__float_as_int(dd[u][i]);
  if (__any_sync(0xFFFFFFFFu, partial || (int)all_neg >= 0)) {
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      mx0 = fmaxf(mx0, fmaxf(dd[u][0], dd[u][2]) + st.rf0);
      mx1 = fmaxf(mx1, fmaxf(dd[u][1], dd[u][3]) + st.rf1);
    }
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xFFFFFFFFu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xFFFFFFFFu, mx1, off));
    }
    const float n0 = fmaxf(st.m0, mx0), n1 = fmaxf(st.m1, mx1);
    const float r0 = n0 == -INFINITY ? 0.0f : n0, r1 = n1 == -INFINITY ? 0.0f : n1;
    const float al0 = kvq_ex2(st.m0 - r0), al1 = kvq_ex2(st.m1 - r1);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      dd[u][0] += st.rf0 - r0;
      dd[u][1] += st.rf1 - r1;
      dd[u][2] += st.rf0 - r0;
      dd[u][3] += st.rf1 - r1;
    }
    st.m0 = n0;
    st.m1 = n1;
    st.rf0 = r0;
    st.rf1 = r1;
    st.l0 *= al0;
    st.l1 *= al1;
#pragma unroll
    for (int i = 0; i < KS; ++i) {
      st.acc[i][0] *= al0;
      st.acc[i][1] *= al1;
      st.acc[i][2] *= al0;
      st.acc[i][3] *= al1;
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float p0 = kvq_ex2(dd[u][0]), p1 = kvq_ex2(dd[u][1]), p2 = kvq_ex2(dd[u][2]), p3 = kvq_ex2(dd[u][3]);
    st.l0 += p0 + p2;
    st.l1 += p1 + p3;
    // p rounded to fp16, times the fp16 value norm (HMUL2, rounded again), transposed to P^T
    const uint32_t b01 = kvq_movmatrix(kvq_hmul2_bcast(kvq_pack_half2(p0, p1), vn[u], 0));
    const uint32_t b23 = kvq_movmatrix(kvq_hmul2_bcast(kvq_pack_half2(p2, p3), vn[u], 1));
    uint32_t vw[C::NWV], hv[D / 4];
    const int so = soff + u * C::SLOT + KvqSide<D, KB>::kBytes;
    kvq_frag_lds_l<C::NWV>(sq.s16 + so, sq.s8 + so, sq.s4 + so, vw);
    kvq_frag_decode<D, VB>(vw, vpool, mul, hv);
#pragma unroll
    for (int ms = 0; ms < KS; ++ms) kvq_mma(st.acc[ms], hv[4 * ms], hv[4 * ms + 1], hv[4 * ms + 2], hv[4 * ms + 3], b01, b23);
  }
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
__global__ void __launch_bounds__(KVQ_FRAG_THREADS, KVQ_FRAG_MIN_BLOCKS(D, KB)) kvq_frag_split_kernel(FragArgs a) {
  using C = FragCfg<D, KB, VB>;
  constexpr int U = C::U, KS = C::KS, NS = C::STAGES;
  constexpr int QBYTES = KVQ_FRAG_WARPS * KVQ_FRAG_ROWS * D * 4;
  // q and its rotation (prologue), the cp.async ring (loop), the warps' partial O (epilogue)
  alignas(16) __shared__ uint8_t s_raw[QBYTES > C::RING ? QBYTES : C::RING];
  float* s_buf = (float*)s_raw;
  __shared__ float s_m[KVQ_FRAG_WARPS][KVQ_FRAG_ROWS], s_l[KVQ_FRAG_WARPS][KVQ_FRAG_ROWS];
  __shared__ float s_qmax[KVQ_FRAG_WARPS];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
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
  uint32_t qb[KS][2];
  float kscale;
  if constexpr (KB == 2) {
    // int8 keys: q' ~ Q / qs with Q = round(q' qs), |Q| <= 32639 = 127 * 256 + 127, split Q = 256 hi + lo
    // (hi, lo int8): qb[s] = hi, qb[D / 32 + s] = lo, the B fragments of k-step s (k 4t..4t+3, +16)
    const float qs = mx > 0.0f ? 32639.0f / mx : 1.0f;
    kscale = 1.0f / (a.ksigma * qs);
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        uint32_t hi = 0, lo = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int Q = __float2int_rn(s_w[g * D + 32 * ks + 16 * r + 4 * t + j] * qs);
          const int H = (Q + 128) >> 8;  // floor((Q + 128) / 256): |H| <= 127, Q - 256 H in [-128, 127]
          hi |= (uint32_t)(H & 0xFF) << (8 * j);
          lo |= (uint32_t)((Q - 256 * H) & 0xFF) << (8 * j);
        }
        qb[ks][r] = hi;
        qb[D / 32 + ks][r] = lo;
      }
    }
  } else {
    int e = 0;
    frexpf(mx, &e);  // mx < 2^e: scaled entries < 2^14
    const float qs = mx > 0.0f ? ldexpf(1.0f, 14 - e) : 1.0f;
    kscale = 1.0f / qs;  // exact: a power of two
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const float* row = s_w + g * D + 16 * ks + 2 * t;
      qb[ks][0] = kvq_pack_half2(row[0] * qs, row[1] * qs);
      qb[ks][1] = kvq_pack_half2(row[8] * qs, row[9] * qs);
    }
  }

  // ---- the encoded tokens of this split ----
  // level pools and lookup constants through shared memory (module docstring of kvq_frag.cuh), and
  // this lane's ring address: the round trip makes it opaque to ptxas, which would otherwise rebuild it
  // from SR_TID and the shared window in every iteration (s_buf's query copies are dead: the qb are built)
  __shared__ uint32_t s_pool[8];
  __shared__ KvqMul s_mul;
  if (tid < 4) {
    s_pool[tid] = a.kpool[tid];
    s_pool[4 + tid] = a.vpool[tid];
  }
  if (tid == 0) s_mul = a.mul;
  __syncthreads();  // every warp has read its q rows
  struct Park {
    const int* table;
    kvq_saddr s16, s8, s4;
  };
  Park* park = (Park*)s_raw + tid;
  const kvq_saddr ring = kvq_smem(s_raw + warp * NS * U * C::SLOT);
  park->table = a.block_table + (size_t)b * (unsigned)a.bt_stride;
  park->s16 = ring + 16u * (unsigned)lane;
  park->s8 = ring + 8u * (unsigned)lane;
  park->s4 = ring + 4u * (unsigned)lane;
  __syncthreads();
  const Park parked = *park;
  __syncthreads();  // the ring may overwrite the parking spot from now on
  uint32_t kpool[4], vpool[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    kpool[i] = s_pool[i];
    vpool[i] = s_pool[4 + i];
  }
  const KvqMul mul = s_mul;
  const int n = a.seq_lens[b];
  const int t0 = min(n, s * a.chunk), t1 = min(n, (s + 1) * a.chunk);
  // t0 is a multiple of 16 U unless the split is empty (t0 = t1 = n): then it has no tile
  const int tile0 = t0 / KVQ_FRAG_TILE, tile1 = t1 > t0 ? (t1 + KVQ_FRAG_TILE - 1) / KVQ_FRAG_TILE : tile0;
  const int groups = (tile1 - tile0 + U - 1) / U;
  FragState<KS> st;
#pragma unroll
  for (int i = 0; i < KS; ++i) st.acc[i][0] = st.acc[i][1] = st.acc[i][2] = st.acc[i][3] = 0.0f;
  st.m0 = st.m1 = -INFINITY;
  st.rf0 = st.rf1 = st.l0 = st.l1 = 0.0f;
  if (warp < groups) {
    // group grp holds tiles tile0 + U grp + [0, U); a tile past the split's last one is in the same
    // page (U divides page_size / 16) and is masked
    const unsigned tpp = (unsigned)a.page_size / KVQ_FRAG_TILE;
    const unsigned ul = (unsigned)lane;
    const uint8_t* kvh = a.kv + (size_t)h * tpp * (unsigned)C::TB;
    FragSeq sq;
    sq.table = parked.table;
    sq.g16 = kvh + 16u * ul;
    sq.g8 = kvh + 8u * ul;
    sq.g4 = kvh + 4u * ul;
    sq.gn = kvh + C::CODES + 8u * (ul >> 2);
    sq.s16 = parked.s16;
    sq.s8 = parked.s8;
    sq.s4 = parked.s4;
    sq.page_bytes = a.page_bytes;
    sq.log_tpp = a.log_tpp;
    sq.tpp_mask = a.tpp_mask;
    // cp.async pipeline: the warp's j-th group (tiles tile0 + U (warp + 4 j) + [0, U)) goes to slot j % NS;
    // NS - 1 groups are in flight while one is computed. Page ids are read one group ahead of the copies.
    const int mine = (groups - warp + KVQ_FRAG_WARPS - 1) / KVQ_FRAG_WARPS;  // this warp's groups
    constexpr unsigned STEP = KVQ_FRAG_WARPS * U;                              // tiles between them
    constexpr unsigned USLOT = U * C::SLOT;
    unsigned tl = (unsigned)(tile0 + U * warp);                               // next group to issue
    unsigned page = (unsigned)__ldg(sq.table + (tl >> sq.log_tpp));
    int j = 0;
#pragma unroll
    for (; j < NS - 1; ++j) {
      if (j < mine) {
        const unsigned next_page = (unsigned)__ldg(sq.table + (min(tl + STEP, (unsigned)tile1 - 1u) >> sq.log_tpp));
        kvq_frag_issue<D, KB, VB>(sq, page, tl, j * USLOT);
        page = next_page;
        tl += STEP;
      }
      kvq_cp_commit();
    }
    float dd[U][4];
    uint32_t vn[U];
    unsigned first = (unsigned)(tile0 + U * warp);  // the group being computed
    int i = 0;
    for (; i + NS - 1 < mine; ++i) {  // steady state: issue group i + NS - 1, compute group i
      const unsigned next_page = (unsigned)__ldg(sq.table + (min(tl + STEP, (unsigned)tile1 - 1u) >> sq.log_tpp));
      kvq_frag_issue<D, KB, VB>(sq, page, tl, ((i + NS - 1) & (NS - 1)) * USLOT);
      kvq_cp_commit();
      page = next_page;
      tl += STEP;
      kvq_cp_wait<NS - 1>();
      const unsigned soff = (i & (NS - 1)) * USLOT;
      kvq_frag_scores<D, KB, VB>(st, sq, soff, qb, kpool, mul, kscale, dd, vn);
      kvq_frag_values<D, KB, VB>(st, sq, soff, dd, vn, vpool, mul, (int)first, t1, false, g);
      first += STEP;
    }
    for (; i < mine; ++i) {  // drain: the last NS - 1 groups (the split's last one may be partial)
      kvq_cp_commit();
      kvq_cp_wait<NS - 1>();
      const unsigned soff = (i & (NS - 1)) * USLOT;
      kvq_frag_scores<D, KB, VB>(st, sq, soff, qb, kpool, mul, kscale, dd, vn);
      kvq_frag_values<D, KB, VB>(st, sq, soff, dd, vn, vpool, mul, (int)first, t1,
                                 KVQ_FRAG_TILE * ((int)first + U) > t1, g);
      first += STEP;
    }
  }
  float l0 = st.l0, l1 = st.l1;
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xFFFFFFFFu, l0, off);
    l1 += __shfl_xor_sync(0xFFFFFFFFu, l1, off);
  }
  const float m0 = st.m0, m1 = st.m1;

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
    s_o[(2 * t) * D + 16 * i + g] = st.acc[i][0];
    s_o[(2 * t + 1) * D + 16 * i + g] = st.acc[i][1];
    s_o[(2 * t) * D + 16 * i + g + 8] = st.acc[i][2];
    s_o[(2 * t + 1) * D + 16 * i + g + 8] = st.acc[i][3];
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

// Grid B H R, one CTA per query row: merge of the S partials, inverse value rotation, band partial,
// division, store. The merge is on the critical path of a call (and the longest part of it at batch 1,
// where S is 50), so it is spread wide: KVQ_MERGE_THREADS threads = SG groups of splits x D coordinates,
// 8 splits' loads in flight per thread; the maxima are reduced first (all threads), the groups' sums in
// shared memory after.
// (The host emulation runs 2 D threads, SG = 2: the same code, a quarter of the OS threads at d = 128.)
#ifdef KVQ_HOST_EMULATION
#define KVQ_MERGE_THREADS (2 * KVQ_FRAG_D)
#else
#define KVQ_MERGE_THREADS 512
#endif
template <int D>
__global__ void __launch_bounds__(KVQ_MERGE_THREADS) kvq_frag_merge_kernel(FragArgs a) {
  constexpr int SG = KVQ_MERGE_THREADS / D;
  static_assert(SG >= 1 && KVQ_MERGE_THREADS % 32 == 0, "the merge needs a thread per coordinate");
  __shared__ float s_red[KVQ_MERGE_THREADS / 32];
  __shared__ float s_acc[SG][D];
  __shared__ float s_l[SG];
  __shared__ float s_y[D];
  const int tid = threadIdx.x, sg = tid / D, j = tid % D;
  const size_t bh = blockIdx.x / (unsigned)a.R;
  const int r = (int)(blockIdx.x % (unsigned)a.R);
  const int b = (int)(bh / (unsigned)a.H), h = (int)(bh % (unsigned)a.H);
  float m = -INFINITY;
  for (int s = tid; s < a.splits; s += KVQ_MERGE_THREADS) m = fmaxf(m, kvq_frag_partial(a, bh, s, r, D)[0]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if (tid % 32 == 0) s_red[tid / 32] = m;
  __syncthreads();
  m = s_red[0];
#pragma unroll
  for (int w = 1; w < KVQ_MERGE_THREADS / 32; ++w) m = fmaxf(m, s_red[w]);
  const float ref = m == -INFINITY ? 0.0f : m;
  float acc = 0.0f, l = 0.0f;
#pragma unroll 8
  for (int s = sg; s < a.splits; s += SG) {
    const float* p = kvq_frag_partial(a, bh, s, r, D);
    const float w = kvq_ex2(p[0] - ref);
    acc += w * p[2 + j];
    if (j == 0) l += w * p[1];
  }
  s_acc[sg][j] = acc;
  if (j == 0) s_l[sg] = l;
  __syncthreads();
  if (sg == 0) {  // R_V^T y = D1 P^T (H_b / sqrt(b)) D2 y
    float y = 0.0f;
#pragma unroll
    for (int g = 0; g < SG; ++g) y += s_acc[g][j];
    s_y[j] = y * a.vsigns[D + j];
  }
  l = 0.0f;
#pragma unroll
  for (int g = 0; g < SG; ++g) l += s_l[g];
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
  const float* pb = kvq_frag_partial(a, bh, a.splits, r, D);
  const float mt = fmaxf(m, pb[0]);
  const float rt = mt == -INFINITY ? 0.0f : mt;
  const float ce = kvq_ex2(m - rt), cb = kvq_ex2(pb[0] - rt);
  const float den = l * ce + pb[1] * cb;
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;  // a row that sees no token gets 0
  const int t = r / a.G, g = r % a.G;
  const size_t orow = ((((size_t)b * a.T + t) * a.H + h) * a.G + g) * D;
  const float x = s_y[a.vinv_perm[j]] * (1.0f / sqrtf((float)a.vhblock)) * a.vsigns[j];
  const float o = (x * ce + pb[2 + j] * cb) * inv;
  if (a.out_dtype == KVQ_DT_F32) {
    ((float*)a.out)[orow + j] = o;
  } else if (a.out_dtype == KVQ_DT_F16) {
    ((unsigned short*)a.out)[orow + j] = __half_as_ushort(__float2half_rn(o));
  } else {
    ((unsigned short*)a.out)[orow + j] = kvq_to_bf16(o);
  }
}

// Tests: the registers every lane decodes from each tile (the kernel's loads and lookups, nothing else):
// out_k, out_v (ntiles, 32, D / 4) uint32 (fp16 pairs; the 2-bit keys' int8 quads fill the first D / 8
// entries of out_k, the rest 0). Grid ntiles, one warp.
template <int D, int KB, int VB>
__global__ void kvq_frag_decode_kernel(const uint8_t* tiles, FragArgs a, uint32_t* out_k, uint32_t* out_v) {
  using C = FragCfg<D, KB, VB>;
  const int lane = threadIdx.x % 32;
  const uint8_t* base = tiles + (size_t)blockIdx.x * C::TB;
  uint32_t kw[C::NWK], vw[C::NWV];
  kvq_frag_load<C::NWK>(base, lane, kw);
  kvq_frag_load<C::NWV>(base + KvqSide<D, KB>::kBytes, lane, vw);
  uint32_t hk[D / 4] = {}, hv[D / 4];
  if constexpr (KB == 2) {  // int8 quads: the first D / 8 entries
    kvq_frag_decode_i8<D>(kw, a.kpool, a.mul, *reinterpret_cast<uint32_t(*)[D / 8]>(hk));
  } else {
    kvq_frag_decode<D, KB>(kw, a.kpool, a.mul, hk);
  }
  kvq_frag_decode<D, VB>(vw, a.vpool, a.mul, hv);
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
      a.page_size < 32 || a.log_page < 5 || a.log_page > 30 || a.page_size != 1 << a.log_page ||
      a.page_bytes != (unsigned)(a.H * (a.page_size / 16) * FragCfg<KVQ_FRAG_CFG>::TB) ||
      a.log_tpp != (unsigned)(a.log_page - 4) || a.tpp_mask != (unsigned)(a.page_size / 16 - 1) || a.splits < 1 || a.chunk < 16 || a.chunk % 16 || a.band_cap < 1 ||
      a.khblock < 1 || KVQ_FRAG_D % a.khblock || a.vhblock < 1 || KVQ_FRAG_D % a.vhblock || a.ws == nullptr ||
      (long long)a.B * a.H * (a.splits + 1) > 0x7FFFFFFFLL)
    return KVQ_EINVAL;
  if (a.B == 0) return KVQ_OK;
  auto* split = &kvq_frag_split_kernel<KVQ_FRAG_CFG>;
  auto* merge = &kvq_frag_merge_kernel<KVQ_FRAG_D>;
  KVQ_LAUNCH(split, (unsigned)(a.B * a.H * (a.splits + 1)), KVQ_FRAG_THREADS, (cudaStream_t)stream)(a);
  int rc = (int)cudaGetLastError();
  if (rc) return rc;
  KVQ_LAUNCH(merge, (unsigned)(a.B * a.H * a.R), KVQ_MERGE_THREADS, (cudaStream_t)stream)(a);
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
