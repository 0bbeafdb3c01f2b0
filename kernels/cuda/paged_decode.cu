// Decode attention over pages: one query token per sequence (the first
// num_decodes sequences of the batch, so sequence s owns query/output row s).
//
// Flash-decoding split: the context is cut into partitions of partition_size
// tokens, one thread block per (query head, sequence, partition). With one
// partition the block writes the output itself; with more, each block writes
// its partial (max, sum, unnormalised out) and paged_decode_reduce merges them:
//
//   out = sum_p exp(m_p - M) * o_p / sum_p exp(m_p - M) * l_p,  M = max_p m_p
//
// Inside a block, warps take tokens round-robin and lanes own head_dim slices
// (lane + 32 * j), so every K/V row is read with coalesced loads.
#include "common.cuh"

#define DECODE_WARPS 4
#define DECODE_THREADS (DECODE_WARPS * 32)
#define DIMS_PER_LANE 8  // head_dim <= 256

// Dynamic shared memory, in floats: q (head_dim) + scores (partition_size)
// + per-warp outputs (DECODE_WARPS * head_dim) + reduction scratch (DECODE_WARPS).
template <typename T>
__device__ __forceinline__ void decode_partition(
    T* __restrict__ out,               // [num_tokens, num_heads, head_dim]; rows 0..num_decodes-1
    float* __restrict__ part_out,      // [num_decodes, num_heads, num_partitions, head_dim]
    float* __restrict__ part_max,      // [num_decodes, num_heads, num_partitions]
    float* __restrict__ part_sum,      // [num_decodes, num_heads, num_partitions]
    const T* __restrict__ q,           // row s at q + s * q_stride, [num_heads, head_dim] inside
    const T* __restrict__ k_cache,     // [num_blocks, block_size, num_kv_heads, head_dim]
    const T* __restrict__ v_cache,
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
    const int* __restrict__ context_lens,  // [num_seqs]
    i64 q_stride, float scale, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    int partition_size, int num_partitions) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int kv_head = head / (num_heads / num_kv_heads);
  const i64 row = (i64)seq * num_heads + head;
  const int ctx = context_lens[seq];
  const int start = part * partition_size;
  if (start >= ctx) {
    // Nothing to attend to; only an empty sequence without a split writes here (zeros, not NaN).
    if (num_partitions == 1)
      for (int d = threadIdx.x; d < head_dim; d += DECODE_THREADS) out[row * head_dim + d] = from_float<T>(0.f);
    return;
  }
  const int n = min(partition_size, ctx - start);

  float* q_s = kv_smem;
  float* scores = q_s + head_dim;
  float* warp_out = scores + partition_size;
  float* scratch = warp_out + DECODE_WARPS * head_dim;

  const T* q_row = q + seq * q_stride + (i64)head * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += DECODE_THREADS) q_s[d] = to_float(q_row[d]) * scale;
  __syncthreads();

  const int* table = block_tables + (i64)seq * max_blocks;
  for (int i = warp; i < n; i += DECODE_WARPS) {
    const T* k_row = k_cache + cache_offset(table, start + i, block_size, num_kv_heads, head_dim, kv_head);
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; ++j) {
      const int d = lane + 32 * j;
      if (d < head_dim) dot += q_s[d] * to_float(k_row[d]);
    }
    dot = warp_sum(dot);
    if (lane == 0) scores[i] = dot;
  }
  __syncthreads();

  float m = KV_NEG_INF;
  for (int i = threadIdx.x; i < n; i += DECODE_THREADS) m = fmaxf(m, scores[i]);
  m = block_max<DECODE_WARPS>(m, scratch);
  float l = 0.f;
  for (int i = threadIdx.x; i < n; i += DECODE_THREADS) {
    const float p = expf(scores[i] - m);
    scores[i] = p;
    l += p;
  }
  l = block_sum<DECODE_WARPS>(l, scratch);  // its barriers also publish the probabilities

  float acc[DIMS_PER_LANE];
