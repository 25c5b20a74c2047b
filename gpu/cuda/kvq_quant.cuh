// TurboQuantMSE's quantization rule on one vector per thread block (kvq_ref bit for bit), shared by
// kvq_quantize.cu (row layouts, turbo blocks) and kvq_frag_append.cu (the fragment layout); see
// kvq_quantize.cu for what has to match, step by step.
#ifndef KVQ_QUANT_CUH
#define KVQ_QUANT_CUH

#include "kvq_common.cuh"

// Threads per block; thread t handles coordinates t, t + 128 (d <= 256).
#define KVQ_QUANT_THREADS 128

// Input dtypes (in_dtype argument).
#define KVQ_IN_F16 0
#define KVQ_IN_F32 1

// Per-block working set (about 4.5 KB of shared memory).
struct QuantShared {
  double a[KVQ_MAX_DIM];              // input row, then squared levels (norm correction)
  double w[KVQ_MAX_DIM];              // squared inputs, then the vector being rotated
  double thr[KVQ_MAX_LEVELS - 1];     // float64 thresholds
  double lev[KVQ_MAX_LEVELS];         // float64 levels (norm correction only)
  uint8_t codes[KVQ_MAX_DIM];
  double norm, inv_norm, scale;
};

static __device__ __forceinline__ double kvq_load(const void* x, int in_dtype, size_t i) {
  return in_dtype == KVQ_IN_F16 ? (double)__half2float(((const __half*)x)[i]) : (double)((const float*)x)[i];
}

// s = 0; s += a[0]; s += a[1]; ... (kvq_ref.common.row_norm's loop).
static __device__ double kvq_sum_sequential(const double* a, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s = __dadd_rn(s, a[i]);
  return s;
}

// Steps 1-6 for the vector at element offset `row` of x: leaves sm.codes[0..d) and sm.scale (double)
// in shared memory. Every thread of the block must call it (it synchronizes the block).
static __device__ void kvq_rotate_and_code(QuantShared& sm, const void* x, int in_dtype, size_t row, int d, int bits,
                                    const double* thresholds, const double* levels, const float* signs1,
                                    const float* signs2, const int* perm, int hblock, int norm_correction) {
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int n_thr = (1 << bits) - 1;

  // 1. tables and the input row (as double) into shared memory, squares of the inputs.
  for (int i = tid; i < n_thr; i += nt) sm.thr[i] = thresholds[i];
  for (int i = tid; i <= n_thr; i += nt) sm.lev[i] = levels[i];
  for (int j = tid; j < d; j += nt) {
    const double v = kvq_load(x, in_dtype, row + j);
    sm.a[j] = v;
    sm.w[j] = __dmul_rn(v, v);
  }
  __syncthreads();

  // 2. the norm, by one thread in the reference's summation order.
  if (tid == 0) {
    const double norm = __dsqrt_rn(kvq_sum_sequential(sm.w, d));
    sm.norm = norm;
    sm.inv_norm = norm > 0.0 ? __ddiv_rn(1.0, norm) : 0.0;
  }
  __syncthreads();

  // 3-4a. unit vector, D1, then the permutation P: w[j] = u[perm[j]] * signs1[perm[j]].
  const double norm = sm.norm;
  for (int j = tid; j < d; j += nt) {
    const int src = perm ? perm[j] : j;
    sm.w[j] = __dmul_rn(sm.a[src], sm.inv_norm) * (double)signs1[src];  // exact: signs are +-1
  }

  // 4b. butterflies, stage by stage; pair p of a stage is (i, i + h) with i = (p / h) * 2h + p % h,
  // which stays inside its block of hblock coordinates because 2h <= hblock divides d.
  for (int h = 1; h < hblock; h <<= 1) {
    __syncthreads();
    for (int p = tid; p < d / 2; p += nt) {
      const int i = (p / h) * 2 * h + (p % h);
      const double lo = sm.w[i], hi = sm.w[i + h];
      sm.w[i] = __dadd_rn(lo, hi);
      sm.w[i + h] = __dsub_rn(lo, hi);
    }
  }
  __syncthreads();

  // 4c-5. scale, D2, code = #{thresholds < y}.
  const double c = __ddiv_rn(1.0, __dsqrt_rn((double)hblock));
  for (int j = tid; j < d; j += nt) {
    const double y = __dmul_rn(sm.w[j], c) * (double)signs2[j];
    int code = 0;
    for (int k = 0; k < n_thr; ++k) code += sm.thr[k] < y ? 1 : 0;
    sm.codes[j] = (uint8_t)code;
    if (norm_correction) sm.a[j] = __dmul_rn(sm.lev[code], sm.lev[code]);
  }
  __syncthreads();

  // 6. the stored scale.
  if (tid == 0) {
    sm.scale = norm_correction ? __ddiv_rn(norm, __dsqrt_rn(kvq_sum_sequential(sm.a, d))) : norm;
  }
  __syncthreads();
}

#endif  // KVQ_QUANT_CUH
