// Decode attention over pages on the CPU: one query token per sequence, KV in bfloat16.
//
// The torch path gathers each sequence's pages into a contiguous copy and runs
// SDPA over it, reading and writing every cached byte once more than needed.
// Here each (sequence, KV head) reads its keys and values once, straight from
// the pages, for all the query heads that share that KV head:
//
//   pass 1  scores[g][t] = q_g . k_t * scale      (t over the context)
//   pass 2  p = softmax(scores[g])                (exp over whole rows: vectorised)
//   pass 3  out_g = sum_t p[g][t] v_t
//
// Arithmetic is float32 throughout; the output is rounded to bfloat16 (nearest
// even). Compiled at run time for the host CPU (cpu_decode.py: -O3 -march=native
// -ffast-math), so the head_dim loops vectorise; HEAD_DIM is fixed per build.
// The (sequence, KV head) items are shared by OpenMP threads: torch's CPU wheel
// loads its libgomp first, so they are the same threads torch's own ops use.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=64 (or the model's head_dim)"
#endif
#define MAX_GROUP 16  // query heads per KV head

static inline float bf16_to_f32(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even (no NaN reaches here)
  return (uint16_t)(u >> 16);
}

static inline void load_row(float* restrict dst, const uint16_t* restrict src) {
  for (int d = 0; d < HEAD_DIM; ++d) dst[d] = bf16_to_f32(src[d]);
}

// One (sequence, KV head): the three passes for the query heads that share the KV head.
static void attend(uint16_t* restrict out, const uint16_t* restrict q, int64_t q_stride,
                   const uint16_t* restrict k_cache, const uint16_t* restrict v_cache,
                   const int32_t* restrict table, int ctx, int num_heads, int num_kv_heads, int block_size,
                   float scale, int64_t seq, int kv_head, float* restrict scratch) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = (int64_t)num_kv_heads * HEAD_DIM;
  float qf[MAX_GROUP][HEAD_DIM];
  for (int g = 0; g < group; ++g) {
    const uint16_t* qrow = q + seq * q_stride + (int64_t)(kv_head * group + g) * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d) qf[g][d] = bf16_to_f32(qrow[d]) * scale;
  }

  float row[HEAD_DIM];
  for (int t = 0; t < ctx; ++t) {  // pass 1
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    load_row(row, k_cache + slot * token_stride + (int64_t)kv_head * HEAD_DIM);
    for (int g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int d = 0; d < HEAD_DIM; ++d) dot += qf[g][d] * row[d];
      scratch[(int64_t)g * ctx + t] = dot;
    }
  }

  float inv_sum[MAX_GROUP];
  for (int g = 0; g < group; ++g) {  // pass 2
    float* s = scratch + (int64_t)g * ctx;
    float m = -INFINITY;
    for (int t = 0; t < ctx; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
    for (int t = 0; t < ctx; ++t) {
      s[t] = expf(s[t] - m);
      sum += s[t];
    }
    inv_sum[g] = ctx > 0 ? 1.f / sum : 0.f;  // an empty context yields zeros, not NaN
  }

  float acc[MAX_GROUP][HEAD_DIM];
  memset(acc, 0, sizeof acc);
  for (int t = 0; t < ctx; ++t) {  // pass 3
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    load_row(row, v_cache + slot * token_stride + (int64_t)kv_head * HEAD_DIM);
    for (int g = 0; g < group; ++g) {
      const float p = scratch[(int64_t)g * ctx + t];
      for (int d = 0; d < HEAD_DIM; ++d) acc[g][d] += p * row[d];
    }
  }
  for (int g = 0; g < group; ++g) {
    uint16_t* orow = out + (seq * num_heads + (int64_t)(kv_head * group + g)) * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d) orow[d] = f32_to_bf16(acc[g][d] * inv_sum[g]);
  }
}

// Returns 0, or -1 when a group is larger than MAX_GROUP or memory runs out.
int kvt_paged_decode_bf16(
    uint16_t* restrict out,               // [num_seqs, num_heads, HEAD_DIM]
    const uint16_t* restrict q,           // row s at q + s * q_stride, [num_heads, HEAD_DIM] inside
    int64_t q_stride,
    const uint16_t* restrict k_cache,     // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const uint16_t* restrict v_cache,
    const int32_t* restrict block_tables, // [num_seqs, max_blocks]
    int64_t max_blocks,
    const int32_t* restrict context_lens, // [num_seqs]
    int64_t num_seqs, int num_heads, int num_kv_heads, int block_size, float scale, int max_context,
    int num_threads) {
  const int group = num_heads / num_kv_heads;
  if (group > MAX_GROUP) return -1;
  const int64_t items = num_seqs * num_kv_heads;  // (sequence, KV head), row-major
  int failed = 0;
#pragma omp parallel num_threads(items < num_threads ? (int)items : num_threads) reduction(| : failed)
  {
    float* scratch = malloc(sizeof(float) * ((size_t)group * max_context + 1));  // this thread's scores
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {  // every thread reaches the loop's barrier
      const int64_t seq = item / num_kv_heads;
      if (scratch == NULL)
        failed = 1;
      else
        attend(out, q, q_stride, k_cache, v_cache, block_tables + seq * max_blocks, context_lens[seq],
               num_heads, num_kv_heads, block_size, scale, seq, (int)(item % num_kv_heads), scratch);
    }
    free(scratch);
  }
  return failed ? -1 : 0;
}
