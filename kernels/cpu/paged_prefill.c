// Attention of a run of new tokens over a sequence's pages on the CPU (a chat turn over its cached history,
// a prefill chunk over the chunks before it), KV in bfloat16.
//
// The torch path gathers the pages into a copy and runs SDPA with a mask: ~1.9 ms a layer for a chat
// turn's 47 queries over 1,535 tokens on Zen 5, about half of the turn. Here each (KV head, block of
// queries) item reads its keys and values in place, 16 at a time, for every query head that shares the KV
// head (up to ROWS rows), in one pass with a running softmax:
//
//   scores = q . k * scale        16 keys' pairs of dimensions gathered once, then one VDPBF16PS per
//                                 (row, pair): the key read is shared by all rows
//   running max, rescale          per row: the sum and the output rescaled when the max grows
//   out += p v                    float32, the 16 values converted once for all rows
//
// A run of few tokens (a restored prompt's rest, a prompt in pieces beside decodes) makes few items: 3 KV
// heads on 2 threads left one idle a third of the time, and a thread read its keys at the pace of memory's
// latency (one token over 2,560 cached: 11.2 ms over 30 layers, the decode kernel 3.6). Then each item takes
// one SEGMENT of the keys for every KV head, which it first touches (a load per cache line, nothing depending
// on them, as the decode kernel does), and writes its rows' max, sum and unscaled output; a merge rescales the
// segments' parts to each row's max (`kvtierd bench cpu-attention`: 4 tokens over 2,560, 9.3 ms against 14.9).
//
// Scores, softmax and output are float32; the output is rounded to bfloat16 (nearest even). A query sees
// the keys up to its own position (the new tokens follow the cached ones). Compiled at run time for the
// host CPU (cpu_build.py, -DHEAD_DIM per model); without AVX512-BF16 the build fails and the torch path
// stays.
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "touch_tokens.h"

#if !defined(__AVX512BF16__)
#error "the prefill attention kernel needs AVX512-BF16"
#endif
#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=64 (or the model's head_dim)"
#endif
#define PAIRS (HEAD_DIM / 2)
#define KEYS 16        // keys a step: one vector of scores
#define ROWS 48        // query rows (tokens x heads of a KV head) an item holds
#define ROW_BLOCK 8    // rows whose score accumulators stay in registers
#define MAX_GROUP 16   // query heads per KV head
#define SEGMENT 256    // keys an item takes when a run's items are few (a multiple of KEYS)
#define PART (2 + HEAD_DIM)  // a row's max, sum and unscaled output over one segment

struct item_state {
  _Alignas(64) uint16_t q[ROWS][HEAD_DIM];   // the item's query rows
  _Alignas(64) float out[ROWS][HEAD_DIM];    // running sum of p v
  _Alignas(64) float scores[ROWS][KEYS];
  _Alignas(64) int32_t keys[PAIRS][KEYS];    // 16 keys' dimension pairs: keys[d][i] = (k_i[2d], k_i[2d+1])
  _Alignas(64) float values[KEYS][HEAD_DIM];
  _Alignas(64) float sum[ROWS][KEYS];  // per lane: summed at the end
  float max[ROWS];
  int visible[ROWS];  // keys a row sees: the cached ones and the new ones up to its own
};

// scores[r][i] = q_r . k_i for rows [r0, r0 + n); n is a constant at each call site.
static inline __attribute__((always_inline)) void score_rows(struct item_state* st, int r0, const int n) {
  __m512 acc[ROW_BLOCK];
  for (int r = 0; r < n; ++r) acc[r] = _mm512_setzero_ps();
  for (int d = 0; d < PAIRS; ++d) {
    const __m512bh k = (__m512bh)_mm512_load_si512(st->keys[d]);
    for (int r = 0; r < n; ++r) {
      int32_t pair;
      memcpy(&pair, &st->q[r0 + r][2 * d], sizeof pair);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), k);
    }
  }
  for (int r = 0; r < n; ++r) _mm512_store_ps(st->scores[r0 + r], acc[r]);
}

