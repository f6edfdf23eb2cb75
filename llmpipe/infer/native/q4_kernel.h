/* llmpipe's 4-bit matmul kernel: y[M, N] = x[M, K] . W[K, N], AVX2 + FMA + F16C.
 *
 * Weights are blocks of 32 along K in the form w = d * q + m, q in 0..15, d and m fp16 per block and output
 * row (HQQ's float zero points are m = -d * zero, so they need no fold; an integer zero point is the same
 * form). The activation is quantised to int8 in blocks of 32 (one scale a block, as onnxruntime's
 * MatMulNBits does at accuracy level 4) and each block's sum kept for the m term:
 *     y[n] = sum_b (d[b,n] * sx[b] * sum_j q[j,n] xq[j]  +  m[b,n] * xs[b])
 *
 * Layout 2 (llmpipe/infer/native.py packs it): tiles of 8 output rows; per tile per block, 128 bytes of
 * nibbles, four 32-byte loads in which 32-bit lane r is output row r: in load i, lane r's byte c holds
 * w[r][8i + c] in its low nibble and w[r][8i + 4 + c] in its high. A load's nibbles times the activation's
 * 4 values broadcast to every lane (maddubs) leave each row's products in its own lane, so the block's 8
 * products sum in int16 (8 * 2 * 15 * 127 < 2^15) and one madd ends it: no horizontal adds, and 3 integer
 * multiplies in 4 fewer than layout 1's (rows in 16-byte halves, summed by a tree of hadds), which measured
 * the same at 1 thread (the memory's pace) and 1.04-1.06x at 2 threads, 1.10-1.18x on 4 rows (an AMD Zen 2,
 * the 30-layer body of SmolLM2-135M). d and m follow, 8 fp16 each per tile per block, in row order.
 *
 * 8-bit weights (q in 0..255, the same d and m) are two such nibble planes, the high one's sums times 16.
 *
 * Up to 4 activation rows share each unpacked weight block (prompt and batched decode read the weights
 * once per 4 rows).
 */
#ifndef LLMPIPE_Q4_KERNEL_H
#define LLMPIPE_Q4_KERNEL_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define Q4_BLOCK 32
#define Q4_TILE 8
#define Q4_ROWS 4 /* activation rows per pass over a weight block */
#define Q4_AHEAD 8 /* blocks of weights prefetched ahead */

/* One activation row x[K] as int8 blocks (xq[K], in order), its blocks' scales sx[K / 32] and sums xs[K / 32].
 * The sum is of the quantised values (sx * sum xq), not of x: then y = d * sx * sum (q + m / d) xq, the
 * rounding of x weighted by the centred weight q - zero rather than by q in 0..15, which measured 3x the KL
 * on SmolLM2-135M (docs/measurements/quantisation.md). */
static void q4_quant_row(const float *x, int K, int8_t *xq, float *sx, float *xs) {
  /* 8 floats a step (the scalar form: a = max |x|, sc = a / 127, xq = lrintf(x / sc), both round to nearest
   * even): each node quantises its input on one thread before its tiles split, so this is the serial part */
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int b = 0; b < K / Q4_BLOCK; b++) {
    const float *xb = x + (size_t)b * Q4_BLOCK;
    __m256 v[4], a = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i), a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[i]));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float sc = _mm_cvtss_f32(h) / 127.f, inv = sc > 0.f ? 1.f / sc : 0.f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i n[4];
    for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    /* int32 -> int8 in order: the packs interleave 128-bit lanes, the permute puts them back */
    const __m256i p16 = _mm256_packs_epi32(n[0], n[1]), q16 = _mm256_packs_epi32(n[2], n[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, q16), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(xq + (size_t)b * Q4_BLOCK), p8);
    sx[b] = sc;
    xs[b] = sc * (float)_mm_cvtsi128_si32(t);
  }
}

/* Tiles [t0, t1) of R (1..Q4_ROWS) activation rows: row r's quantised blocks at xq + r * xstride (bytes),
 * its scales and sums at sx / xs + r * sstride, its output at y + r * ystride. */
