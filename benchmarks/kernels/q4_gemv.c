/* benchmarks/q4_kernel.py's harness around llmpipe's 4-bit kernel (llmpipe/infer/native/q4_kernel.h, the one
 * the custom op llmpipe.Q4Gemv runs): the kernel alone, looping over a decode step's matrices in C with OpenMP
 * threads splitting each matrix's tiles, so the benchmark can tell the kernel's own speed from the op's
 * dispatch inside onnxruntime.
 */
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "q4_kernel.h"

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
  int8_t *xq = aligned_alloc(64, (size_t)kmax + 64);
  float *sx = malloc(sizeof(float) * (kmax / 32 + 1)), *xs = malloc(sizeof(float) * (kmax / 32 + 1));
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    const double t0 = now();
    for (int i = 0; i < nmat; i++) {
      q4_quant_row(x[i], K[i], xq, sx, xs);
      const int tiles = N[i] / 8;
#pragma omp parallel num_threads(threads)
      {
#ifdef _OPENMP
        const int id = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int id = 0, nt = 1;
#endif
        q4_tiles(1, K[i], N[i], 4, q[i], d[i], m[i], xq, sx, xs, y[i], tiles * id / nt, tiles * (id + 1) / nt);
      }
    }
    const double dt = now() - t0;
    best = dt < best ? dt : best;
  }
  free(xq), free(sx), free(xs);
  return best;
}