// e^x for x <= 0 (and finite): 2^n * 2^f with n = round(x log2 e), 2^f by its Taylor series (|error| < 2e-7).
static inline __m512 exp512(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 g = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));  // |g| <= ln2 / 2
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Row r's scores of this block (its first `seen` keys) into probabilities p against the running max, which
// it updates with the sum; returns the factor the row's output so far is rescaled by. seen <= 0: none seen.
static inline __m512 softmax_step(struct item_state* st, int r, int seen, float scale, float* p) {
  if (seen <= 0) {
    _mm512_storeu_ps(p, _mm512_setzero_ps());
    return _mm512_set1_ps(1.f);
  }
  const __mmask16 live = (__mmask16)(seen >= KEYS ? 0xffff : (1u << seen) - 1);
  const __m512 s = _mm512_mul_ps(_mm512_load_ps(st->scores[r]), _mm512_set1_ps(scale));
  const float old = st->max[r];
  const float block_max = _mm512_mask_reduce_max_ps(live, s);
  const float m = block_max > old ? block_max : old;
  const __m512 probs = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_mask_mov_ps(_mm512_set1_ps(m), live, s),
                                                                       _mm512_set1_ps(m))));
  _mm512_storeu_ps(p, probs);
  // the max rarely grows after the first keys: most blocks rescale nothing (and the first has nothing to)
  const __m512 rescale = _mm512_set1_ps(m == old ? 1.f : expf(old - m));
  st->max[r] = m;
  _mm512_store_ps(st->sum[r], _mm512_fmadd_ps(_mm512_load_ps(st->sum[r]), rescale, probs));
  return rescale;
}

