// Decode attention over pages on the CPU: one query token per sequence, KV in bfloat16.
//
// The torch path gathers each sequence's pages into a contiguous copy and runs
// SDPA over it, reading and writing every cached byte once more than needed.
// Here each (sequence, KV head) reads its keys and values once, straight from
// the pages, for all the query heads that share that KV head, in segments of
// SEGMENT tokens that the threads share (one long context no longer goes to
// one thread: 2,560 tokens over 3 KV heads on 2 threads left one idle a third
// of the time). A work item is one segment for every KV head, so a page, which
// holds a token's heads side by side, is read from memory once, front to back:
//
//   touch   a load per cache line of the segment's keys and values, nothing depending on them: the core
//           keeps many lines in flight, and the passes below find them in L2. Reading them as the passes
//           compute held one thread at ~3 GB/s (long contexts scattered in the pool, 2 threads: 6.3 GB/s in
//           all, where a gather of the same pages reads 25), and software prefetches of the next page
//           changed nothing; touched first, the kernel reads 11-12 GB/s
//   pass 1  scores[g][t] = q_g . k_t * scale      (t over the segment)
//   pass 2  p = exp(scores[g] - max), and its sum (exp over whole rows: vectorised)
//   pass 3  acc_g = sum_t p[g][t] v_t
//   merge   each segment's sum and acc rescaled to the sequence's max: out_g = acc_g / sum_g
//
// Arithmetic is float32 throughout; the output is rounded to bfloat16 (nearest
// even). Compiled at run time for the host CPU (cpu_decode.py: -O3 -march=native
// -ffast-math), so the head_dim loops vectorise; HEAD_DIM is fixed per build.
// The segment items are shared by OpenMP threads: torch's CPU wheel
// loads its libgomp first, so they are the same threads torch's own ops use.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "touch_tokens.h"

#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=64 (or the model's head_dim)"
#endif
#define MAX_GROUP 16  // query heads per KV head
#define SEGMENT 256   // context tokens a work item attends over: a long context is split between threads
#define PART (2 + HEAD_DIM)  // a segment's max score, sum of exps and unnormalised output, per query head

// Pass 2 over `count` query heads' rows of n scores (row g at scores + g * n): exp(score - max) in place, each
// row's max and sum of exps into its part (part + g * PART).
static void exp_rows(float* restrict scores, int n, int count, float* restrict part) {
  for (int g = 0; g < count; ++g) {
    float* s = scores + (int64_t)g * n;
    float m = -FLT_MAX;
    for (int t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
    for (int t = 0; t < n; ++t) {
      s[t] = expf(s[t] - m);
      sum += s[t];
    }
    part[g * PART + 0] = m;
    part[g * PART + 1] = sum;
  }
}

#if defined(__AVX512BF16__) && HEAD_DIM % 32 == 0
// AVX512-BF16: a score is one VDPBF16PS per 32 dimensions of (bfloat16 q, bfloat16 k) summed in float32 (the
// pairs' products are exact), scaled after the sum; values are widened to float32 once per token for every
// query head of a block, whose accumulators stay in registers. With the items below (before the touch), one
// token over 2,560 took 10 ms over 30 layers instead of the portable loops' 14-19 (and the prefill kernel's
// 12-16), 4 over 8,192 took 134-137 ms instead of 234-236 (`kvtierd bench cpu-attention`, the previous source
// swapped in for the "instead"; a Xeon with AMX, 2 threads): a long context joining running streams doubled
// their step.
#include <immintrin.h>
#define PAIR_VECTORS (HEAD_DIM / 32)  // a row's 32-dimension vectors of bfloat16 pairs
#define VECTORS (HEAD_DIM / 16)       // a row's float32 vectors
#define GROUP_BLOCK 4                 // query heads a pass over the values serves

// Scores of `gb` query heads (`qv[g]`: their bfloat16 rows) over `n` keys at `k`, one token apart.
static inline __attribute__((always_inline)) void score_run(float* restrict scores, int64_t g_stride,
                                                            const __m512bh (*qv)[PAIR_VECTORS],
                                                            const uint16_t* restrict k, int64_t token_stride,
                                                            int n, const int gb, float scale) {
  for (int i = 0; i < n; ++i) {
    __m512bh kv[PAIR_VECTORS];
    for (int c = 0; c < PAIR_VECTORS; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + i * token_stride + 32 * c);
    for (int g = 0; g < gb; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < PAIR_VECTORS; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
      scores[g * g_stride + i] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// acc[g] += p[g][i] v_i for `gb` query heads over `n` values at `v`, one token apart.
static inline __attribute__((always_inline)) void value_run(__m512 (*acc)[VECTORS], const float* restrict p,
                                                            int64_t g_stride, const uint16_t* restrict v,
                                                            int64_t token_stride, int n, const int gb) {
  for (int i = 0; i < n; ++i) {
    __m512 vf[VECTORS];
    for (int c = 0; c < VECTORS; ++c) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(v + i * token_stride + 16 * c));
      vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int g = 0; g < gb; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * g_stride + i]);
      for (int c = 0; c < VECTORS; ++c) acc[g][c] = _mm512_fmadd_ps(w, vf[c], acc[g][c]);
    }
  }
}

