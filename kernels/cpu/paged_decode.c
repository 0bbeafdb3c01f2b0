// Decode attention over pages on the CPU: one query token per sequence, KV in bfloat16.
//
// The torch path gathers each sequence's pages into a contiguous copy and runs
// SDPA over it, reading and writing every cached byte once more than needed.
// Here each (sequence, KV head) reads its keys and values once, straight from
// the pages, for all the query heads that share that KV head, in segments of
// SEGMENT tokens that the threads share (one long context no longer goes to
// one thread: 2,560 tokens over 3 KV heads on 2 threads left one idle a third
// of the time):
//
//   pass 1  scores[g][t] = q_g . k_t * scale      (t over the segment)
//   pass 2  p = exp(scores[g] - max), and its sum (exp over whole rows: vectorised)
//   pass 3  acc_g = sum_t p[g][t] v_t
//   merge   each segment's sum and acc rescaled to the sequence's max: out_g = acc_g / sum_g
//
// Arithmetic is float32 throughout; the output is rounded to bfloat16 (nearest
// even). Compiled at run time for the host CPU (cpu_decode.py: -O3 -march=native
// -ffast-math), so the head_dim loops vectorise; HEAD_DIM is fixed per build.
// The (KV head, segment) items are shared by OpenMP threads: torch's CPU wheel
// loads its libgomp first, so they are the same threads torch's own ops use.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=64 (or the model's head_dim)"
#endif
#define MAX_GROUP 16  // query heads per KV head
#define SEGMENT 512   // context tokens a work item attends over: a long context is split between threads
#define PART (2 + HEAD_DIM)  // a segment's max score, sum of exps and unnormalised output, per query head

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

  for (int g = 0; g < group; ++g) {  // pass 2
    float* s = scratch + (int64_t)g * n;
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
  // Work items: SEGMENT-token pieces of each (sequence, KV head)'s context, so one long context is shared by
  // the threads instead of going to one of them (an empty context is one empty piece).
  int64_t* first = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));  // sequence s's pieces start at first[s]
  if (first == NULL) return -1;
  first[0] = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int pieces = context_lens[s] > 0 ? (context_lens[s] + SEGMENT - 1) / SEGMENT : 1;
    first[s + 1] = first[s] + pieces;
  }
  const int64_t per_head = first[num_seqs];                 // pieces of one KV head over all sequences
  const int64_t items = per_head * num_kv_heads;            // (KV head, piece), piece-major inside a head
  float* parts = malloc(sizeof(float) * (size_t)(items * group * PART));
  if (parts == NULL) {
    free(first);
    return -1;
  }
  int failed = 0;
#pragma omp parallel num_threads(items < num_threads ? (int)items : num_threads) reduction(| : failed)
  {
    float* scratch = malloc(sizeof(float) * ((size_t)group * SEGMENT + 1));  // this thread's scores
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {  // every thread reaches the loop's barrier
      const int kv_head = (int)(item / per_head);
      const int64_t piece = item % per_head;
      int64_t seq = 0;
      while (first[seq + 1] <= piece) ++seq;  // few sequences: a scan is as good as a search
      const int t0 = (int)(piece - first[seq]) * SEGMENT;
      const int t1 = t0 + SEGMENT < context_lens[seq] ? t0 + SEGMENT : context_lens[seq];
      float* part = parts + item * group * PART;
      if (scratch == NULL)
        failed = 1;
      else
        attend_segment(part, q, q_stride, k_cache, v_cache, block_tables + seq * max_blocks, t0,
                       t1 > t0 ? t1 : t0, num_heads, num_kv_heads, block_size, scale, seq, kv_head, scratch);
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
