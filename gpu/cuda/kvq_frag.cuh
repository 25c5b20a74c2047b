// The fragment layout and its byte-permute lookups (gpu/cuda/fragment.py and gpu/cuda/lookup.py are
// the specification: this header mirrors their instruction lists operation for operation, and the tests
// check both), the MMA / movmatrix / cp.async / shared-load wrappers (inline PTX, or host_emu.h's
// emulation).
//
// A tile is 16 tokens of one (page, KV head): [K codes][V codes][norms], 2 d (kb + vb) + 64 bytes.
// Lane L = 4 g + t of a warp loads d b / 64 words of each side, in planes of 16, 8 and 4 bytes
// (kvq_frag_load_l), and decodes them into its A fragments (kvq_frag_decode, kvq_frag_decode_i8).
// fp16 pairs, half-register i = 4 s + r of mma.m16n8k16: K: r = 0 (token g, coords 16s + 2t, +1),
// r = 1 (token g + 8), r = 2 (token g, coords + 8), r = 3 (token g + 8, coords + 8); V: r = 0 (coord
// 16s + g, tokens 2t, 2t + 1), r = 1 (coord + 8), r = 2 (tokens + 8), r = 3 (coord + 8, tokens + 8).
// The 2-bit keys' int8 quads of mma.m16n8k32: register i = 4 s + r holds token g + 8 (r & 1),
// coordinates 32 s + 16 (r >> 1) + 4 t + [0, 4).
#ifndef KVQ_FRAG_CUH
#define KVQ_FRAG_CUH

#include "kvq_common.cuh"

#define KVQ_FRAG_TILE 16
#define KVQ_FRAG_NORM_BYTES 64

// the build passes head_dim and the key/value bits of each compiled instance; defaults for a bare compile
#ifndef KVQ_FRAG_D
#define KVQ_FRAG_D 128
#endif
#ifndef KVQ_FRAG_KB
#define KVQ_FRAG_KB 4
#endif
#ifndef KVQ_FRAG_VB
#define KVQ_FRAG_VB 4
#endif

template <int D, int B>
struct KvqSide {
  static constexpr int kWords = D * B / 64;               // words per lane
  static constexpr int kPairs = D / 4;                    // fp16 pairs per lane
  static constexpr int kBytes = 2 * D * B;                // bytes of the side in a tile
  static constexpr int kGroupWords = B == 3 ? 3 : 1;      // words per decode group
  static constexpr int kGroupPairs = B == 2 ? 8 : B == 3 ? 16 : 4;
};

__host__ __device__ constexpr int kvq_frag_tile_bytes(int d, int kb, int vb) {
  return 2 * d * (kb + vb) + KVQ_FRAG_NORM_BYTES;
}

// The lane's words of one side: 16-byte planes, then an 8-byte and a 4-byte one (fragment.plane_widths).
// Lane L's bytes of the k-th 16-byte plane are at region + 512 k + 16 L, of the 8-byte plane at
// region + 512 n16 + 8 L, of the 4-byte plane at region + 512 n16 (+ 256) + 4 L. The loads take the
// region already offset by the lane (r16 = region + 16 L, r8 = region + 8 L, r4 = region + 4 L), so
// that one address register per lane offset serves every plane.
template <int NW>
__device__ __forceinline__ void kvq_frag_load_l(const uint8_t* r16, const uint8_t* r8, const uint8_t* r4,
                                                uint32_t (&w)[NW]) {
  constexpr int n16 = NW / 4;
#pragma unroll
  for (int k = 0; k < n16; ++k) {
    const uint4 v = *(const uint4*)(r16 + 512 * k);
    w[4 * k] = v.x;
    w[4 * k + 1] = v.y;
    w[4 * k + 2] = v.z;
    w[4 * k + 3] = v.w;
  }
  constexpr int off8 = 512 * n16, off4 = off8 + (NW % 4 >= 2 ? 256 : 0);
  if constexpr (NW % 4 >= 2) {
    const uint2 v = *(const uint2*)(r8 + off8);
    w[4 * n16] = v.x;
    w[4 * n16 + 1] = v.y;
  }
  if constexpr (NW % 2 == 1) w[NW - 1] = *(const uint32_t*)(r4 + off4);
}

