// Split-K decode attention over a paged TurboQuantMSE cache in the fragment layout (kvq_frag.cuh),
// on tensor cores: mma.sync with the GQA group as N = 8, levels looked up by byte permutes straight
// into the A fragments (gpu/cuda/fragment.py and gpu/cuda/lookup.py are the specification).
//
// What it computes: gpu.triton.paged's split-and-merge (kvq_ref.attention.attention_decode per
// sequence and KV head), the same plan (gpu.schedule.plan_splits), block tables, per-sequence
// lengths and 16-bit band:
//   1. kvq_frag_split_kernel<D, KB, VB>, grid B H (S + NB), 4 warps: CTA (b, h, s < S) attends the
//      R = T G <= 8 query rows of KV head h to the encoded tokens [s C, (s + 1) C) of sequence b; the
//      CTA (b, h, S + c) to band tokens [64 c, 64 (c + 1)) (kvq_frag_parts.cuh). A split CTA first issues
//      the copies of its first tiles, then rotates the query rows once (R_K q, in the ring slots those
//      copies leave free, so the tiles' first round trip hides under the query's load and rotation),
//      scaled by sm_scale log2(e), and holds them as the B fragments of S^T = K Q^T (16 tokens x 8
//      rows): float16 scaled by a power of two that keeps them inside its normal range, or at 2 bits,
//      where the keys go through int8 mma.m16n8k32, 16-bit integers split into two int8 bytes. Each
//      warp takes groups of U tiles of 16 tokens (FragCfg), copied by cp.async into its ring of
//      shared-memory slots STAGES - 1 groups ahead (16-byte copies, no registers in flight), and per
//      tile:
//        * scores: D / 16 fp16 MMAs on the decoded K pairs (or 2 x D / 32 int8 MMAs, query high then
//          low byte, exact int32 sums); times the key norm (one multiply-add per score);
//        * lazy softmax: scores are compared with the running max first (one vote per group); only
//          when one reaches it (or on the split's last, partial group) does the warp reduce the group's
//          max across its lanes and rescale its accumulators, so p = 2^(z - m) <= 1 always;
//        * P^T: p rounded to fp16 pairs, times the value norm (HMUL2: the norm folded into P),
//          transposed to the B fragments of O^T = V^T P^T by two movmatrix;
//        * O^T += V^T P^T: D / 16 MMAs on the decoded V pairs (value-rotation domain).
//      The 4 warps' (m, l, O) merge in shared memory; the CTA writes its partial (log2 domain) to the
//      workspace.
//   2. kvq_frag_merge_kernel (kvq_frag_parts.cuh), grid B H R: log-sum-exp merge of the S partials,
//      one inverse value rotation, the NB band partials, the division, the store in q's dtype. It is a
//      programmatic dependent launch of the split kernel (FragArgs::dependent_launch; Hopper): the split
//      CTAs release it as they start, so its launch overlaps the split kernel's run.
// Empty splits and masked tokens leave m = -inf, l = 0; every exponent is taken against a finite
// reference, so they merge as nothing; a row that sees no token gets 0.
//
// Precision (tests/gpu/test_cuda_fragment_attention.py derives the tier): key levels and rotated
// queries in float16 (or int8 levels within 3.7e-4 of the table and 16-bit queries), p and p v_norm in
// float16, value levels in float16; products exact, float32 accumulation in the tensor cores; norms,
// softmax and sums float32; 2^x is MUFU.EX2 (relative error < 2^-22).
//
// One instantiation per library (KVQ_FRAG_D, KVQ_FRAG_KB, KVQ_FRAG_VB; gpu/cuda/fragment_cache.py).

#include "kvq_frag_parts.cuh"

