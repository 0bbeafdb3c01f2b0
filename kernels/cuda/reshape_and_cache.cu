// Cache write: scatters each new token's K and V rows [num_kv_heads, head_dim]
// into its slot (page * block_size + offset) of the paged caches.
// One thread block per token; a negative slot marks a padding token and is skipped.
#include "common.cuh"

#define CACHE_WRITE_THREADS 128

template <typename T>
__device__ __forceinline__ void write_token(
    T* __restrict__ k_cache,               // [num_blocks, block_size, num_kv_heads, head_dim]
    T* __restrict__ v_cache,
    const T* __restrict__ k,               // token t at k + t * k_stride, [num_kv_heads, head_dim] inside
    const T* __restrict__ v,
    const i64* __restrict__ slot_mapping,  // [num_tokens]
    i64 k_stride, i64 v_stride, int row_elems) {  // row_elems = num_kv_heads * head_dim
  const i64 token = blockIdx.x;
  const i64 slot = slot_mapping[token];
  if (slot < 0) return;
  T* k_dst = k_cache + slot * row_elems;
  T* v_dst = v_cache + slot * row_elems;
  const T* k_src = k + token * k_stride;
  const T* v_src = v + token * v_stride;
  for (int e = threadIdx.x; e < row_elems; e += CACHE_WRITE_THREADS) {
    k_dst[e] = k_src[e];
    v_dst[e] = v_src[e];
  }
}

// extern "C" entry points, one per dtype: reshape_and_cache_{f16,bf16,f32}.
#define CACHE_WRITE_ENTRY(SUFFIX, T)                                                                         \
  extern "C" __global__ void __launch_bounds__(CACHE_WRITE_THREADS) reshape_and_cache_##SUFFIX(             \
      T* k_cache, T* v_cache, const T* k, const T* v, const i64* slot_mapping, i64 k_stride, i64 v_stride, \
      int row_elems) {                                                                                     \
    write_token<T>(k_cache, v_cache, k, v, slot_mapping, k_stride, v_stride, row_elems);                   \
  }

CACHE_WRITE_ENTRY(f16, kv_f16)
CACHE_WRITE_ENTRY(bf16, kv_bf16)
CACHE_WRITE_ENTRY(f32, float)
