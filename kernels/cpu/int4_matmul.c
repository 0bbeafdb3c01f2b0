// y = x W^T for a 4-bit weight matrix, for steps of a few to a few dozen rows.
//
// torch's int4 kernel dequantizes the weights again for every row of x (~2 ms a row over the bundled
// model's matrices on Sapphire Rapids, ~0.75 ms on Zen 5), so past a few rows the bfloat16 copies, 4x the
// bytes, were faster. Here each weight is read once a step for many rows: the matrix is read as 4 bits a
// weight, and a row costs its arithmetic only. Two builds of the one product, by the host's instructions:
// - AMX-BF16 (Intel Sapphire Rapids and later): a 16-output slice of one 32-input group is dequantized
//   into an AMX tile (float32, rounded to bfloat16: exactly the values of the model's dense bfloat16 copy)
//   and multiplied against 48 rows at a time (TDPBF16PS).
// - AVX512-BF16 alone (AMD Zen 4 and later): no dequantization. A code c becomes the bfloat16 128 + c by
//   bit operations, each input pair is one VDPBF16PS against the row's pair broadcast, and each group's
//   (scale, offset) applies once to its sum (multiply_rows). This uses the quantized weights unrounded,
//   as torch's int4 kernel does: the result is the exact product rounded to bfloat16, to float32 sums.
//
// Weights (`tile_codes` in cpu_int4_matmul.py): for each block of 16 outputs, each group of 32 inputs, each input pair p,
// 16 bytes: byte i holds output i's code for input 2p (low nibble) and 2p+1 (high nibble). Scales:
// torch's [K/32 groups][N outputs][2] bfloat16, (scale, offset), w = scale * (code - 8) + offset.
// Products accumulate in float32; the output is rounded to bfloat16.
//
// Compiled at run time for the host CPU (cpu_build.py); without AVX512-BF16 the build fails and the
// torch path stays. AMX's tile registers need the process's permission, asked once (kvt_int4_init).
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AVX512BF16__)
#error "the int4 matmul kernel needs AVX512-BF16"
#endif

#define GROUP 32  // inputs per (scale, offset): one tile's depth
#define SLICE 16  // outputs per slice: one tile's or one vector's width

#if defined(__AMX_BF16__)

#define TILE_ROWS 16   // rows of x per tile
#define ROW_TILES 3    // row tiles a pass: 48 rows share each dequantized weight tile
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
// GCC's tile intrinsics are asm that name only a pointer, not the memory behind it: without this the
// compiler may drop or move the stores a tile load reads (the config, the dequantized tile) and the loads
// of what a tile store wrote.
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

const char* kvt_int4_isa(void) { return "amx"; }

// One group's weights for 16 outputs as a tile in AMX's pair layout: row p, column i holds
// the bfloat16 pair (w[i][2p], w[i][2p+1]).
static inline void dequantize(uint16_t* restrict tile, const uint8_t* restrict codes,
                              const uint16_t* restrict pairs) {
  const __m512i p = _mm512_loadu_si512(pairs);  // (scale, offset) of the 16 outputs
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
  const __m512 offset = _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32((int)0xffff0000u)));
  const __m512 zero = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, offset);  // w = scale * code + zero
  const __m512i nibble = _mm512_set1_epi32(0x0f);
  // After the pack below, [even 0..15 | odd 0..15] -> (even i, odd i) pairs.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int row = 0; row < GROUP / 2; ++row) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + row * SLICE)));
    const __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, nibble)), scale, zero);
    const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), scale, zero);
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    _mm512_storeu_si512(tile + row * 2 * SLICE, _mm512_permutexvar_epi16(interleave, packed));
  }
}

// Asks Linux for the AMX tile state (once per process; granted to every thread). 0 when granted.
int kvt_int4_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

struct tile_config {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0-2 accumulators of rows 0-15, 16-31, 32-47 of a pass; 3-5 those rows of x; 6 the weights.
// (The tile instructions take tile numbers as literals, hence the spelled-out calls below.)
static void configure(const int rows[ROW_TILES]) {
  struct tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < ROW_TILES; ++t) {
    cfg.rows[t] = cfg.rows[ROW_TILES + t] = (uint8_t)(rows[t] ? rows[t] : 1);
    cfg.colsb[t] = cfg.colsb[ROW_TILES + t] = 64;
  }
  cfg.rows[6] = GROUP / 2;
  cfg.colsb[6] = 64;
  MEMORY_BARRIER();
  _tile_loadconfig(&cfg);
}