template <int NW>
__device__ __forceinline__ void kvq_frag_load(const uint8_t* region, unsigned lane, uint32_t (&w)[NW]) {
  kvq_frag_load_l<NW>(region + 16 * lane, region + 8 * lane, region + 4 * lane, w);
}

// Constants of the lookups, held in (vector) registers: the multipliers are IMAD operands so that
// ptxas keeps the shifts and multiply-adds on the FMA pipe instead of strength-reducing them to SHF
// and LEA on the ALU pipe, which LOP3 and PRMT already load; y16 is the selector offset of the 2-bit
// high pairs (17 * 0x7C40 = 0x4040 mod 2^16). They come from the host (a literal would be folded into
// LOP3/SHF immediates) and the kernel stages them through shared memory, so that ptxas cannot keep
// them in uniform registers and copy them to vector registers before every use.
struct KvqMul {
  uint32_t m17, m17s16, s16, s26, s28, s29, s30, s31, m16, y16;
};
// (the host passes these values: gpu/cuda/fragment_cache.py MUL)

// PTX prmt.b32 (default mode). CUDA's __byte_perm masks each selector nibble to 3 bits with an extra
// LOP3; the selectors here never have bit 3 set (gpu/cuda/fragment.py checks every one).
__device__ __forceinline__ uint32_t kvq_prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef KVQ_HOST_EMULATION
  return __byte_perm(a, b, sel);
#else
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#endif
}

// ---- 2 bits: one word -> 8 pairs (fragment.decode_words) ----------------------------------------
// For u = w >> 2k: x = (u & 0x03030303) | y16; pair (2k, 2k + 8) from x * 17 + 0x4040 (low half of
// the selector), pair (2k + 16, 2k + 24) from the high word of x * (17 << 16) (y16 adds the 0x4040).
__device__ __forceinline__ void kvq_dec2(uint32_t w, uint32_t p0, uint32_t p1, const KvqMul& k, uint32_t* h) {
  const uint32_t u[4] = {w, __umulhi(w, k.s30), __umulhi(w, k.s28), __umulhi(w, k.s26)};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t x = (u[q] & 0x03030303u) | k.y16;
    h[2 * q] = kvq_prmt(p0, p1, x * k.m17 + 0x4040u);
    h[2 * q + 1] = kvq_prmt(p0, p1, __umulhi(x, k.m17s16));
  }
}

// ---- 3 and 4 bits: 8-entry byte pools (lo bytes, hi bytes) --------------------------------------
__device__ __forceinline__ void kvq_pairs8(uint32_t lo4, uint32_t hi4, uint32_t* h) {
  h[0] = kvq_prmt(lo4, hi4, 0x5140u);
  h[1] = kvq_prmt(lo4, hi4, 0x7362u);
}

// 3 words -> 16 pairs.
__device__ __forceinline__ void kvq_dec3(uint32_t w0, uint32_t w1, uint32_t w2, const uint32_t (&p)[4],
                                         const KvqMul& k, uint32_t* h) {
  const uint32_t s3 = __umulhi(w0 & 0x88888888u, k.s29) | __umulhi(w1 & 0x88888888u, k.s30) |
                      __umulhi(w2 & 0x88888888u, k.s31);
  const uint32_t sel[4] = {w0 & 0x77777777u, w1 & 0x77777777u, w2 & 0x77777777u, s3};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t lo = sel[q], hi = __umulhi(sel[q], k.s16);
    kvq_pairs8(kvq_prmt(p[0], p[1], lo), kvq_prmt(p[2], p[3], lo), h + 4 * q);
    kvq_pairs8(kvq_prmt(p[0], p[1], hi), kvq_prmt(p[2], p[3], hi), h + 4 * q + 2);
  }
}

// 1 word -> 4 pairs (sign-magnitude; negative flags at the byte MSBs of w and of w << 4).
__device__ __forceinline__ void kvq_dec4(uint32_t w, const uint32_t (&p)[4], const KvqMul& k, uint32_t* h) {
  const uint32_t lo = w & 0x77777777u, hi = __umulhi(lo, k.s16);
  kvq_pairs8(kvq_prmt(p[0], p[1], lo), kvq_prmt(p[2], p[3], lo) ^ (w & 0x80808080u), h);
  kvq_pairs8(kvq_prmt(p[0], p[1], hi), kvq_prmt(p[2], p[3], hi) ^ ((w * k.m16) & 0x80808080u), h + 2);
}