// Per configuration: U tiles a warp takes per step (2 below 4 bits: one lazy-softmax check for two
// tiles), and STAGES shared-memory slots per warp for cp.async (STAGES - 1 groups in flight); the
// largest of (U, STAGES) = (2, 4), (2, 2), (1, 4), (1, 2) whose ring fits 41 KB, so that the ring and
// the kernel's other static shared memory (the band path's 6.1 KB, the softmax and pool scratch: 6.4 KB
// at d = 256) stay under the 48 KB a CTA may hold statically (every configuration is compiled for sm_90a
// in tests/gpu/test_cuda_static.py; at 44 KB, d = 256 with 2- and 3-bit sides took 50.4 KB).
template <int D, int KB, int VB>
struct FragCfg {
  static constexpr int KS = D / 16;                       // k-steps (K) = m-tiles (V)
  static constexpr int TB = kvq_frag_tile_bytes(D, KB, VB);
  static constexpr int NWK = KvqSide<D, KB>::kWords, NWV = KvqSide<D, VB>::kWords;
  static constexpr int CODES = 2 * D * (KB + VB);         // K and V bytes of a tile
  static constexpr int SLOT = CODES + 32 * 8;             // a tile in the ring: codes, then 32 lanes' norms
  static constexpr int RING_MAX = 41 * 1024;
  static constexpr bool fits(int u, int st) { return KVQ_FRAG_WARPS * st * u * SLOT <= RING_MAX; }
  static constexpr int U = (KB < 4 && VB < 4 && (fits(2, 4) || fits(2, 2))) ? 2 : 1;
  static constexpr int STAGES = fits(U, 4) ? 4 : 2;
  static constexpr int RING = KVQ_FRAG_WARPS * STAGES * U * SLOT;
  static_assert(fits(U, STAGES), "the cp.async ring does not fit");
};

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

  kvq_launch_dependents();  // the merge kernel may be launched (it waits for this grid's writes)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int S = a.splits, SB = S + a.band_ctas;
  const int b = (int)(blockIdx.x / (unsigned)(a.H * SB));
  const int h = (int)(blockIdx.x / (unsigned)SB % (unsigned)a.H);
  const int s = (int)(blockIdx.x % (unsigned)SB);
  if (s >= S) {
    kvq_frag_band<D>(a, b, h, s - S, s_buf);
    return;
  }
  const size_t bh = (size_t)b * a.H + h;

  // ---- the split's first groups of tiles, in flight before the query is read ----
  // Level pools, lookup constants and this lane's ring address, parked in shared memory by each thread
  // and read back from its own spot: the round trip makes them opaque to ptxas, which would otherwise
  // keep the constants in uniform registers and copy them before every use (module docstring of
  // kvq_frag.cuh), or rebuild the address from SR_TID and the shared window in every iteration. The
  // parking spots lie in the ring and are read back before any copy is issued into it.
  struct Park {
    KvqMul mul;
    uint32_t kpool[4], vpool[4];
    const int* table;
    kvq_saddr s16, s8, s4;
  };
  static_assert(sizeof(Park) * KVQ_FRAG_THREADS <= C::RING, "the parking spots do not fit the ring");
  Park* park = (Park*)s_raw + tid;
  const kvq_saddr ring = kvq_smem(s_raw + warp * NS * U * C::SLOT);
  park->mul = a.mul;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    park->kpool[i] = a.kpool[i];
    park->vpool[i] = a.vpool[i];
  }
  park->table = a.block_table + (size_t)b * (unsigned)a.bt_stride;
  park->s16 = ring + 16u * (unsigned)lane;
  park->s8 = ring + 8u * (unsigned)lane;
  park->s4 = ring + 4u * (unsigned)lane;
  __syncthreads();
  const Park parked = *park;
  __syncthreads();  // the ring may overwrite the parking spot from now on
  const int n = a.seq_lens[b];
  const int t0 = min(n, s * a.chunk), t1 = min(n, (s + 1) * a.chunk);
  // t0 is a multiple of 16 U unless the split is empty (t0 = t1 = n): then it has no tile
  const int tile0 = t0 / KVQ_FRAG_TILE, tile1 = t1 > t0 ? (t1 + KVQ_FRAG_TILE - 1) / KVQ_FRAG_TILE : tile0;
  const int groups = (tile1 - tile0 + U - 1) / U;
  // group grp holds tiles tile0 + U grp + [0, U); a tile past the split's last one is in the same page (U
  // divides page_size / 16) and is masked
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
  // The first NS - 1 groups are issued here, so that their round trip overlaps the query's load and
  // rotation below, which use each warp's last slot (free until the loop's first issue).
  const int mine = warp < groups ? (groups - warp + KVQ_FRAG_WARPS - 1) / KVQ_FRAG_WARPS : 0;  // this warp's
  constexpr unsigned STEP = KVQ_FRAG_WARPS * U;                                                 // tiles apart
  constexpr unsigned USLOT = U * C::SLOT;
  unsigned tl = (unsigned)(tile0 + U * warp);  // next group to issue
  unsigned page = 0;
  if (mine > 0) {
    page = (unsigned)__ldg(sq.table + (tl >> sq.log_tpp));
#pragma unroll
    for (int j = 0; j < NS - 1; ++j) {
      if (j < mine) {
        const unsigned next_page = (unsigned)__ldg(sq.table + (min(tl + STEP, (unsigned)tile1 - 1u) >> sq.log_tpp));
        kvq_frag_issue<D, KB, VB>(sq, page, tl, j * USLOT);
        page = next_page;
        tl += STEP;
      }
      kvq_cp_commit();
    }
  }
  const KvqMul mul = parked.mul;
  uint32_t kpool[4], vpool[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    kpool[i] = parked.kpool[i];
    vpool[i] = parked.vpool[i];
  }

  // ---- the rotated, scaled query as the B fragments of the score MMAs ----
  // w = R_K q row by row (8 rows, zero past R) in float32: rows 2 w', 2 w' + 1 in warp w''s last ring slot
  // (U SLOT >= 2 D 4 bytes: a slot holds at least a tile's codes, 2 D (KB + VB) >= 8 D bytes)
  static_assert(C::SLOT * U >= 2 * D * 4 && KVQ_FRAG_ROWS == 2 * KVQ_FRAG_WARPS, "the query rows do not fit the last slots");
  auto wrow = [&](int r) -> float* {
    return (float*)(s_raw + ((r >> 1) * NS + NS - 1) * USLOT) + (r & 1) * D;
  };
  for (int i = tid; i < KVQ_FRAG_ROWS * D; i += KVQ_FRAG_THREADS) {  // w = P D1 q, read straight from q
    const int r = i / D, c = i % D, p = a.kperm[c];
    float v = 0.0f;
    if (r < a.R) {
      const size_t row = (((size_t)b * a.T + r / a.G) * a.H + h) * a.G + r % a.G;
      v = kvq_load_as_float(a.q, a.q_dtype, row * D + p);
    }
    wrow(r)[c] = v * a.ksigns[p];
  }
  for (int hh = 1; hh < a.khblock; hh <<= 1) {  // butterflies (x, y) -> (x + y, x - y)
    __syncthreads();
    for (int i = tid; i < KVQ_FRAG_ROWS * D / 2; i += KVQ_FRAG_THREADS) {
      const int r = i / (D / 2), p = i % (D / 2);
      float* w = wrow(r) + (p / hh) * 2 * hh + (p % hh);
      const float lo = w[0], hi = w[hh];
      w[0] = lo + hi;
      w[hh] = lo - hi;
    }
  }
  __syncthreads();
  const float qscale_in = a.sm_scale * KVQ_LOG2E / sqrtf((float)a.khblock);
  float mx = 0.0f;
  for (int i = tid; i < KVQ_FRAG_ROWS * D; i += KVQ_FRAG_THREADS) {
    float* w = wrow(i / D) + i % D;
    const float v = *w * a.ksigns[D + i % D] * qscale_in;
    *w = v;
    mx = fmaxf(mx, fabsf(v));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, off));
  if (lane == 0) s_qmax[warp] = mx;
  __syncthreads();
  mx = fmaxf(fmaxf(s_qmax[0], s_qmax[1]), fmaxf(s_qmax[2], s_qmax[3]));
  uint32_t qb[KS][2];
  float kscale;
  const float* wg = wrow(g);  // this lane's row
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
          const int Q = __float2int_rn(wg[32 * ks + 16 * r + 4 * t + j] * qs);
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
      const float* row = wg + 16 * ks + 2 * t;
      qb[ks][0] = kvq_pack_half2(row[0] * qs, row[1] * qs);
      qb[ks][1] = kvq_pack_half2(row[8] * qs, row[9] * qs);
    }
  }
  __syncthreads();  // every warp has read its q rows: the loop's first issue may overwrite the last slots

  // ---- the encoded tokens of this split ----
  FragState<KS> st;