static inline __attribute__((always_inline)) void q4_tiles_rows(
    int K, const uint8_t *q, const uint16_t *d, const uint16_t *m, const int8_t *xq, size_t xstride,
    const float *sx, const float *xs, size_t sstride, float *y, size_t ystride, int t0, int t1, const int R,
    const int planes) {
  const int nb = K / Q4_BLOCK, bb = 128 * planes; /* nibble bytes per tile per block */
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  for (int t = t0; t < t1; t++) {
    const uint8_t *qt = q + (size_t)t * nb * bb;
    const uint16_t *dt = d + (size_t)t * nb * 8, *mt = m + (size_t)t * nb * 8;
    __m256 acc[Q4_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
      /* the block Q4_AHEAD blocks on, asked for now: measured 1.21x (1 thread) and 1.13x (2) on an AMD Zen 2
       * over leaving it to the hardware prefetcher (benchmarks/q4_kernel.py, distances 6 to 12 alike) */
      for (int l = 0; l < 2 * planes; l++)
        _mm_prefetch((const char *)(qt + (size_t)(b + Q4_AHEAD) * bb + 64 * l), _MM_HINT_T0);
      __m256i s[Q4_ROWS], s2[Q4_ROWS]; /* int16 sums per row lane: the low plane, the high plane */
      for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256(), s2[r] = _mm256_setzero_si256();
      for (int p = 0; p < planes; p++)
        for (int i = 0; i < 4; i++) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(qt + (size_t)b * bb + p * 128 + i * 32));
          const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
          for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + r * xstride + (size_t)b * Q4_BLOCK + 8 * i;
            int32_t x0, x1;
            memcpy(&x0, xr, 4), memcpy(&x1, xr + 4, 4);
            const __m256i u = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
            if (p == 0)
              s[r] = _mm256_add_epi16(s[r], u);
            else
              s2[r] = _mm256_add_epi16(s2[r], u);
          }
        }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + (size_t)b * 8)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + (size_t)b * 8)));
      for (int r = 0; r < R; r++) {
        __m256i h = _mm256_madd_epi16(s[r], ones);
        if (planes == 2) /* an 8-bit weight: its high nibbles' plane, 16 times the low's */
          h = _mm256_add_epi32(h, _mm256_madd_epi16(s2[r], sixteen));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(dv, _mm256_set1_ps(sx[r * sstride + b])), acc[r]);
        acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * sstride + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ystride + (size_t)t * 8, acc[r]);
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

/* Layout 1 (the graphs llmpipe wrote before layout 2: in a tile's block, load i held rows 2i and 2i + 1, 16
 * bytes each, byte j's low nibble w[j] and high w[j + 16]; d and m in the order r0 r2 r4 r6 r1 r3 r5 r7)
 * rewritten as layout 2, `planes` nibble planes of `blocks` tile-blocks, so such a graph runs as it is. */
static void q4_relayout(const uint8_t *q1, const uint16_t *d1, const uint16_t *m1, uint8_t *q2, uint16_t *d2,
                        uint16_t *m2, size_t blocks, int planes) {
  static const int slot[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* layout 1's index of row r's d and m */
  for (size_t tb = 0; tb < blocks; tb++) {
    for (int p = 0; p < planes; p++) {
      const uint8_t *src = q1 + (tb * planes + p) * 128;
      uint8_t *dst = q2 + (tb * planes + p) * 128;
      for (int r = 0; r < 8; r++)
        for (int k = 0; k < 32; k++) {
          const uint8_t byte = src[(r / 2) * 32 + (r % 2) * 16 + (k % 16)];
          const uint8_t nib = k < 16 ? byte & 0x0F : byte >> 4;
          uint8_t *o = dst + (k / 8) * 32 + r * 4 + (k % 4);
          *o = (k % 8) < 4 ? (uint8_t)((*o & 0xF0) | nib) : (uint8_t)((*o & 0x0F) | (nib << 4));
        }
    }
    for (int r = 0; r < 8; r++) d2[tb * 8 + r] = d1[tb * 8 + slot[r]], m2[tb * 8 + r] = m1[tb * 8 + slot[r]];
  }
}

/* q4_tiles_strided over rows packed back to back (row r: xq + r * K, sx / xs + r * K / 32). */
static void q4_tiles(int M, int K, int N, int bits, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                     const int8_t *xq, const float *sx, const float *xs, float *y, int t0, int t1) {
  q4_tiles_strided(M, K, N, bits, q, d, m, xq, (size_t)K, sx, xs, (size_t)K / Q4_BLOCK, y, t0, t1);
}

#endif
