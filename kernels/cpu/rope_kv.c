// Rotary embedding of a step's q and k heads, in place, and the new keys and values written to their
// cache slots: one call a layer for what torch does in eight ops (roll, three for the rotation, two
// index copies, and the casts), ~1 ms of a decode step for the bundled model.
//
// Float32 arithmetic, one rounding to bfloat16 a value (torch's bfloat16 ops round after each op), so the
// rotated values may differ from torch's by a bfloat16 step: the 16-bit modes use it, never float32.
#include <stdint.h>
#include <string.h>

#include "bf16.h"

// qkv rows (row stride qkv_stride): q heads, then k heads, then v heads, each head_dim wide. Each q and k
// head x of token t becomes x * cos[t] + roll(x, head_dim / 2) * signed_sin[t] (the tables' rows: the
// "rotate half" layout with its sign folded in); then k and v heads go to the caches' slot slots[t]
// ([slots, kv_heads, head_dim]).
void kvt_rope_write_kv(uint16_t* restrict qkv, int64_t qkv_stride, const uint16_t* restrict cos,
                       const uint16_t* restrict signed_sin, const int64_t* restrict slots,
                       uint16_t* restrict k_cache, uint16_t* restrict v_cache, int n, int q_heads,
                       int kv_heads, int head_dim, int num_threads) {
  const int half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int t = 0; t < n; ++t) {
    float x[512];  // one head, float32 (head_dim <= 512: checked by the caller)
    uint16_t* row = qkv + t * qkv_stride;
    const uint16_t* c = cos + (int64_t)t * head_dim;
    const uint16_t* s = signed_sin + (int64_t)t * head_dim;
    for (int h = 0; h < q_heads + kv_heads; ++h) {
      uint16_t* head = row + (int64_t)h * head_dim;
      for (int d = 0; d < head_dim; ++d) x[d] = bf16_to_f32(head[d]);
      for (int d = 0; d < half; ++d) {
        head[d] = f32_to_bf16(x[d] * bf16_to_f32(c[d]) + x[d + half] * bf16_to_f32(s[d]));
        head[d + half] = f32_to_bf16(x[d + half] * bf16_to_f32(c[d + half]) + x[d] * bf16_to_f32(s[d + half]));
      }
    }
    const int64_t kv_bytes = (int64_t)kv_heads * head_dim * (int64_t)sizeof(uint16_t);
    memcpy(k_cache + slots[t] * kv_heads * head_dim, row + (int64_t)q_heads * head_dim, kv_bytes);
    memcpy(v_cache + slots[t] * kv_heads * head_dim, row + (int64_t)(q_heads + kv_heads) * head_dim, kv_bytes);
  }
}