// One (KV head, block of query tokens) over the keys [k_lo, k_hi): rows r = token * group + head-in-group.
// part NULL: the keys are all of the block's, its rows go to out; else each row's max, sum and unscaled output
// over these keys go to part + r * PART (a row that sees none of them: sum 0).
static void attend(uint16_t* restrict out, int64_t out_stride, const uint16_t* restrict q, int64_t q_stride,
                   const uint16_t* restrict k_cache, const uint16_t* restrict v_cache,
                   const int32_t* restrict table, int ctx, int q_len, int t0, int t1, int kv_head, int group,
                   int num_kv_heads, int block_size, float scale, int k_lo, int k_hi, float* restrict part,
                   struct item_state* st) {
  const int rows = (t1 - t0) * group;
  const int64_t token_stride = (int64_t)num_kv_heads * HEAD_DIM;
  for (int t = t0; t < t1; ++t)
    for (int g = 0; g < group; ++g) {
      const int r = (t - t0) * group + g;
      memcpy(st->q[r], q + t * q_stride + (int64_t)(kv_head * group + g) * HEAD_DIM, sizeof st->q[r]);
      memset(st->out[r], 0, sizeof st->out[r]);
      st->max[r] = -FLT_MAX;  // below any score (no infinities: built with -ffast-math); its rescale is 0
      memset(st->sum[r], 0, sizeof st->sum[r]);
      st->visible[r] = ctx - q_len + t + 1;
    }
  const int keys_seen = k_hi;  // by the block's last token, in this range
  const int32_t* k_words = (const int32_t*)(k_cache + (int64_t)kv_head * HEAD_DIM);
  for (int k0 = k_lo; k0 < keys_seen; k0 += KEYS) {
    const int n_keys = keys_seen - k0 < KEYS ? keys_seen - k0 : KEYS;
    int32_t word[KEYS];  // each key's row, in 4-byte words from k_words
    int64_t slot[KEYS];
    for (int i = 0; i < KEYS; ++i) {
      const int t = k0 + (i < n_keys ? i : 0);  // past the end: a copy of the first, masked below
      slot[i] = (int64_t)table[t / block_size] * block_size + t % block_size;
      word[i] = (int32_t)(slot[i] * token_stride / 2);
    }
    const __m512i index = _mm512_loadu_si512(word);
    for (int d = 0; d < PAIRS; ++d)
      _mm512_store_si512(st->keys[d], _mm512_i32gather_epi32(index, k_words + d, 4));
    for (int i = 0; i < KEYS; ++i) {
      const uint16_t* v = v_cache + slot[i] * token_stride + (int64_t)kv_head * HEAD_DIM;
      for (int d = 0; d < HEAD_DIM; ++d) {
        const uint32_t u = (uint32_t)v[d] << 16;
        memcpy(&st->values[i][d], &u, sizeof u);
      }
    }
    int r = 0;
    for (; r + ROW_BLOCK <= rows; r += ROW_BLOCK) score_rows(st, r, ROW_BLOCK);
    switch (rows - r) {
#define TAIL(N) case N: score_rows(st, r, N); break;
      TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#undef TAIL
      default: break;
    }
    for (r = 0; r < rows; r += 2) {  // two rows at a time share each value's loads
      const int pair = r + 1 < rows && st->visible[r + 1] - k0 > 0;
      const int seen0 = st->visible[r] - k0 < n_keys ? st->visible[r] - k0 : n_keys;
      if (seen0 <= 0 && !pair) continue;  // this block is past the rows' own positions
      const int seen1 = pair ? (st->visible[r + 1] - k0 < n_keys ? st->visible[r + 1] - k0 : n_keys) : 0;
      float p0[KEYS], p1[KEYS];
      const __m512 rescale0 = softmax_step(st, r, seen0, scale, p0);
      const __m512 rescale1 = pair ? softmax_step(st, r + 1, seen1, scale, p1) : _mm512_setzero_ps();
      float* o0 = st->out[r];
      float* o1 = st->out[r + pair];  // the row itself when alone: read, never written
      __m512 a0[HEAD_DIM / 16], a1[HEAD_DIM / 16];
      for (int j = 0; j < HEAD_DIM / 16; ++j) {
        a0[j] = _mm512_mul_ps(_mm512_load_ps(o0 + 16 * j), rescale0);
        a1[j] = _mm512_mul_ps(_mm512_load_ps(o1 + 16 * j), rescale1);
      }
      const int seen = seen0 > seen1 ? seen0 : seen1;  // p is 0 past a row's own
      for (int i = 0; i < seen; ++i) {
        const __m512 b0 = _mm512_set1_ps(p0[i]), b1 = _mm512_set1_ps(pair ? p1[i] : 0.f);
        for (int j = 0; j < HEAD_DIM / 16; ++j) {
          const __m512 v = _mm512_load_ps(st->values[i] + 16 * j);
          a0[j] = _mm512_fmadd_ps(b0, v, a0[j]);
          a1[j] = _mm512_fmadd_ps(b1, v, a1[j]);
        }
      }
      for (int j = 0; j < HEAD_DIM / 16; ++j) {
        _mm512_store_ps(o0 + 16 * j, a0[j]);
        if (pair) _mm512_store_ps(o1 + 16 * j, a1[j]);
      }
    }
  }
  for (int t = t0; t < t1; ++t)
    for (int g = 0; g < group; ++g) {
      const int r = (t - t0) * group + g;
      const float sum = _mm512_reduce_add_ps(_mm512_load_ps(st->sum[r]));
      if (part != NULL) {
        part[r * PART + 0] = st->max[r];
        part[r * PART + 1] = sum;
        memcpy(part + r * PART + 2, st->out[r], sizeof st->out[r]);
        continue;
      }
      uint16_t* orow = out + t * out_stride + (int64_t)(kv_head * group + g) * HEAD_DIM;
      const float inv = 1.f / sum;
      for (int d = 0; d < HEAD_DIM; ++d) orow[d] = f32_to_bf16(st->out[r][d] * inv);
    }
}

// The segments' parts of one (KV head, block of query tokens) rescaled to each row's common max and summed,
// into its bfloat16 rows.
static void merge_segments(uint16_t* restrict out, int64_t out_stride, const float* restrict parts,
                           int num_segments, int t0, int t1, int kv_head, int group) {
  const int rows = (t1 - t0) * group;
  for (int r = 0; r < rows; ++r) {
    float m = -FLT_MAX;  // a segment the row sees none of has sum 0: skipped
    for (int i = 0; i < num_segments; ++i) {
      const float* p = parts + ((int64_t)i * ROWS + r) * PART;
      if (p[1] > 0.f && p[0] > m) m = p[0];
    }
    float sum = 0.f, acc[HEAD_DIM];
    memset(acc, 0, sizeof acc);
    for (int i = 0; i < num_segments; ++i) {
      const float* p = parts + ((int64_t)i * ROWS + r) * PART;
      if (p[1] == 0.f) continue;
      const float w = expf(p[0] - m);
      sum += w * p[1];
      for (int d = 0; d < HEAD_DIM; ++d) acc[d] += w * p[2 + d];
    }
    uint16_t* orow = out + (t0 + r / group) * out_stride + (int64_t)(kv_head * group + r % group) * HEAD_DIM;
    const float inv = 1.f / sum;  // every row sees its own key
    for (int d = 0; d < HEAD_DIM; ++d) orow[d] = f32_to_bf16(acc[d] * inv);
  }
}

