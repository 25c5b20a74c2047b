// Quantize-and-append into the fragment layout: new K/V rows of a decode step or a prefill chunk go
// straight into their page tiles (kvq_frag.cuh), codes and norms bit-identical to
// TurboQuantMSE.encode (kvq_quant.cuh, the rule of kvq_quantize.cu).
//
// Grid B H M, M = (T + 30) / 16 (the most tiles T new tokens can touch), 128 threads. CTA (b, h, k)
// owns tile floor(seq_lens[b] / 16) + k of sequence b, KV head h: it quantizes the call's tokens that
// fall in that tile (one after the other, the whole block per row), then lanes 0-31 rewrite their K
// words, threads 32-63 their V words (each thread only its own lane's words: no two threads write a
// byte), threads 64-79 the norms. A tile is only ever written by one CTA of a call, so no atomics are
// needed; bits of the tile's older tokens are kept. seq_lens is not changed here (the caller adds T
// after the launch, as gpu.triton.cache.append_encoded does).

#include "kvq_common.cuh"
#include "kvq_frag.cuh"
#include "kvq_quant.cuh"

struct FragQuant {  // one TurboQuantMSE: float64 table, rotation, norm correction
  const double* thresholds;
  const double* levels;
  const float* signs1;
  const float* signs2;
  const int* perm;
  int hblock, norm_correction;
};

struct FragAppendArgs {
  const void* k;  // (B, T, H, d), in_dtype (KVQ_IN_F16 / KVQ_IN_F32 of kvq_quant.cuh)
  const void* v;
  int in_dtype, B, T, H;
  uint8_t* kv;  // (pages, H, page_size / 16, tile_bytes)
  const int* block_table;
  const int* seq_lens;
  int page_size, bt_stride;
  FragQuant kq, vq;
};

// Byte offset, inside a side's region, of word wd of lane L (fragment.plane_widths).
template <int NW>
__device__ __forceinline__ int kvq_frag_word_offset(int lane, int wd) {
  constexpr int n16 = NW / 4;
  if (wd < 4 * n16) return 512 * (wd / 4) + 16 * lane + 4 * (wd % 4);
  if constexpr (NW % 4 >= 2) {
    if (wd < 4 * n16 + 2) return 512 * n16 + 8 * lane + 4 * (wd - 4 * n16);
    return 512 * n16 + 256 + 4 * lane;
  }
  return 512 * n16 + 4 * lane;
}

// Lane `lane` of one side: rewrite the bits of the tokens flagged in `is_new` (symbols in sym[tok][j]).
// I8: the 2-bit keys' int8 quads (register i = 4 s + r: token g + 8 (r & 1), coordinates
// 32 s + 16 (r >> 1) + 4 t + hh); else fp16 pairs (kvq_frag.cuh).
template <int D, int B, bool I8>
__device__ void kvq_frag_write_lane(uint8_t* region, int lane, bool kside, const uint8_t (*sym)[D], const bool* is_new) {
  constexpr int NW = KvqSide<D, B>::kWords;
  constexpr int UNITS = I8 ? D / 8 : D / 4, PER = I8 ? 4 : 2;
  uint32_t w[NW];
  for (int k = 0; k < NW; ++k) w[k] = *(const uint32_t*)(region + kvq_frag_word_offset<NW>(lane, k));
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < UNITS; ++i) {
    const int s = i / 4, r = i % 4;
    for (int hh = 0; hh < PER; ++hh) {
      int tok, j;
      if (I8) {
        tok = g + 8 * (r & 1);
        j = 32 * s + 16 * (r >> 1) + 4 * t + hh;
      } else if (kside) {
        tok = g + 8 * (r & 1);
        j = 16 * s + 2 * t + 8 * (r >> 1) + hh;
      } else {
        tok = 2 * t + 8 * (r >> 1) + hh;
        j = 16 * s + g + 8 * (r & 1);
      }
      if (!is_new[tok]) continue;
      const unsigned v = sym[tok][j];
      for (int k = 0; k < B; ++k) {
        int word, bit;
        kvq_frag_field<B, I8>(i, hh, k, word, bit);
        w[word] = (w[word] & ~(1u << bit)) | (((v >> k) & 1u) << bit);
      }
    }
  }
  for (int k = 0; k < NW; ++k) *(uint32_t*)(region + kvq_frag_word_offset<NW>(lane, k)) = w[k];
}

