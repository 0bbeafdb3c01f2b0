// Helpers shared by kvtierd's kernels.
//
// Self-contained on purpose: no CUDA headers. A pip-only install ships libnvrtc
// but not cuda_fp16.h, so these compile under NVRTC with no include path and
// under nvcc unchanged. The loader inlines this file into each .cu before
// compiling, so CuPy's cache key (a hash of the source) covers it too.
#ifndef KVTIERD_COMMON_CUH
#define KVTIERD_COMMON_CUH

typedef long long i64;

#define KV_FULL_MASK 0xffffffffu
#define KV_NEG_INF (__uint_as_float(0xff800000u))

// Every kernel's dynamic shared memory; each kernel documents its own layout.
// 16-byte aligned so a kernel may put 8-byte values first.
extern __shared__ __align__(16) float kv_smem[];

// 16-bit storage types: loads widen to float, all arithmetic is float.
struct __align__(2) kv_f16 { unsigned short bits; };
struct __align__(2) kv_bf16 { unsigned short bits; };

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(kv_f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

__device__ __forceinline__ float to_float(kv_bf16 x) {
  return __uint_as_float(((unsigned int)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float x);

template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

template <> __device__ __forceinline__ kv_f16 from_float<kv_f16>(float x) {
  kv_f16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
  return h;
}

template <> __device__ __forceinline__ kv_bf16 from_float<kv_bf16>(float x) {
  // Round to nearest even, as torch does; bit arithmetic keeps sm_75 working.
  unsigned int u = __float_as_uint(x);
  kv_bf16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
    b.bits = (unsigned short)((u >> 16) | 0x0040u);
    return b;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  b.bits = (unsigned short)(u >> 16);
  return b;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(KV_FULL_MASK, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(KV_FULL_MASK, v, offset));
  return v;
}

// Block-wide reductions; every thread gets the result. `scratch` holds NUM_WARPS floats.
template <int NUM_WARPS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < NUM_WARPS; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads();  // scratch is free again for the next reduction
  return r;
}

template <int NUM_WARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < NUM_WARPS; ++w) r += scratch[w];
  __syncthreads();
  return r;
}

// Element offset of (token t of a sequence, kv head) in a cache laid out as
// [num_blocks, block_size, num_kv_heads, head_dim], through the sequence's block table row.
__device__ __forceinline__ i64 cache_offset(const int* block_table, int t, int block_size, int num_kv_heads,
                                            int head_dim, int kv_head) {
  const i64 slot = (i64)block_table[t / block_size] * block_size + t % block_size;
  return (slot * num_kv_heads + kv_head) * head_dim;
}

#endif  // KVTIERD_COMMON_CUH
