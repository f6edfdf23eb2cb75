/* A 4-bit GEMV for batch-1 decode, AVX2 + FMA + F16C, written for benchmarks/q4_kernel.py.
 *
 * Weights are q4_1-shaped blocks of 32 along K: w = d * q + m, q in 0..15, d and m fp16 (the form HQQ's
 * float zero points take: m = -d * zero). The activation is quantised to int8 in blocks of 32 (one scale a
 * block, as onnxruntime's MatMulNBits does at accuracy level 4) and each block's float sum kept for the m
 * term. Layout, tiles of 8 output rows, per tile per block: 128 bytes of nibbles (four 32-byte loads, load i
 * holding rows 2i and 2i+1, 16 bytes each; in a row's byte j the low nibble is w[j], the high w[j + 16]),
 * then, in separate arrays, 8 fp16 d and 8 fp16 m in the order the horizontal adds leave the rows:
 * r0 r2 r4 r6 r1 r3 r5 r7. N must be a multiple of 8 and K of 32.
 *
 * Not an onnxruntime kernel yet: this measures what such a kernel would stream against MLAS on the same
 * weights (benchmarks/q4_kernel.py), before the work of wiring one in as a custom op.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static void quant_x(const float *x, int K, int8_t *xq, float *sx, float *xs) {
  for (int b = 0; b < K / 32; b++) {
    float a = 0.f, s = 0.f;
    for (int j = 0; j < 32; j++) {
      a = fmaxf(a, fabsf(x[b * 32 + j]));
      s += x[b * 32 + j];
    }
    const float sc = a / 127.f, inv = sc > 0.f ? 1.f / sc : 0.f;
    sx[b] = sc;
    xs[b] = s;
    for (int j = 0; j < 16; j++) {
      const int8_t lo = (int8_t)lrintf(x[b * 32 + j] * inv), hi = (int8_t)lrintf(x[b * 32 + 16 + j] * inv);
      xq[b * 64 + j] = lo;
      xq[b * 64 + 16 + j] = lo;
      xq[b * 64 + 32 + j] = hi;
      xq[b * 64 + 48 + j] = hi;
    }
  }
}

static void gemv_tiles(int K, const uint8_t *q, const uint16_t *d, const uint16_t *m, const int8_t *xq,
                       const float *sx, const float *xs, float *y, int t0, int t1) {
  const int nb = K / 32;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int t = t0; t < t1; t++) {
    const uint8_t *qt = q + (size_t)t * nb * 128;
    const uint16_t *dt = d + (size_t)t * nb * 8, *mt = m + (size_t)t * nb * 8;
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
      const __m256i xl = _mm256_loadu_si256((const __m256i *)(xq + b * 64));
      const __m256i xh = _mm256_loadu_si256((const __m256i *)(xq + b * 64 + 32));
      __m256i s[4];
      for (int i = 0; i < 4; i++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qt + b * 128 + i * 32));
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
        s[i] = _mm256_madd_epi16(p, ones);
      }
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + b * 8)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + b * 8)));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(dv, _mm256_set1_ps(sx[b])), acc);
      accm = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[b]), accm);
    }
    float o[8];
    _mm256_storeu_ps(o, _mm256_add_ps(acc, accm));
    float *yt = y + (size_t)t * 8;
    yt[0] = o[0], yt[2] = o[1], yt[4] = o[2], yt[6] = o[3], yt[1] = o[4], yt[3] = o[5], yt[5] = o[6], yt[7] = o[7];
  }
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* Runs every matrix once per rep (as one decode step runs each projection once), `threads` OpenMP threads
 * splitting each matrix's tiles; writes each matrix's y and returns the fastest rep's seconds. */
double q4_run(int nmat, const int *N, const int *K, const uint8_t **q, const uint16_t **d, const uint16_t **m,
              const float **x, float **y, int reps, int threads) {
  int kmax = 0;
  for (int i = 0; i < nmat; i++) kmax = K[i] > kmax ? K[i] : kmax;
  int8_t *xq = aligned_alloc(64, (size_t)kmax * 2 + 64);
  float *sx = malloc(sizeof(float) * (kmax / 32 + 1)), *xs = malloc(sizeof(float) * (kmax / 32 + 1));
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    const double t0 = now();
    for (int i = 0; i < nmat; i++) {
      quant_x(x[i], K[i], xq, sx, xs);
      const int tiles = N[i] / 8;
#pragma omp parallel num_threads(threads)
      {
#ifdef _OPENMP
        const int id = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int id = 0, nt = 1;
#endif
        const int a = tiles * id / nt, b = tiles * (id + 1) / nt;
        gemv_tiles(K[i], q[i], d[i], m[i], xq, sx, xs, y[i], a, b);
      }
    }
    const double dt = now() - t0;
    best = dt < best ? dt : best;
  }
  free(xq), free(sx), free(xs);
  return best;
}