template <int D, int KB, int VB>
__global__ void kvq_frag_append_kernel(FragAppendArgs a) {
  __shared__ QuantShared sm;
  __shared__ uint8_t s_sym[2][KVQ_FRAG_TILE][D];
  __shared__ unsigned short s_norm[2][KVQ_FRAG_TILE];
  __shared__ bool s_new[KVQ_FRAG_TILE];
  const int tiles_per_call = (a.T + 30) / 16;
  const int b = (int)(blockIdx.x / (unsigned)(a.H * tiles_per_call));
  const int h = (int)(blockIdx.x / (unsigned)tiles_per_call % (unsigned)a.H);
  const int k = (int)(blockIdx.x % (unsigned)tiles_per_call);
  const int n0 = a.seq_lens[b];
  const int tile = n0 / KVQ_FRAG_TILE + k;
  const int lo = max(n0, KVQ_FRAG_TILE * tile), hi = min(n0 + a.T, KVQ_FRAG_TILE * (tile + 1));
  if (lo >= hi) return;  // uniform over the block
  const int tid = threadIdx.x;
  if (tid < KVQ_FRAG_TILE) {
    const int p = KVQ_FRAG_TILE * tile + tid;
    s_new[tid] = p >= lo && p < hi;
  }
  for (int p = lo; p < hi; ++p) {
    const size_t row = (((size_t)b * a.T + (p - n0)) * a.H + h) * D;
    const int tok = p % KVQ_FRAG_TILE;
    for (int side = 0; side < 2; ++side) {
      const FragQuant& q = side == 0 ? a.kq : a.vq;
      const int bits = side == 0 ? KB : VB;
      kvq_rotate_and_code(sm, side == 0 ? a.k : a.v, a.in_dtype, row, D, bits, q.thresholds, q.levels, q.signs1,
                          q.signs2, q.perm, q.hblock, q.norm_correction);
      for (int j = tid; j < D; j += blockDim.x)
        s_sym[side][tok][j] = (uint8_t)(side == 0 ? kvq_frag_symbol<KB>(sm.codes[j]) : kvq_frag_symbol<VB>(sm.codes[j]));
      if (tid == 0) s_norm[side][tok] = __half_as_ushort(__double2half(sm.scale));
      __syncthreads();  // sm is reused by the next row
    }
  }
  const int page = a.block_table[(size_t)b * a.bt_stride + (KVQ_FRAG_TILE * tile) / a.page_size];
  uint8_t* base = a.kv + (((size_t)page * a.H + h) * (size_t)(a.page_size / KVQ_FRAG_TILE) +
                          (KVQ_FRAG_TILE * tile % a.page_size) / KVQ_FRAG_TILE) *
                             (size_t)kvq_frag_tile_bytes(D, KB, VB);
  if (tid < 32) {
    kvq_frag_write_lane<D, KB, KB == 2>(base, tid, true, s_sym[0], s_new);
  } else if (tid < 64) {
    kvq_frag_write_lane<D, VB, false>(base + KvqSide<D, KB>::kBytes, tid - 32, false, s_sym[1], s_new);
  } else if (tid < 64 + KVQ_FRAG_TILE && s_new[tid - 64]) {
    const int tok = tid - 64;  // norm group tok % 8: (kn[g], kn[g + 8], vn[g], vn[g + 8])
    unsigned short* nrm = (unsigned short*)(base + KvqSide<D, KB>::kBytes + KvqSide<D, VB>::kBytes) + 4 * (tok % 8);
    nrm[tok / 8] = s_norm[0][tok];
    nrm[2 + tok / 8] = s_norm[1][tok];
  }
}

extern "C" int kvq_frag_append_args_size() { return (int)sizeof(FragAppendArgs); }

extern "C" int kvq_frag_append(const FragAppendArgs* args, void* stream) {
  const FragAppendArgs& a = *args;
  if (a.B < 0 || a.T < 0 || a.H < 1 || a.page_size < 16 || a.page_size % 16 ||
      (a.in_dtype != KVQ_IN_F16 && a.in_dtype != KVQ_IN_F32))
    return KVQ_EINVAL;
  if (a.B == 0 || a.T == 0) return KVQ_OK;
  const long long blocks = (long long)a.B * a.H * ((a.T + 30) / 16);
  if (blocks > 0x7FFFFFFFLL) return KVQ_EINVAL;
  auto* kernel = &kvq_frag_append_kernel<KVQ_FRAG_D, KVQ_FRAG_KB, KVQ_FRAG_VB>;
  KVQ_LAUNCH(kernel, (unsigned)blocks, 128, (cudaStream_t)stream)(a);
  return (int)cudaGetLastError();
}
