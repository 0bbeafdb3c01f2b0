// bfloat16 <-> float32 for the CPU kernels: bfloat16 is float32's top half.
#pragma once
#include <stdint.h>
#include <string.h>

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