// The query heads [g0, g0 + gb) of a segment, page run by page run; gb is a constant at each call site.
static inline __attribute__((always_inline)) void attend_heads(
    float* restrict part, const uint16_t* restrict qrows, const uint16_t* restrict k_cache,
    const uint16_t* restrict v_cache, const int32_t* restrict table, int t0, int t1, int64_t token_stride,
    int block_size, float scale, float* restrict scratch, int g0, const int gb) {
  const int n = t1 - t0;
  __m512bh qv[GROUP_BLOCK][PAIR_VECTORS];
  for (int g = 0; g < gb; ++g)
    for (int c = 0; c < PAIR_VECTORS; ++c)
      qv[g][c] = (__m512bh)_mm512_loadu_si512(qrows + (int64_t)(g0 + g) * HEAD_DIM + 32 * c);
  for (int t = t0; t < t1;) {  // pass 1
    const int off = t % block_size, run = block_size - off < t1 - t ? block_size - off : t1 - t;
    const int64_t slot = (int64_t)table[t / block_size] * block_size + off;
    score_run(scratch + (t - t0), n, (const __m512bh(*)[PAIR_VECTORS])qv, k_cache + slot * token_stride,
              token_stride, run, gb, scale);
    t += run;
  }
  exp_rows(scratch, n, gb, part + g0 * PART);  // pass 2
  __m512 acc[GROUP_BLOCK][VECTORS];
  for (int g = 0; g < gb; ++g)
    for (int c = 0; c < VECTORS; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int t = t0; t < t1;) {  // pass 3
    const int off = t % block_size, run = block_size - off < t1 - t ? block_size - off : t1 - t;
    const int64_t slot = (int64_t)table[t / block_size] * block_size + off;
    value_run(acc, scratch + (t - t0), n, v_cache + slot * token_stride, token_stride, run, gb);
    t += run;
  }
  for (int g = 0; g < gb; ++g)
    for (int c = 0; c < VECTORS; ++c) _mm512_storeu_ps(part + (g0 + g) * PART + 2 + 16 * c, acc[g][c]);
}