// ---- int8 keys, 2 bits: one word -> the 4 quads (A fragment of mma.m16n8k32.s8) of a k-step -------
// p = (A, A, B0, B1): A = int8 levels L0..L3, (B0, B1) = L0 L0 L1 L1 L2 L2 L3 L3 (the junk bit of each
// selector nibble picks between equal bytes).
__device__ __forceinline__ void kvq_dec2i8(uint32_t w, const uint32_t (&p)[4], const KvqMul& k, uint32_t* q) {
  const uint32_t sa = w & 0x77777777u, sb = __umulhi(w, k.s31) & 0x77777777u;
  q[0] = kvq_prmt(p[0], p[1], sa);
  q[1] = kvq_prmt(p[0], p[1], __umulhi(sa, k.s16));
  q[2] = kvq_prmt(p[2], p[3], sb);
  q[3] = kvq_prmt(p[2], p[3], __umulhi(sb, k.s16));
}

// All quads of the 2-bit keys (D / 32 words -> D / 8 registers).
template <int D>
__device__ __forceinline__ void kvq_frag_decode_i8(const uint32_t (&w)[D / 32], const uint32_t (&p)[4], const KvqMul& k,
                                                   uint32_t (&q)[D / 8]) {
#pragma unroll
  for (int s = 0; s < D / 32; ++s) kvq_dec2i8(w[s], p, k, q + 4 * s);
}

// All pairs of one side.
template <int D, int B>
__device__ __forceinline__ void kvq_frag_decode(const uint32_t (&w)[KvqSide<D, B>::kWords], const uint32_t (&p)[4],
                                                const KvqMul& k, uint32_t (&h)[D / 4]) {
  using S = KvqSide<D, B>;
#pragma unroll
  for (int gi = 0; gi < S::kWords / S::kGroupWords; ++gi) {
    if constexpr (B == 2) {
      kvq_dec2(w[gi], p[0], p[1], k, h + 8 * gi);
    } else if constexpr (B == 3) {
      kvq_dec3(w[3 * gi], w[3 * gi + 1], w[3 * gi + 2], p, k, h + 16 * gi);
    } else {
      kvq_dec4(w[gi], p, k, h + 4 * gi);
    }
  }
}

// ---- where a code goes (the append kernel): fragment.fragment_slots / _group ---------------------
// Half-register i and half hh of lane L that hold (token tok, coordinate j) of side K (kside) or V.
__host__ __device__ __forceinline__ void kvq_frag_slot(bool kside, int tok, int j, int& lane, int& i, int& hh) {
  if (kside) {  // tok = g + 8 (r & 1), j = 16 s + 2 t + 8 (r >> 1) + hh
    const int s = j / 16, c = j % 16;
    lane = 4 * (tok % 8) + (c % 8) / 2;
    i = 4 * s + (tok / 8) + 2 * (c / 8);
    hh = c % 2;
  } else {      // j = 16 s + g + 8 (r & 1), tok = 2 t + 8 (r >> 1) + hh
    const int s = j / 16, c = j % 16;
    lane = 4 * (c % 8) + (tok % 8) / 2;
    i = 4 * s + (c / 8) + 2 * (tok / 8);
    hh = tok % 2;
  }
}

