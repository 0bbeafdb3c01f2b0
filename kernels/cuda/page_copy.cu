// Whole-page moves over a set of same-geometry caches (typically every
// layer's K and V pool), given as a device array of their base addresses:
//
//   copy_blocks     page src_ids[i] -> page dst_ids[i] in every cache (copy-on-write)
//   gather_blocks   page ids[i] of cache c -> staging[i, c]  (staging: [num_ids, num_caches, page])
//   scatter_blocks  staging[i, c] -> page ids[i] of cache c  (swap-in, tier promotion)
//
// One thread block per (page, cache). Pages move in units of U: 16 bytes when
// the page size and every base address allow it, else the element size.
// A copy_blocks call must not use a page both as a source and a destination.
#include "common.cuh"

#define COPY_THREADS 256

struct __align__(16) kv_u128 { unsigned int words[4]; };

template <typename U>
__device__ __forceinline__ void copy_page(U* __restrict__ dst, const U* __restrict__ src, i64 page_units) {
  for (i64 i = threadIdx.x; i < page_units; i += COPY_THREADS) dst[i] = src[i];
}

template <typename U>
__device__ __forceinline__ void copy_blocks_impl(const i64* __restrict__ caches, const i64* __restrict__ src_ids,
                                                 const i64* __restrict__ dst_ids, i64 page_units) {
  U* base = (U*)caches[blockIdx.y];
  copy_page<U>(base + dst_ids[blockIdx.x] * page_units, base + src_ids[blockIdx.x] * page_units, page_units);
}

template <typename U>
__device__ __forceinline__ void gather_blocks_impl(const i64* __restrict__ caches, const i64* __restrict__ ids,
                                                   U* __restrict__ staging, i64 page_units) {
  const U* base = (const U*)caches[blockIdx.y];
  U* dst = staging + ((i64)blockIdx.x * gridDim.y + blockIdx.y) * page_units;
  copy_page<U>(dst, base + ids[blockIdx.x] * page_units, page_units);
}

template <typename U>
__device__ __forceinline__ void scatter_blocks_impl(const i64* __restrict__ caches, const i64* __restrict__ ids,
                                                    const U* __restrict__ staging, i64 page_units) {
  U* base = (U*)caches[blockIdx.y];
  const U* src = staging + ((i64)blockIdx.x * gridDim.y + blockIdx.y) * page_units;
  copy_page<U>(base + ids[blockIdx.x] * page_units, src, page_units);
}

// extern "C" entry points, one per unit size in bytes: {copy,gather,scatter}_blocks_{16b,4b,2b}.
#define PAGE_COPY_ENTRIES(SUFFIX, U)                                                                         \
  extern "C" __global__ void __launch_bounds__(COPY_THREADS)                                               \
      copy_blocks_##SUFFIX(const i64* caches, const i64* src_ids, const i64* dst_ids, i64 page_units) {    \
    copy_blocks_impl<U>(caches, src_ids, dst_ids, page_units);                                             \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(COPY_THREADS)                                               \
      gather_blocks_##SUFFIX(const i64* caches, const i64* ids, U* staging, i64 page_units) {              \
    gather_blocks_impl<U>(caches, ids, staging, page_units);                                               \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(COPY_THREADS)                                               \
      scatter_blocks_##SUFFIX(const i64* caches, const i64* ids, const U* staging, i64 page_units) {       \
    scatter_blocks_impl<U>(caches, ids, staging, page_units);                                              \
  }

PAGE_COPY_ENTRIES(16b, kv_u128)
PAGE_COPY_ENTRIES(4b, unsigned int)
PAGE_COPY_ENTRIES(2b, unsigned short)
