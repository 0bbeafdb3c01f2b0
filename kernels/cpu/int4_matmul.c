// y = x W^T for a 4-bit weight matrix on AMX, for steps of a few to a few dozen rows.
//
// torch's int4 kernel dequantizes the weights again for every row of x (~2 ms a row over the bundled
// model's matrices), so past a few rows the bfloat16 copies, 4x the bytes, were faster. Here a 16-output
// slice of one 32-input group is dequantized once into an AMX tile and multiplied against up to 48 rows
// of x at a time: the matrix is read as 4 bits a weight, and a row costs its arithmetic only.
//
// Weights (`tile_codes` in cpu_int4_matmul.py): for each block of 16 outputs, each group of 32 inputs, each input pair p,
// 16 bytes: byte i holds output i's code for input 2p (low nibble) and 2p+1 (high nibble). Scales:
// torch's [K/32 groups][N outputs][2] bfloat16, (scale, offset), w = scale * (code - 8) + offset.
// A weight is dequantized in float32 and rounded to bfloat16 (nearest even), which gives exactly the
// values of the model's dense bfloat16 copy: both regimes compute with the same weights. The tile
// product accumulates in float32; the output is rounded to bfloat16.
//
// Compiled at run time for the host CPU (cpu_build.py); without AMX-BF16 the build fails and the
// torch path stays. AMX's tile registers need the process's permission, asked once (kvt_amx_init).
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "the int4 matmul kernel needs AMX-BF16 and AVX512-BF16"
#endif

#define GROUP 32       // inputs per (scale, offset): one tile's depth
#define SLICE 16       // outputs per tile column block
#define TILE_ROWS 16   // rows of x per tile
#define ROW_TILES 3    // row tiles a pass: 48 rows share each dequantized weight tile
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
// GCC's tile intrinsics are asm that name only a pointer, not the memory behind it: without this the
// compiler may drop or move the stores a tile load reads (the config, the dequantized tile) and the loads
// of what a tile store wrote.
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

// Asks Linux for the AMX tile state (once per process; granted to every thread). 0 when granted.
int kvt_amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

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

// One group's weights for 16 outputs as a tile in AMX's pair layout: row p, column i holds the bfloat16
// pair (w[i][2p], w[i][2p+1]).
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