static inline void store_rows(uint16_t* out, int64_t out_stride, const float* acc, int rows) {
  for (int r = 0; r < rows; ++r)
    _mm256_storeu_si256((__m256i*)(out + r * out_stride),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * SLICE)));
}

// out [M, N] bfloat16 (row stride out_stride) = x [M, K] bfloat16 (row stride x_stride) times the int4
// matrix [N, K]; N a multiple of 16, K of 32. Rows go 48 at a time: each weight tile is dequantized once
// a pass.
void kvt_int4_matmul(uint16_t* out, int64_t out_stride, const uint16_t* x, int64_t x_stride,
                     const uint8_t* codes, const uint16_t* scales, int m, int n, int k_size, int num_threads) {
  const int slices = n / SLICE, groups = k_size / GROUP;
  const int64_t x_bytes = x_stride * (int64_t)sizeof(uint16_t);
#pragma omp parallel num_threads(slices < num_threads ? slices : num_threads)
  {
    _Alignas(64) uint16_t tile[GROUP / 2 * 2 * SLICE];
    _Alignas(64) float acc[TILE_ROWS * SLICE];
    for (int r0 = 0; r0 < m; r0 += ROW_TILES * TILE_ROWS) {
      int rows[ROW_TILES];
      for (int t = 0; t < ROW_TILES; ++t) {
        const int left = m - r0 - t * TILE_ROWS;
        rows[t] = left <= 0 ? 0 : left < TILE_ROWS ? left : TILE_ROWS;
      }
      configure(rows);
      const uint16_t* x0 = x + (int64_t)r0 * x_stride;
      const uint16_t* x1 = x0 + (int64_t)TILE_ROWS * x_stride;
      const uint16_t* x2 = x1 + (int64_t)TILE_ROWS * x_stride;
#pragma omp for schedule(static)
      for (int s = 0; s < slices; ++s) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        const uint8_t* slice_codes = codes + (int64_t)s * groups * (GROUP / 2) * SLICE;
        for (int g = 0; g < groups; ++g) {
          dequantize(tile, slice_codes + (int64_t)g * (GROUP / 2) * SLICE, scales + ((int64_t)g * n + s * SLICE) * 2);
          MEMORY_BARRIER();
          _tile_loadd(6, tile, 2 * SLICE * sizeof(uint16_t));
          _tile_loadd(3, x0 + g * GROUP, x_bytes);
          _tile_dpbf16ps(0, 3, 6);
          if (rows[1]) {
            _tile_loadd(4, x1 + g * GROUP, x_bytes);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (rows[2]) {
            _tile_loadd(5, x2 + g * GROUP, x_bytes);
            _tile_dpbf16ps(2, 5, 6);
          }
        }
        uint16_t* o = out + (int64_t)r0 * out_stride + s * SLICE;
        _tile_stored(0, acc, SLICE * sizeof(float));
        MEMORY_BARRIER();
        store_rows(o, out_stride, acc, rows[0]);
        if (rows[1]) {
          _tile_stored(1, acc, SLICE * sizeof(float));
          MEMORY_BARRIER();
          store_rows(o + TILE_ROWS * out_stride, out_stride, acc, rows[1]);
        }
        if (rows[2]) {
          _tile_stored(2, acc, SLICE * sizeof(float));
          MEMORY_BARRIER();
          store_rows(o + 2 * TILE_ROWS * out_stride, out_stride, acc, rows[2]);
        }
      }
    }
    _tile_release();
  }
}

#else  // AVX512-BF16 alone

#define ROW_BLOCK 12  // rows a pass over a slice: two accumulators a row stay in registers (4 or 8 rows: slower)
// bfloat16 128.0: with a code c (0..15) in its low mantissa bits, the bfloat16 value 128 + c, exactly
#define CODE_BASE 0x4300

const char* kvt_int4_isa(void) { return "avx512_bf16"; }

int kvt_int4_init(void) { return 0; }

