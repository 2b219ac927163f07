/* The end of a weight-gradient kernel whose threads each summed into their own copy (linear_f32_avx2.c,
   conv_weight_grad_f32_avx2.c): the first thread's sums are in dw, the others' in work, n floats apart. */
#ifndef VS_THREAD_SUMS_AVX2_H
#define VS_THREAD_SUMS_AVX2_H

#include <immintrin.h>
#include <stdint.h>

/* dw[e] += the other nt - 1 threads' sums, for e < n (a multiple of 8). Called by every thread of the
   parallel region after a barrier: the threads share the values (an orphaned `omp for`). */
static inline void add_thread_sums(float *dw, const float *work, int64_t n, int nt)
{
#pragma omp for schedule(static)
    for (int64_t e = 0; e < n; e += 8) {
        __m256 s = _mm256_loadu_ps(dw + e);
        for (int u = 1; u < nt; u++) s = _mm256_add_ps(s, _mm256_loadu_ps(work + (int64_t)(u - 1) * n + e));
        _mm256_storeu_ps(dw + e, s);
    }
}

#endif