// out [q_len, num_heads, HEAD_DIM] (row stride out_stride) = attention of q [q_len, num_heads, HEAD_DIM]
// (row stride q_stride), the sequence's last q_len tokens, over its ctx tokens in the pages `table`.
// Fewer items than split_below a thread: the keys go in segments (0: never). Returns 0, or -1: a group larger
// than MAX_GROUP, a pool too large for 32-bit gather offsets (num_slots tokens), or no memory.
int kvt_paged_prefill_bf16(uint16_t* restrict out, int64_t out_stride, const uint16_t* restrict q, int64_t q_stride,
                           const uint16_t* restrict k_cache, const uint16_t* restrict v_cache,
                           const int32_t* restrict table, int ctx, int q_len, int num_heads, int num_kv_heads,
                           int block_size, int64_t num_slots, float scale, int num_threads,
                           int split_below) {
  const int group = num_heads / num_kv_heads;
  if (group > MAX_GROUP || num_slots * num_kv_heads * HEAD_DIM / 2 >= INT32_MAX) return -1;
  const int tokens_per_item = ROWS / group;
  const int blocks = (q_len + tokens_per_item - 1) / tokens_per_item;
  // Few items: each block's keys in segments (as many as the last block's keys make; a block that sees fewer
  // has empty ones at the end), every KV head's in one item (touched once), so every thread has work and
  // reads few keys ahead of its passes.
  const int split = blocks * num_kv_heads < split_below * num_threads;
  const int segments = split ? (ctx + SEGMENT - 1) / SEGMENT : 1;
  const int items = split ? blocks * segments : blocks * num_kv_heads;
  float* parts = split ? malloc(sizeof(float) * (size_t)blocks * num_kv_heads * segments * ROWS * PART) : NULL;
  if (split && parts == NULL) return -1;
  const int64_t token_stride = (int64_t)num_kv_heads * HEAD_DIM;
  int failed = 0;
#pragma omp parallel num_threads(items < num_threads ? items : num_threads) reduction(| : failed)
  {
    struct item_state* st = aligned_alloc(64, sizeof *st);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; ++item) {
      // the last tokens' blocks first: they see the most keys
      const int block = blocks - 1 - (split ? item / segments : item / num_kv_heads);
      const int t0 = block * tokens_per_item;
      const int t1 = t0 + tokens_per_item < q_len ? t0 + tokens_per_item : q_len;
      const int keys_seen = ctx - q_len + t1;
      if (st == NULL) {
        failed = 1;
      } else if (!split) {
        attend(out, out_stride, q, q_stride, k_cache, v_cache, table, ctx, q_len, t0, t1, item % num_kv_heads,
               group, num_kv_heads, block_size, scale, 0, keys_seen, NULL, st);
      } else {
        const int segment = item % segments;
        const int k_lo = segment * SEGMENT;
        const int k_hi = k_lo + SEGMENT < keys_seen ? k_lo + SEGMENT : keys_seen;
        if (k_hi > k_lo) touch_tokens(k_cache, v_cache, table, k_lo, k_hi, block_size, token_stride);
        for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head)  // its parts: (block, KV head, segment)
          attend(out, out_stride, q, q_stride, k_cache, v_cache, table, ctx, q_len, t0, t1, kv_head, group,
                 num_kv_heads, block_size, scale, k_lo, k_hi > k_lo ? k_hi : k_lo,
                 parts + (((int64_t)block * num_kv_heads + kv_head) * segments + segment) * ROWS * PART, st);
      }
    }
    free(st);
    if (split) {
#pragma omp for schedule(static)
      for (int unit = 0; unit < blocks * num_kv_heads; ++unit) {  // (block, KV head)
        const int block = unit / num_kv_heads;
        const int t0 = block * tokens_per_item;
        const int t1 = t0 + tokens_per_item < q_len ? t0 + tokens_per_item : q_len;
        if (!failed)
          merge_segments(out, out_stride, parts + (int64_t)unit * segments * ROWS * PART, segments, t0, t1,
                         unit % num_kv_heads, group);
      }
    }
  }
  free(parts);
  return failed ? -1 : 0;
}