// Each row's sum over each group of 32 inputs, in float32: sums[r * groups + g].
static void group_sums(float* sums, const uint16_t* x, int64_t x_stride, int m, int groups) {
  const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
  for (int r = 0; r < m; ++r)
    for (int g = 0; g < groups; ++g) {
      const __m512i v = _mm512_loadu_si512(x + r * x_stride + g * GROUP);  // 32 bfloat16
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
}

// Rows [0, ROWS) of out for one 16-output slice. A group's codes become bfloat16 (128 + code) pairs by bit
// operations alone, each pair of inputs one VDPBF16PS against the row's pair broadcast, and the group's
// (scale, offset) apply once per group: w = scale * (code - 8) + offset, so a group adds
// scale * sum(x * (128 + code)) + (offset - 136 * scale) * sum(x). The weights are used unrounded, as in
// torch's int4 kernel. ROWS is a constant at each call site, so the accumulators are registers; a few
// rows split each group's products over two chains so the adds do not wait on each other.
static inline __attribute__((always_inline)) void multiply_rows(const int rows, uint16_t* out, int64_t out_stride,
                                                                const uint16_t* x, int64_t x_stride,
                                                                const float* sums, const uint8_t* codes,
                                                                const uint16_t* scales, int n, int groups) {
  const int chains = rows < 4 ? 2 : 1;
  const __m512i base = _mm512_set1_epi32(CODE_BASE | CODE_BASE << 16);
  const __m512i nibbles = _mm512_set1_epi32(0x000f000f);
  const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
  __m512 total[ROW_BLOCK];
  for (int r = 0; r < rows; ++r) total[r] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const __m512i p = _mm512_loadu_si512(scales + (int64_t)g * n * 2);  // (scale, offset) of the 16 outputs
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), scale, _mm512_castsi512_ps(_mm512_and_si512(p, high)));
    const uint8_t* group_codes = codes + (int64_t)g * (GROUP / 2) * SLICE;
    __m512 part[2][ROW_BLOCK];
    for (int c = 0; c < chains; ++c)
      for (int r = 0; r < rows; ++r) part[c][r] = _mm512_setzero_ps();
    for (int q = 0; q < GROUP / 2; ++q) {
      // byte i = code(i, 2q) | code(i, 2q + 1) << 4  ->  lane i = bf16(128 + code(i, 2q)), bf16(128 + code(i, 2q + 1))
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(group_codes + q * SLICE)));
      const __m512i w = _mm512_ternarylogic_epi32(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), nibbles, base, 0xEA);
      for (int r = 0; r < rows; ++r) {
        int32_t pair;  // x[r][32g + 2q], x[r][32g + 2q + 1]
        memcpy(&pair, x + r * x_stride + g * GROUP + 2 * q, sizeof pair);
        part[q % chains][r] = _mm512_dpbf16_ps(part[q % chains][r], (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
    for (int r = 0; r < rows; ++r) {
      const __m512 dot = chains == 2 ? _mm512_add_ps(part[0][r], part[1][r]) : part[0][r];
      total[r] = _mm512_fmadd_ps(dot, scale, total[r]);
      total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[r * groups + g]), total[r]);
    }
  }
  for (int r = 0; r < rows; ++r)
    _mm256_storeu_si256((__m256i*)(out + r * out_stride), (__m256i)_mm512_cvtneps_pbh(total[r]));
}

// out [M, N] bfloat16 (row stride out_stride) = x [M, K] bfloat16 (row stride x_stride) times the int4
// matrix [N, K]; N a multiple of 16, K of 32.
void kvt_int4_matmul(uint16_t* out, int64_t out_stride, const uint16_t* x, int64_t x_stride,
                     const uint8_t* codes, const uint16_t* scales, int m, int n, int k_size, int num_threads) {
  const int slices = n / SLICE, groups = k_size / GROUP;
  float* sums = malloc((size_t)(m ? m : 1) * groups * sizeof(float));
  group_sums(sums, x, x_stride, m, groups);
#pragma omp parallel for schedule(static) num_threads(slices < num_threads ? slices : num_threads)
  for (int s = 0; s < slices; ++s) {
    const uint8_t* slice_codes = codes + (int64_t)s * groups * (GROUP / 2) * SLICE;
    const uint16_t* slice_scales = scales + s * SLICE * 2;
    uint16_t* o = out + s * SLICE;
    int r0 = 0;
    for (; r0 + ROW_BLOCK <= m; r0 += ROW_BLOCK)
      multiply_rows(ROW_BLOCK, o + r0 * out_stride, out_stride, x + r0 * x_stride, x_stride, sums + r0 * groups,
                    slice_codes, slice_scales, n, groups);
    switch (m - r0) {  // the last rows, with a constant count each
#define TAIL(R)                                                                                             \
  case R:                                                                                                   \
    multiply_rows(R, o + r0 * out_stride, out_stride, x + r0 * x_stride, x_stride, sums + r0 * groups,      \
                  slice_codes, slice_scales, n, groups);                                                    \
    break;
      TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#undef TAIL
      default: break;
    }
  }
  free(sums);
}

#endif