// Word (within the lane) and bit of bit k of the symbol stored for code hh of register i (an fp16 pair,
// or for I8 the int8 quad of the 2-bit keys: register i = 4 s + r of word s, byte hh at bit
// 4 hh + 16 (r & 1) + 2 (r >> 1)).
template <int B, bool I8 = false>
__host__ __device__ __forceinline__ void kvq_frag_field(int i, int hh, int k, int& word, int& bit) {
  if constexpr (I8) {
    word = i / 4;
    bit = 4 * hh + 16 * (i % 4 & 1) + 2 * (i % 4 >> 1) + k;
  } else if constexpr (B == 2) {
    constexpr int pairs[8][2] = {{0, 8}, {16, 24}, {2, 10}, {18, 26}, {4, 12}, {20, 28}, {6, 14}, {22, 30}};
    word = i / 8;
    bit = pairs[i % 8][hh] + k;
  } else if constexpr (B == 3) {
    const int grp = i / 16, n = 2 * (i % 16) + hh;  // code n of the group: 0..23 nibble form, 24..31 spread
    if (n < 24) {
      word = 3 * grp + n / 8;
      bit = 4 * (n % 8) + k;
    } else {
      word = 3 * grp + k;
      bit = 4 * (n - 24) + 3;
    }
  } else {
    constexpr int neg_bit[8] = {7, 15, 23, 31, 3, 11, 19, 27};
    const int n = 2 * (i % 4) + hh;
    word = i / 4;
    bit = k < 3 ? 4 * n + k : neg_bit[n];
  }
}

// Stored symbol of a code (4 bits: magnitude index | negative flag << 3) and back.
template <int B>
__host__ __device__ __forceinline__ unsigned kvq_frag_symbol(unsigned c) {
  if constexpr (B == 4) return c < 8 ? (7u - c) | 8u : c - 8u;
  return c;
}