// One segment [t0, t1) of one (sequence, KV head)'s context: the three passes for the query heads that share
// the KV head, unnormalised: part[g] = {max score, sum of exp(score - max), sum of exp(score - max) v}.
static void attend_segment(float* restrict part, const uint16_t* restrict q, int64_t q_stride,
                           const uint16_t* restrict k_cache, const uint16_t* restrict v_cache,
                           const int32_t* restrict table, int t0, int t1, int num_heads, int num_kv_heads,
                           int block_size, float scale, int64_t seq, int kv_head, float* restrict scratch) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = (int64_t)num_kv_heads * HEAD_DIM;
  const uint16_t* qrows = q + seq * q_stride + (int64_t)kv_head * group * HEAD_DIM;
  const int64_t head_offset = (int64_t)kv_head * HEAD_DIM;
  k_cache += head_offset;
  v_cache += head_offset;
  for (int g0 = 0; g0 < group; g0 += GROUP_BLOCK) {
    float* s = scratch + (int64_t)g0 * (t1 - t0);
    switch (group - g0 < GROUP_BLOCK ? group - g0 : GROUP_BLOCK) {  // a constant block size per call
      case 1: attend_heads(part, qrows, k_cache, v_cache, table, t0, t1, token_stride, block_size, scale, s, g0, 1); break;
      case 2: attend_heads(part, qrows, k_cache, v_cache, table, t0, t1, token_stride, block_size, scale, s, g0, 2); break;
      case 3: attend_heads(part, qrows, k_cache, v_cache, table, t0, t1, token_stride, block_size, scale, s, g0, 3); break;
      default: attend_heads(part, qrows, k_cache, v_cache, table, t0, t1, token_stride, block_size, scale, s, g0, 4);
    }
  }
}
#else
static inline void load_row(float* restrict dst, const uint16_t* restrict src) {
  for (int d = 0; d < HEAD_DIM; ++d) dst[d] = bf16_to_f32(src[d]);
}

// One segment [t0, t1) of one (sequence, KV head)'s context: the three passes for the query heads that share
// the KV head, unnormalised: part[g] = {max score, sum of exp(score - max), sum of exp(score - max) v}.
static void attend_segment(float* restrict part, const uint16_t* restrict q, int64_t q_stride,
                           const uint16_t* restrict k_cache, const uint16_t* restrict v_cache,
                           const int32_t* restrict table, int t0, int t1, int num_heads, int num_kv_heads,
                           int block_size, float scale, int64_t seq, int kv_head, float* restrict scratch) {
  const int group = num_heads / num_kv_heads;
  const int n = t1 - t0;
  const int64_t token_stride = (int64_t)num_kv_heads * HEAD_DIM;
  float qf[MAX_GROUP][HEAD_DIM];
  for (int g = 0; g < group; ++g) {
    const uint16_t* qrow = q + seq * q_stride + (int64_t)(kv_head * group + g) * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d) qf[g][d] = bf16_to_f32(qrow[d]) * scale;
  }

  float row[HEAD_DIM];
  for (int t = t0; t < t1; ++t) {  // pass 1
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    load_row(row, k_cache + slot * token_stride + (int64_t)kv_head * HEAD_DIM);
    for (int g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int d = 0; d < HEAD_DIM; ++d) dot += qf[g][d] * row[d];
      scratch[(int64_t)g * n + (t - t0)] = dot;
    }
  }

  exp_rows(scratch, n, group, part);  // pass 2

  float acc[MAX_GROUP][HEAD_DIM];
  memset(acc, 0, sizeof acc);
  for (int t = t0; t < t1; ++t) {  // pass 3
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    load_row(row, v_cache + slot * token_stride + (int64_t)kv_head * HEAD_DIM);
    for (int g = 0; g < group; ++g) {
      const float p = scratch[(int64_t)g * n + (t - t0)];
      for (int d = 0; d < HEAD_DIM; ++d) acc[g][d] += p * row[d];
    }
  }
  for (int g = 0; g < group; ++g) memcpy(part + g * PART + 2, acc[g], sizeof acc[g]);
}
#endif

