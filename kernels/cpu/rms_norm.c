// RMS norm of the float32 residual stream, rounded to bfloat16 for the matrices, in one pass a row.
//
// torch's CPU rms_norm is a chain of ops (pow, mean, add, rsqrt, mul, mul) and the cast a seventh: 61 a step
// for the bundled model, ~15-70 us each, a tenth of a decode step. Here each row is read twice (the sum of
// squares, then the scaled copy) and written once, in bfloat16.
//
// Float32 arithmetic, the output rounded to bfloat16 (nearest even). The sum's order differs from torch's,
// so a value on a rounding boundary may round the other way: the 16-bit modes use it, never float32.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

// out [n, hidden] bfloat16 (row stride out_stride) = x [n, hidden] float32 (row stride x_stride) / rms(x) * w.
void kvt_rms_norm_bf16(uint16_t* restrict out, int64_t out_stride, const float* restrict x, int64_t x_stride,
                       const float* restrict w, int n, int hidden, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int r = 0; r < n; ++r) {
    const float* row = x + r * x_stride;
    float squares = 0.f;
    for (int i = 0; i < hidden; ++i) squares += row[i] * row[i];
    const float inv = 1.f / sqrtf(squares / (float)hidden + eps);
    uint16_t* o = out + r * out_stride;
    for (int i = 0; i < hidden; ++i) o[i] = f32_to_bf16(row[i] * inv * w[i]);
  }
}
