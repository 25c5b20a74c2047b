// Shared pieces of the KV-cache CUDA kernels: limits, the launch macro, error codes and the
// bit-stream helpers of kvq_ref.packing.
//
// Plain CUDA C++ (no torch headers). Compiled by nvcc for the GPU, or by a host C++ compiler with
// host_emu.h force-included (-include host_emu.h, KVQ_HOST_EMULATION defined there), which runs
// every CUDA block as blockDim.x CPU threads so that the same source can be checked on a machine
// without a GPU. Kernels therefore use only: __shared__ arrays of fixed size, __syncthreads()
// reached by every thread of a block, threadIdx/blockIdx/blockDim, __half conversions and the
// double-precision rounding intrinsics listed in host_emu.h (no warp shuffles, no atomics).
#ifndef KVQ_COMMON_CUH
#define KVQ_COMMON_CUH

#ifndef KVQ_HOST_EMULATION
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
// kernel<<<grid, block, 0, stream>>>(args...) spelled so that the host emulation can replace it.
#define KVQ_LAUNCH(kernel, grid, block, stream) kernel<<<(grid), (block), 0, (stream)>>>

// Launch `kernel` after the previous work of `stream`; with `programmatic`, as a programmatic dependent
// launch (Hopper, CUDA >= 11.8): the runtime may start it once every CTA of the previous kernel has run
// griddepcontrol.launch_dependents (kvq_launch_dependents) or exited, and the kernel must call
// kvq_wait_prerequisites before it reads anything the previous kernel writes. Its launch then overlaps the
// previous kernel's tail instead of following its completion. Where the attribute is refused (an older
// driver or device), the plain launch is made instead: the result is the same, only later.
template <typename... P, typename... A>
inline cudaError_t kvq_launch_dependent(void (*kernel)(P...), unsigned grid, unsigned block, cudaStream_t stream,
                                        bool programmatic, A... args) {
  if (programmatic) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
    if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return e;
    (void)cudaGetLastError();  // refused: clear it and launch plainly
  }
  kernel<<<grid, block, 0, stream>>>(args...);
  return cudaGetLastError();
}
#endif

// Programmatic dependent launch, device side (PTX griddepcontrol, sm_90; no-ops elsewhere and in the
// host emulation, whose launches run one after another). kvq_launch_dependents: this CTA no longer
// holds back the dependent kernel's launch (it may be issued by every thread; the CTA counts once).
// kvq_wait_prerequisites: wait until the kernels this one depends on have completed and their memory
// writes are visible; a no-op for a kernel launched without the attribute.
__device__ __forceinline__ void kvq_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void kvq_wait_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Largest vector dimension (head dimension) the kernels take: shared arrays are sized by it.
#define KVQ_MAX_DIM 256
// Largest code width: 2^4 = 16 levels, 15 thresholds.
#define KVQ_MAX_BITS 4
#define KVQ_MAX_LEVELS (1 << KVQ_MAX_BITS)

// Status codes of the extern "C" launch functions: 0 = launched; a negative value = refused
// before launch (the Python binding validates first, so these are a second line of defence);
// a positive value = the cudaError_t of the launch (message: kvq_cuda_error_string).
#define KVQ_OK 0
#define KVQ_EINVAL (-1)

// Bytes of one packed row of k codes of `bits` bits: ceil(k * bits / 8) (kvq_ref.packing.packed_size).
__host__ __device__ __forceinline__ int kvq_packed_size(int k, int bits) { return (k * bits + 7) / 8; }

// Code i of a packed row. kvq_ref.packing's little-endian bit stream: code i occupies stream bits
// [i*bits, (i+1)*bits), least significant bit first; stream bit s is bit s % 8 of byte s / 8.
// At 3 bits a code can straddle two bytes; the second byte is read only when it is needed, so a
// row is never read past its last byte.
__device__ __forceinline__ unsigned kvq_unpack_code(const uint8_t* row, int i, int bits) {
  const int s = i * bits;
  const int byte = s >> 3;
  const int shift = s & 7;
  unsigned v = row[byte];
  if (shift + bits > 8) v |= (unsigned)row[byte + 1] << 8;
  return (v >> shift) & ((1u << bits) - 1u);
}

// Byte `p` of the packed stream of `k` fields of `width` bits, field i being bits
// [shift, shift + width) of codes[i] (shift = 0, width = bits packs the codes themselves; the
// turbo3 block packs its low 2 bits and its high bit as two separate streams). Bit s of the byte
// is stream bit 8p + s, i.e. bit (8p + s) % width of field (8p + s) / width; stream bits past the
// last field are the zero padding that kvq_ref.packing.unpack_codes insists on.
__device__ __forceinline__ uint8_t kvq_pack_byte(const uint8_t* codes, int k, int width, int shift, int p) {
  unsigned byte = 0;
  for (int s = 0; s < 8; ++s) {
    const int stream_bit = 8 * p + s;
    const int i = stream_bit / width;
    if (i < k) byte |= ((unsigned)(codes[i] >> (shift + stream_bit % width)) & 1u) << s;
  }
  return (uint8_t)byte;
}

#endif  // KVQ_COMMON_CUH
