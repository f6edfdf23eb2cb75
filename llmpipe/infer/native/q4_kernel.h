/* llmpipe's 4-bit matmul kernel: y[M, N] = x[M, K] . W[K, N], AVX2 + FMA + F16C.
 *
 * Weights are blocks of 32 along K in the form w = d * q + m, q in 0..15, d and m fp16 per block and output
 * row (HQQ's float zero points are m = -d * zero, so they need no fold; an integer zero point is the same
 * form). The activation is quantised to int8 in blocks of 32 (one scale a block, as onnxruntime's
 * MatMulNBits does at accuracy level 4) and each block's float sum kept for the m term:
 *     y[n] = sum_b (d[b,n] * sx[b] * sum_j q[j,n] xq[j]  +  m[b,n] * xs[b])
 *
 * Layout (llmpipe/infer/native.py packs it): tiles of 8 output rows; per tile per block, 128 bytes of
 * nibbles (four 32-byte loads, load i holding rows 2i and 2i+1, 16 bytes each; in a row's byte j the low
 * nibble is w[j], the high w[j + 16]), and, in separate arrays, 8 fp16 d and 8 fp16 m in the order the
 * horizontal adds leave the rows: r0 r2 r4 r6 r1 r3 r5 r7. N is a multiple of 8 and K of 32.
 *
 * 8-bit weights (q in 0..255, the same d and m) are two such nibble planes, the high one's sums shifted by 4.
 *
 * Up to 4 activation rows share each unpacked weight block (prompt and batched decode read the weights
 * once per 4 rows); u8 x s8 pairs summed by maddubs stay within int16 (2 * 15 * 127).
 */
#ifndef LLMPIPE_Q4_KERNEL_H
#define LLMPIPE_Q4_KERNEL_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define Q4_BLOCK 32
#define Q4_TILE 8
#define Q4_ROWS 4 /* activation rows per pass over a weight block */
#define Q4_AHEAD 8 /* blocks of weights prefetched ahead */

/* One activation row x[K] as int8 blocks (each block's 16 low and 16 high values twice: xq[b * 64 ...]),
 * its blocks' scales sx[K / 32] and sums xs[K / 32]. The sum is of the quantised values (sx * sum xq), not
 * of x: then y = d * sx * sum (q + m / d) xq, the rounding of x weighted by the centred weight q - zero
 * rather than by q in 0..15, which measured 3x the KL on SmolLM2-135M (docs/measurements/quantisation.md). */
static void q4_quant_row(const float *x, int K, int8_t *xq, float *sx, float *xs) {
  for (int b = 0; b < K / Q4_BLOCK; b++) {
    const float *xb = x + (size_t)b * Q4_BLOCK;
    float a = 0.f;
    for (int j = 0; j < Q4_BLOCK; j++) a = fmaxf(a, fabsf(xb[j]));
    const float sc = a / 127.f, inv = sc > 0.f ? 1.f / sc : 0.f;
    int8_t *o = xq + (size_t)b * 64;
    int s = 0;
    for (int j = 0; j < 16; j++) {
      const int8_t lo = (int8_t)lrintf(xb[j] * inv), hi = (int8_t)lrintf(xb[16 + j] * inv);
      o[j] = lo, o[16 + j] = lo, o[32 + j] = hi, o[48 + j] = hi;
      s += lo + hi;
    }
    sx[b] = sc;
    xs[b] = sc * (float)s;
  }
}

/* Tiles [t0, t1) of R (1..Q4_ROWS) activation rows: row r's quantised blocks at xq + r * xstride (bytes),
 * its scales and sums at sx / xs + r * sstride, its output at y + r * ystride. */
