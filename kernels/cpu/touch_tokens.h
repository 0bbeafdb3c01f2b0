// Reading a paged KV cache ahead of the attention passes.
#pragma once
#include <stdint.h>

// Reads the keys and values of the tokens [t0, t1) once (every KV head's: a page holds a token's heads side by
// side, read front to back), a load per cache line with nothing depending on it, so the core keeps many lines in
// flight; the passes then find them in L2. `table`: the sequence's page ids; `token_stride`: a token's elements.
static void touch_tokens(const uint16_t* restrict k_cache, const uint16_t* restrict v_cache,
                         const int32_t* restrict table, int t0, int t1, int block_size, int64_t token_stride) {
  uint64_t sink = 0;
  for (int t = t0; t < t1;) {
    const int off = t % block_size, run = block_size - off < t1 - t ? block_size - off : t1 - t;
    const int64_t first = ((int64_t)table[t / block_size] * block_size + off) * token_stride;
    const int64_t words = (int64_t)run * token_stride / 4;  // uint64 words
    const uint64_t* k = (const uint64_t*)(k_cache + first);
    const uint64_t* v = (const uint64_t*)(v_cache + first);
    for (int64_t w = 0; w < words; w += 8) sink ^= k[w] ^ v[w];
    t += run;
  }
  __asm__ volatile("" : : "r"(sink));
}