#pragma unroll
  for (int i = 0; i < KS; ++i) st.acc[i][0] = st.acc[i][1] = st.acc[i][2] = st.acc[i][3] = 0.0f;
  st.m0 = st.m1 = -INFINITY;
  st.rf0 = st.rf1 = st.l0 = st.l1 = 0.0f;
  if (mine > 0) {
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
  __syncthreads();  // the ring and the query rows are dead
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
      (a.dependent_launch != 0 && a.dependent_launch != 1) || a.band_ctas < 1 ||
      (long long)a.band_ctas * KVQ_BAND_TILE < a.band_cap ||
      (long long)a.B * a.H * (a.splits + a.band_ctas) > 0x7FFFFFFFLL)
    return KVQ_EINVAL;
  if (a.B == 0) return KVQ_OK;
  auto* split = &kvq_frag_split_kernel<KVQ_FRAG_CFG>;
  auto* merge = &kvq_frag_merge_kernel<KVQ_FRAG_D>;
  KVQ_LAUNCH(split, (unsigned)(a.B * a.H * (a.splits + a.band_ctas)), KVQ_FRAG_THREADS, (cudaStream_t)stream)(a);
  int rc = (int)cudaGetLastError();
  if (rc) return rc;
  return (int)kvq_launch_dependent(merge, (unsigned)(a.B * a.H * a.R), KVQ_MERGE_THREADS, (cudaStream_t)stream,
                                   a.dependent_launch != 0, a);
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