#pragma unroll
  for (int j = 0; j < DIMS_PER_LANE; ++j) acc[j] = 0.f;
  for (int i = warp; i < n; i += DECODE_WARPS) {
    const T* v_row = v_cache + cache_offset(table, start + i, block_size, num_kv_heads, head_dim, kv_head);
    const float p = scores[i];
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; ++j) {
      const int d = lane + 32 * j;
      if (d < head_dim) acc[j] += p * to_float(v_row[d]);
    }
  }
#pragma unroll
  for (int j = 0; j < DIMS_PER_LANE; ++j) {
    const int d = lane + 32 * j;
    if (d < head_dim) warp_out[warp * head_dim + d] = acc[j];
  }
  __syncthreads();

  for (int d = threadIdx.x; d < head_dim; d += DECODE_THREADS) {
    float o = 0.f;
    for (int w = 0; w < DECODE_WARPS; ++w) o += warp_out[w * head_dim + d];
    if (num_partitions == 1)
      out[row * head_dim + d] = from_float<T>(o / l);
    else
      part_out[(row * num_partitions + part) * head_dim + d] = o;
  }
  if (num_partitions > 1 && threadIdx.x == 0) {
    part_max[row * num_partitions + part] = m;
    part_sum[row * num_partitions + part] = l;
  }
}

// One block per (query head, sequence). Dynamic shared memory, in floats:
// partition weights (num_partitions) + reduction scratch (DECODE_WARPS).
template <typename T>
__device__ __forceinline__ void decode_reduce(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ context_lens, int num_heads, int head_dim,
    int partition_size, int num_partitions) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const i64 row = (i64)seq * num_heads + head;
  const int used = (context_lens[seq] + partition_size - 1) / partition_size;  // partitions written

  float* weights = kv_smem;
  float* scratch = weights + num_partitions;

  const float* maxes = part_max + row * num_partitions;
  const float* sums = part_sum + row * num_partitions;
  float m = KV_NEG_INF;
  for (int p = threadIdx.x; p < used; p += DECODE_THREADS) m = fmaxf(m, maxes[p]);
  m = block_max<DECODE_WARPS>(m, scratch);
  float l = 0.f;
  for (int p = threadIdx.x; p < used; p += DECODE_THREADS) {
    const float w = expf(maxes[p] - m);
    weights[p] = w;
    l += w * sums[p];
  }
  l = block_sum<DECODE_WARPS>(l, scratch);
  const float inv = l > 0.f ? 1.f / l : 0.f;  // an empty sequence gets zeros

  const float* parts = part_out + row * num_partitions * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += DECODE_THREADS) {
    float o = 0.f;
    for (int p = 0; p < used; ++p) o += weights[p] * parts[(i64)p * head_dim + d];
    out[row * head_dim + d] = from_float<T>(o * inv);
  }
}

// extern "C" entry points, one per dtype: paged_decode_attention_{f16,bf16,f32}
// and paged_decode_reduce_{f16,bf16,f32}.
#define DECODE_ENTRIES(SUFFIX, T)                                                                             \
  extern "C" __global__ void __launch_bounds__(DECODE_THREADS) paged_decode_attention_##SUFFIX(               \
      T* out, float* part_out, float* part_max, float* part_sum, const T* q, const T* k_cache,              \
      const T* v_cache, const int* block_tables, const int* context_lens, i64 q_stride, float scale,       \
      int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int partition_size,    \
      int num_partitions) {                                                                                 \
    decode_partition<T>(out, part_out, part_max, part_sum, q, k_cache, v_cache, block_tables, context_lens, \
                        q_stride, scale, num_heads, num_kv_heads, head_dim, block_size, max_blocks,         \
                        partition_size, num_partitions);                                                    \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(DECODE_THREADS) paged_decode_reduce_##SUFFIX(                  \
      T* out, const float* part_out, const float* part_max, const float* part_sum, const int* context_lens, \
      int num_heads, int head_dim, int partition_size, int num_partitions) {                                \
    decode_reduce<T>(out, part_out, part_max, part_sum, context_lens, num_heads, head_dim, partition_size,  \
                     num_partitions);                                                                       \
  }

DECODE_ENTRIES(f16, kv_f16)
DECODE_ENTRIES(bf16, kv_bf16)
DECODE_ENTRIES(f32, float)
