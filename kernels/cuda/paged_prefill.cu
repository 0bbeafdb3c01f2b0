// Prefill attention over pages: the query tokens of each prefill sequence
// (sequences first_seq.., tokens query_start_loc[s]..query_start_loc[s+1]) over
// its whole context, cached prefix and new tokens alike (already in the cache).
//
// Causal, bottom-right aligned: query row j of a sequence with q_len new tokens
// and ctx tokens in all sits at position ctx - q_len + j and sees keys 0..pos.
//
// One thread block per (tile of PREFILL_ROWS query rows, query head, sequence).
// Each warp owns ROWS_PER_WARP rows and keeps their online-softmax state
// (max m, sum l, unnormalised out) in registers. Keys stream through shared
// memory KEY_TILE at a time: for scores a lane owns a key, for P.V it owns
// head_dim slices (lane + 32 * j), taking each key's probability by shuffle.
#include "common.cuh"

#define PREFILL_WARPS 4
#define PREFILL_THREADS (PREFILL_WARPS * 32)
#define ROWS_PER_WARP 4
#define PREFILL_ROWS (PREFILL_WARPS * ROWS_PER_WARP)
#define KEY_TILE 32  // one key per lane
#define DIMS_PER_LANE 8  // head_dim <= 256

// Dynamic shared memory, in bytes: key offsets (KEY_TILE i64) then floats:
// q (PREFILL_ROWS * head_dim) + K tile (KEY_TILE * (head_dim + 1), padded so
// lanes reading different keys hit different banks) + V tile (KEY_TILE * head_dim).
template <typename T>
__device__ __forceinline__ void prefill_tile(
    T* __restrict__ out,                  // [num_tokens, num_heads, head_dim]
    const T* __restrict__ q,              // token t at q + t * q_stride, [num_heads, head_dim] inside
    const T* __restrict__ k_cache,        // [num_blocks, block_size, num_kv_heads, head_dim]
    const T* __restrict__ v_cache,
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1]
    const int* __restrict__ context_lens,     // [num_seqs]
    i64 q_stride, float scale, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    int first_seq) {
  const int seq = first_seq + blockIdx.z;
  const int head = blockIdx.y;
  const int row0 = blockIdx.x * PREFILL_ROWS;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  if (row0 >= q_len) return;  // the grid is sized for the longest prefill
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int num_rows = min(PREFILL_ROWS, q_len - row0);
  const int first_pos = context_lens[seq] - q_len + row0;  // position of this tile's row 0
  const int num_keys = first_pos + num_rows;               // keys the tile's last row sees

  i64* key_off = (i64*)kv_smem;
  float* q_s = (float*)(key_off + KEY_TILE);
  float* k_s = q_s + PREFILL_ROWS * head_dim;
  float* v_s = k_s + KEY_TILE * (head_dim + 1);

  for (int idx = threadIdx.x; idx < num_rows * head_dim; idx += PREFILL_THREADS) {
    const int r = idx / head_dim, d = idx % head_dim;
    q_s[idx] = to_float(q[(i64)(q_start + row0 + r) * q_stride + (i64)head * head_dim + d]) * scale;
  }

  float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][DIMS_PER_LANE];
#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    m[i] = KV_NEG_INF;
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; ++j) acc[i][j] = 0.f;
  }

  const int* table = block_tables + (i64)seq * max_blocks;
  for (int k0 = 0; k0 < num_keys; k0 += KEY_TILE) {
    const int tile_keys = min(KEY_TILE, num_keys - k0);
    __syncthreads();  // the previous tile is no longer read
    if (threadIdx.x < tile_keys)
      key_off[threadIdx.x] = cache_offset(table, k0 + threadIdx.x, block_size, num_kv_heads, head_dim, kv_head);
    __syncthreads();
    for (int idx = threadIdx.x; idx < tile_keys * head_dim; idx += PREFILL_THREADS) {
      const int j = idx / head_dim, d = idx % head_dim;
      k_s[j * (head_dim + 1) + d] = to_float(k_cache[key_off[j] + d]);
      v_s[j * head_dim + d] = to_float(v_cache[key_off[j] + d]);
    }
    __syncthreads();

    // Scores of this lane's key against the warp's rows.
    float p[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) p[i] = 0.f;
    if (lane < tile_keys) {
      const float* k_row = k_s + lane * (head_dim + 1);
      const float* q_rows = q_s + warp * ROWS_PER_WARP * head_dim;
      for (int d = 0; d < head_dim; ++d) {
        const float kd = k_row[d];
#pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) p[i] += q_rows[i * head_dim + d] * kd;
      }
    }

    // Online softmax: fold this tile into each row's running max and sum.
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
      const int r = warp * ROWS_PER_WARP + i;
      const bool visible = lane < tile_keys && r < num_rows && k0 + lane <= first_pos + r;
      const float s = visible ? p[i] : KV_NEG_INF;
      const float m_new = fmaxf(m[i], warp_max(s));
      // A row that has seen no key yet has m = -inf; exp against 0 then gives 0s, not NaN.
      const float base = m_new == KV_NEG_INF ? 0.f : m_new;
      const float alpha = expf(m[i] - base);
      p[i] = expf(s - base);
      l[i] = l[i] * alpha + warp_sum(p[i]);
      m[i] = m_new;
#pragma unroll
      for (int j = 0; j < DIMS_PER_LANE; ++j) acc[i][j] *= alpha;
    }

    // P.V: each V row is read once from shared memory for all of the warp's rows.
    for (int key = 0; key < tile_keys; ++key) {
      float pk[ROWS_PER_WARP];
#pragma unroll
      for (int i = 0; i < ROWS_PER_WARP; ++i) pk[i] = __shfl_sync(KV_FULL_MASK, p[i], key);
      const float* v_row = v_s + key * head_dim;
#pragma unroll
      for (int j = 0; j < DIMS_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < head_dim) {
          const float vd = v_row[d];
#pragma unroll
          for (int i = 0; i < ROWS_PER_WARP; ++i) acc[i][j] += pk[i] * vd;
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < ROWS_PER_WARP; ++i) {
    const int r = warp * ROWS_PER_WARP + i;
    if (r >= num_rows) continue;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    T* out_row = out + ((i64)(q_start + row0 + r) * num_heads + head) * head_dim;
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; ++j) {
      const int d = lane + 32 * j;
      if (d < head_dim) out_row[d] = from_float<T>(acc[i][j] * inv);
    }
  }
}

// extern "C" entry points, one per dtype: paged_prefill_attention_{f16,bf16,f32}.
#define PREFILL_ENTRY(SUFFIX, T)                                                                            \
  extern "C" __global__ void __launch_bounds__(PREFILL_THREADS) paged_prefill_attention_##SUFFIX(          \
      T* out, const T* q, const T* k_cache, const T* v_cache, const int* block_tables,                    \
      const int* query_start_loc, const int* context_lens, i64 q_stride, float scale, int num_heads,      \
      int num_kv_heads, int head_dim, int block_size, int max_blocks, int first_seq) {                    \
    prefill_tile<T>(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, q_stride, scale, \
                    num_heads, num_kv_heads, head_dim, block_size, max_blocks, first_seq);                \
  }

PREFILL_ENTRY(f16, kv_f16)
PREFILL_ENTRY(bf16, kv_bf16)
PREFILL_ENTRY(f32, float)