// ---- shared memory by 32-bit address, cp.async -----------------------------------------------------
// The ring is addressed by explicit shared-window addresses (kvq_saddr) so that ptxas keeps one 32-bit
// register per lane offset instead of rebuilding generic pointers in the loop. cp.async copies global
// -> shared with no register holding the bytes in flight. (The host emulation uses plain pointers and
// copies at once; commit and wait are then nothing.)
#ifdef KVQ_HOST_EMULATION
typedef uintptr_t kvq_saddr;
__device__ __forceinline__ kvq_saddr kvq_smem(const void* p) { return (uintptr_t)p; }
__device__ __forceinline__ uint4 kvq_lds128(kvq_saddr a) {
  uint4 v;
  memcpy(&v, (const void*)a, 16);
  return v;
}
__device__ __forceinline__ uint2 kvq_lds64(kvq_saddr a) {
  uint2 v;
  memcpy(&v, (const void*)a, 8);
  return v;
}
__device__ __forceinline__ uint32_t kvq_lds32(kvq_saddr a) {
  uint32_t v;
  memcpy(&v, (const void*)a, 4);
  return v;
}
template <int N>
__device__ __forceinline__ void kvq_cp(kvq_saddr s, const void* g) {
  memcpy((void*)s, g, N);
}
__device__ __forceinline__ void kvq_cp_commit() {}
template <int N>
__device__ __forceinline__ void kvq_cp_wait() {}
#else
typedef unsigned kvq_saddr;
__device__ __forceinline__ kvq_saddr kvq_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint4 kvq_lds128(kvq_saddr a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 kvq_lds64(kvq_saddr a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t kvq_lds32(kvq_saddr a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
template <int N>
__device__ __forceinline__ void kvq_cp(kvq_saddr s, const void* g) {
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(s), "l"(g), "n"(N) : "memory");
  }
}
__device__ __forceinline__ void kvq_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kvq_cp_wait() {  // all but the N most recent groups have landed
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// One side's words of one tile, a lane's share, from global to the same offsets in the ring
// (addresses offset by the lane as in kvq_frag_load_l; every lane later reads back only what it copied).
template <int NW>
__device__ __forceinline__ void kvq_frag_copy_l(kvq_saddr d16, const uint8_t* s16, kvq_saddr d8, const uint8_t* s8,
                                                kvq_saddr d4, const uint8_t* s4) {
  constexpr int n16 = NW / 4;
#pragma unroll
  for (int k = 0; k < n16; ++k) kvq_cp<16>(d16 + 512 * k, s16 + 512 * k);
  constexpr int off8 = 512 * n16, off4 = off8 + (NW % 4 >= 2 ? 256 : 0);
  if constexpr (NW % 4 >= 2) kvq_cp<8>(d8 + off8, s8 + off8);
  if constexpr (NW % 2 == 1) kvq_cp<4>(d4 + off4, s4 + off4);
}

// kvq_frag_load_l from the ring.
template <int NW>
__device__ __forceinline__ void kvq_frag_lds_l(kvq_saddr r16, kvq_saddr r8, kvq_saddr r4, uint32_t (&w)[NW]) {
  constexpr int n16 = NW / 4;
#pragma unroll
  for (int k = 0; k < n16; ++k) {
    const uint4 v = kvq_lds128(r16 + 512 * k);
    w[4 * k] = v.x;
    w[4 * k + 1] = v.y;
    w[4 * k + 2] = v.z;
    w[4 * k + 3] = v.w;
  }
  constexpr int off8 = 512 * n16, off4 = off8 + (NW % 4 >= 2 ? 256 : 0);
  if constexpr (NW % 4 >= 2) {
    const uint2 v = kvq_lds64(r8 + off8);
    w[4 * n16] = v.x;
    w[4 * n16 + 1] = v.y;
  }
  if constexpr (NW % 2 == 1) w[NW - 1] = kvq_lds32(r4 + off4);
}

// ---- tensor-core and special-function wrappers -----------------------------------------------------
// c += A (16 x 16, row) * B (16 x 8, col), fp16 inputs, fp32 accumulate.
__device__ __forceinline__ void kvq_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
#ifdef KVQ_HOST_EMULATION
  const unsigned a[4] = {a0, a1, a2, a3};
  kvq_emu::mma_m16n8k16_f16(c, a, b0, b1, c);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// c += A (16 x 32, row) * B (32 x 8, col), int8 inputs, int32 accumulate (exact).
__device__ __forceinline__ void kvq_mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
#ifdef KVQ_HOST_EMULATION
  const unsigned a[4] = {a0, a1, a2, a3};
  kvq_emu::mma_m16n8k32_s8(c, a, b0, b1);
#else
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// The transpose of the 8 x 8 b16 matrix a warp holds one pair a lane.
__device__ __forceinline__ uint32_t kvq_movmatrix(uint32_t a) {
#ifdef KVQ_HOST_EMULATION
  return kvq_emu::movmatrix_trans(a);
#else
  uint32_t d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
#endif
}

// 2^x (MUFU.EX2: relative error < 2^-22; the host emulation uses exp2f).
__device__ __forceinline__ float kvq_ex2(float x) {
#ifdef KVQ_HOST_EMULATION
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// fp16 pair (lo, hi), each rounded to nearest even.
__device__ __forceinline__ uint32_t kvq_pack_half2(float lo, float hi) {
#ifdef KVQ_HOST_EMULATION
  return (uint32_t)__half_as_ushort(__float2half_rn(lo)) | ((uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16);
#else
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#endif
}

// (lo, hi) * (v_h, v_h) for half h of v, fp16 products rounded to nearest even (one HMUL2 with a
// broadcast operand).
__device__ __forceinline__ uint32_t kvq_hmul2_bcast(uint32_t p, uint32_t v, int h) {
#ifdef KVQ_HOST_EMULATION
  const float b = (float)__ushort_as_half((unsigned short)(v >> (16 * h)));
  const float lo = (float)__ushort_as_half((unsigned short)(p & 0xFFFFu)) * b;  // exact in float
  const float hi = (float)__ushort_as_half((unsigned short)(p >> 16)) * b;
  return (uint32_t)__half_as_ushort(__float2half_rn(lo)) | ((uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16);
#else
  const __half2 a = *reinterpret_cast<const __half2*>(&p);
  const __half2 b = *reinterpret_cast<const __half2*>(&v);
  const __half2 r = __hmul2(a, h ? __high2half2(b) : __low2half2(b));
  return *reinterpret_cast<const uint32_t*>(&r);
#endif
}

__device__ __forceinline__ float kvq_half_lo(uint32_t u) { return __half2float(__ushort_as_half((unsigned short)(u & 0xFFFFu))); }
__device__ __forceinline__ float kvq_half_hi(uint32_t u) { return __half2float(__ushort_as_half((unsigned short)(u >> 16))); }
__device__ __forceinline__ float kvq_bf16(unsigned short u) { return __int_as_float((int)((unsigned)u << 16)); }
// float -> bfloat16 bits, round to nearest even (finite inputs).
__device__ __forceinline__ unsigned short kvq_to_bf16(float f) {
  const unsigned u = (unsigned)__float_as_int(f);
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#endif  // KVQ_FRAG_CUH