static inline __attribute__((always_inline)) void q4_tiles_rows(
    int K, const uint8_t *q, const uint16_t *d, const uint16_t *m, const int8_t *xq, size_t xstride,
    const float *sx, const float *xs, size_t sstride, float *y, size_t ystride, int t0, int t1, const int R,
    const int planes) {
  const int nb = K / Q4_BLOCK, bb = 128 * planes; /* nibble bytes per tile per block */
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int t = t0; t < t1; t++) {
    const uint8_t *qt = q + (size_t)t * nb * bb;
    const uint16_t *dt = d + (size_t)t * nb * 8, *mt = m + (size_t)t * nb * 8;
    __m256 acc[Q4_ROWS], accm[Q4_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), accm[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
      __m256i lo[8], hi[8];
      /* the block Q4_AHEAD blocks on, asked for now: measured 1.21x (1 thread) and 1.13x (2) on an AMD Zen 2
       * over leaving it to the hardware prefetcher (benchmarks/q4_kernel.py, distances 6 to 12 alike) */
      for (int l = 0; l < 2 * planes; l++)
        _mm_prefetch((const char *)(qt + (size_t)(b + Q4_AHEAD) * bb + 64 * l), _MM_HINT_T0);
      for (int i = 0; i < 4 * planes; i++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qt + (size_t)b * bb + i * 32));
        lo[i] = _mm256_and_si256(v, mask);
        hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + (size_t)b * 8)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + (size_t)b * 8)));
      for (int r = 0; r < R; r++) {
        const int8_t *xr = xq + r * xstride + (size_t)b * 64;
        const __m256i xl = _mm256_loadu_si256((const __m256i *)xr);
        const __m256i xh = _mm256_loadu_si256((const __m256i *)(xr + 32));
        __m256i s[4];
        for (int i = 0; i < 4; i++) {
          s[i] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[i], xl), _mm256_maddubs_epi16(hi[i], xh)),
                                   ones);
          if (planes == 2) /* an 8-bit weight: its high nibble's plane, 16 times the low's */
            s[i] = _mm256_add_epi32(s[i], _mm256_slli_epi32(_mm256_madd_epi16(_mm256_add_epi16(
                _mm256_maddubs_epi16(lo[4 + i], xl), _mm256_maddubs_epi16(hi[4 + i], xh)), ones), 4));
        }
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(dv, _mm256_set1_ps(sx[r * sstride + b])), acc[r]);
        accm[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * sstride + b]), accm[r]);
      }
    }
    for (int r = 0; r < R; r++) {
      float o[8];
      _mm256_storeu_ps(o, _mm256_add_ps(acc[r], accm[r]));
      float *yt = y + r * ystride + (size_t)t * 8;
      yt[0] = o[0], yt[2] = o[1], yt[4] = o[2], yt[6] = o[3], yt[1] = o[4], yt[3] = o[5], yt[5] = o[6], yt[7] = o[7];
    }
  }
}

/* Tiles [t0, t1) of all M rows, 4 rows a pass; the row buffers as q4_quant_row left them for each row, row r
 * at xq + r * xstride (bytes) and sx / xs + r * sstride (the first K / 32 blocks of a row are read); y is
 * [M, N]. bits 4: the layout above; bits 8: per tile per block 256 bytes, the low nibbles' 128 (laid out as a
 * 4-bit block) then the high nibbles'. */
static void q4_tiles_strided(int M, int K, int N, int bits, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                             const int8_t *xq, size_t xstride, const float *sx, const float *xs, size_t sstride,
                             float *y, int t0, int t1) {
  for (int r0 = 0; r0 < M; r0 += Q4_ROWS) {
    const int8_t *x = xq + r0 * xstride;
    const float *s = sx + r0 * sstride, *u = xs + r0 * sstride;
    float *o = y + (size_t)r0 * N;
    const int rows = M - r0 >= Q4_ROWS ? Q4_ROWS : M - r0;
#define Q4_CASE(R, P) q4_tiles_rows(K, q, d, m, x, xstride, s, u, sstride, o, N, t0, t1, R, P)
    if (bits == 8) {
      switch (rows) {
        case 4: Q4_CASE(4, 2); break;
        case 3: Q4_CASE(3, 2); break;
        case 2: Q4_CASE(2, 2); break;
        default: Q4_CASE(1, 2); break;
      }
    } else {
      switch (rows) {
        case 4: Q4_CASE(4, 1); break;
        case 3: Q4_CASE(3, 1); break;
        case 2: Q4_CASE(2, 1); break;
        default: Q4_CASE(1, 1); break;
      }
    }
#undef Q4_CASE
  }
}

/* q4_tiles_strided over rows packed back to back (row r: xq + r * K * 2, sx / xs + r * K / 32). */
static void q4_tiles(int M, int K, int N, int bits, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                     const int8_t *xq, const float *sx, const float *xs, float *y, int t0, int t1) {
  q4_tiles_strided(M, K, N, bits, q, d, m, xq, (size_t)K * 2, sx, xs, (size_t)K / Q4_BLOCK, y, t0, t1);
}

#endif