// The segments' parts of one (sequence, KV head) rescaled to their common max and summed, into bfloat16 rows.
static void merge_segments(uint16_t* restrict out, const float* restrict parts, int num_segments, int group,
                           int num_heads, int64_t seq, int kv_head) {
  for (int g = 0; g < group; ++g) {
    float m = -FLT_MAX;  // a segment's sum of exps is at least 1 (its max's own); an empty one's is 0: skipped
    for (int i = 0; i < num_segments; ++i) {
      const float* part = parts + ((int64_t)i * group + g) * PART;
      if (part[1] > 0.f && part[0] > m) m = part[0];
    }
    float sum = 0.f, acc[HEAD_DIM];
    memset(acc, 0, sizeof acc);
    for (int i = 0; i < num_segments; ++i) {
      const float* part = parts + ((int64_t)i * group + g) * PART;
      if (part[1] == 0.f) continue;
      const float w = expf(part[0] - m);
      sum += w * part[1];
      for (int d = 0; d < HEAD_DIM; ++d) acc[d] += w * part[2 + d];
    }
    const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;  // an empty context yields zeros, not NaN
    uint16_t* orow = out + (seq * num_heads + (int64_t)(kv_head * group + g)) * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d) orow[d] = f32_to_bf16(acc[d] * inv_sum);
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
    int64_t num_seqs, int num_heads, int num_kv_heads, int block_size, float scale, int num_threads) {
  const int group = num_heads / num_kv_heads;
  if (group > MAX_GROUP) return -1;
  // Work items: SEGMENT-token pieces of each sequence's context, every KV head of a piece in one item (a page
  // holds a token's heads side by side: read once, front to back), so one long context is shared by the
  // threads instead of going to one of them (an empty context is one empty piece).
  int64_t* first = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));  // sequence s's pieces start at first[s]
  if (first == NULL) return -1;
  first[0] = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int pieces = context_lens[s] > 0 ? (context_lens[s] + SEGMENT - 1) / SEGMENT : 1;
    first[s + 1] = first[s] + pieces;
  }
  const int64_t per_head = first[num_seqs];  // the items: pieces over all sequences
  // A piece's part for one KV head at (kv_head * per_head + piece): each head's pieces side by side for the merge.
  float* parts = malloc(sizeof(float) * (size_t)(per_head * num_kv_heads * group * PART));
  if (parts == NULL) {
    free(first);
    return -1;
  }
  int failed = 0;
#pragma omp parallel num_threads(per_head < num_threads ? (int)per_head : num_threads) reduction(| : failed)
  {
    float* scratch = malloc(sizeof(float) * ((size_t)group * SEGMENT + 1));  // this thread's scores
#pragma omp for schedule(dynamic, 1)
    for (int64_t piece = 0; piece < per_head; ++piece) {  // every thread reaches the loop's barrier
      int64_t seq = 0;
      while (first[seq + 1] <= piece) ++seq;  // few sequences: a scan is as good as a search
      const int t0 = (int)(piece - first[seq]) * SEGMENT;
      const int t1 = t0 + SEGMENT < context_lens[seq] ? t0 + SEGMENT : context_lens[seq];
      touch_tokens(k_cache, v_cache, block_tables + seq * max_blocks, t0, t1, block_size,
                    (int64_t)num_kv_heads * HEAD_DIM);
      for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        if (scratch == NULL)
          failed = 1;
        else
          attend_segment(parts + (kv_head * per_head + piece) * group * PART, q, q_stride, k_cache, v_cache,
                         block_tables + seq * max_blocks, t0, t1 > t0 ? t1 : t0, num_heads, num_kv_heads,
                         block_size, scale, seq, kv_head, scratch);
      }
    }
    free(scratch);
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < num_seqs * num_kv_heads; ++pair) {  // (sequence, KV head)
      const int64_t seq = pair / num_kv_heads;
      const int kv_head = (int)(pair % num_kv_heads);
      if (!failed)
        merge_segments(out, parts + (kv_head * per_head + first[seq]) * group * PART,
                       (int)(first[seq + 1] - first[seq]), group, num_heads, seq, kv_head);
    }
  }
  free(parts);
  free(first);
  return failed ? -1 : 0;
}
