/* BatchNorm followed by the exact GELU, for the conv stem's float32 channels-last activations, with AVX2 and FMA
   (CPUs without AVX-512): the input is `rows` = B·H·W rows of C contiguous floats (C a multiple of 8), one
   row a pixel. As batch_norm.c does for bfloat16, with the GELU from normal_avx2.h (gelu_f32_avx2.c's).

   PyTorch runs them as separate passes each way: BatchNorm writes its output, GELU reads it back (and keeps
   it for the backward, where it computes erfc and exp again), GELU's input gradient is written for
   BatchNorm's backward to read twice. Here, forward: the batch's per-channel statistics (two passes over
   the input, float32 sums over blocks of BLOCK rows and float64 across them), then one pass that
   normalises and writes GELU's value and its derivative. Backward, from GELU's output gradient g and
   the kept derivative d, with dy = g d and xhat = (a - mean) rstd: the sums of dy and dy xhat
   (BatchNorm's bias and weight gradients) in one pass, then da = gamma rstd (dy - mean(dy) - xhat
   mean(dy xhat)) in another. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "normal_avx2.h"
#include "subnormals.h"

enum { BLOCK = 32, MAXC = 1024 };

/* acc[j] += sums[j] widened to float64, for j < c */
static inline void add_wide(double *acc, const float *sums, int64_t c)
{
    for (int64_t j = 0; j < c; j += 8) {
        const __m256 s = _mm256_loadu_ps(sums + j);
        _mm256_storeu_pd(acc + j, _mm256_add_pd(_mm256_loadu_pd(acc + j), _mm256_cvtps_pd(_mm256_castps256_ps128(s))));
        _mm256_storeu_pd(acc + j + 4, _mm256_add_pd(_mm256_loadu_pd(acc + j + 4),
                                                    _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1))));
    }
}

/* mean[c] and var[c] (biased) of a's columns. work: threads x c doubles. */
void vs_bn_stats_f32(const float *a, int64_t rows, int64_t c, double *work, float *mean, float *var, int threads)
{
    const int64_t blocks = (rows + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = subnormals_off();
        const int nt = omp_get_num_threads();
        double *mine = work + (int64_t)omp_get_thread_num() * c;
        float sums[MAXC];
        for (int pass = 0; pass < 2; pass++) {
            for (int64_t j = 0; j < c; j++) mine[j] = 0.0;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t r1 = (b + 1) * BLOCK < rows ? (b + 1) * BLOCK : rows;
                for (int64_t j = 0; j < c; j += 8) {
                    const __m256 m = pass ? _mm256_loadu_ps(mean + j) : _mm256_setzero_ps();
                    __m256 s = _mm256_setzero_ps();
                    for (int64_t r = b * BLOCK; r < r1; r++) {
                        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(a + r * c + j), m);
                        s = pass ? _mm256_fmadd_ps(x, x, s) : _mm256_add_ps(s, x);
                    }
                    _mm256_storeu_ps(sums + j, s);
                }
                add_wide(mine, sums, c);
            }  /* implicit barrier: every thread's sums are in */
#pragma omp for schedule(static)
            for (int64_t j = 0; j < c; j++) {
                double s = 0.0;
                for (int t = 0; t < nt; t++) s += work[(int64_t)t * c + j];
                if (pass) var[j] = (float)(s / (double)rows);
                else mean[j] = (float)(s / (double)rows);
            }  /* implicit barrier: the means are in before the second pass reads them */
        }
        subnormals_restore(csr);
    }
}

/* h = gelu(a scale + shift) and d = gelu'(same), each (rows, c); d may be NULL. */
void vs_bn_gelu_f32_fwd(const float *a, int64_t rows, int64_t c, const float *scale, const float *shift, float *h,
                        float *d, int threads)
{
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = subnormals_off();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < c; j += 8) {
                const int64_t o = r * c + j;
                const __m256 y = _mm256_fmadd_ps(_mm256_loadu_ps(a + o), _mm256_loadu_ps(scale + j),
                                                 _mm256_loadu_ps(shift + j));
                __m256 hv, dv;
                gelu_and_grad8(y, &hv, &dv);
                _mm256_storeu_ps(h + o, hv);
                if (d) _mm256_storeu_ps(d + o, dv);
            }
        subnormals_restore(csr);
    }
}

/* BatchNorm's (training mode) input gradient da (rows, c), and its weight and bias gradients
   dgamma = sum dy xhat and dbeta = sum dy (c floats each), from GELU's output gradient g and derivative
   d. work: threads x 2 x c doubles. */
void vs_bn_gelu_f32_bwd(const float *g, const float *d, const float *a, int64_t rows, int64_t c, const float *mean,
                        const float *rstd, const float *gamma, double *work, float *dgamma, float *dbeta, float *da,
                        int threads)
{
    const int64_t blocks = (rows + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = subnormals_off();
        const int nt = omp_get_num_threads();
        double *mine = work + (int64_t)omp_get_thread_num() * 2 * c;
        float sums[2 * MAXC];
        for (int64_t j = 0; j < 2 * c; j++) mine[j] = 0.0;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r1 = (b + 1) * BLOCK < rows ? (b + 1) * BLOCK : rows;
            for (int64_t j = 0; j < c; j += 8) {
                const __m256 m = _mm256_loadu_ps(mean + j), rs = _mm256_loadu_ps(rstd + j);
                __m256 sdy = _mm256_setzero_ps(), sdx = _mm256_setzero_ps();
                for (int64_t r = b * BLOCK; r < r1; r++) {
                    const int64_t o = r * c + j;
                    const __m256 dy = _mm256_mul_ps(_mm256_loadu_ps(g + o), _mm256_loadu_ps(d + o));
                    const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(a + o), m), rs);
                    sdy = _mm256_add_ps(sdy, dy);
                    sdx = _mm256_fmadd_ps(dy, xh, sdx);
                }
                _mm256_storeu_ps(sums + j, sdy);
                _mm256_storeu_ps(sums + c + j, sdx);
            }
            add_wide(mine, sums, c);
            add_wide(mine + c, sums + c, c);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < c; j++) {
            double sdy = 0.0, sdx = 0.0;
            for (int t = 0; t < nt; t++) {
                sdy += work[(int64_t)t * 2 * c + j];
                sdx += work[(int64_t)t * 2 * c + c + j];
            }
            dbeta[j] = (float)sdy;
            dgamma[j] = (float)sdx;
        }
        const __m256 inv_rows = _mm256_set1_ps((float)(1.0 / (double)rows));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t j = 0; j < c; j += 8) {
                const int64_t o = r * c + j;
                const __m256 rs = _mm256_loadu_ps(rstd + j);
                const __m256 k1 = _mm256_mul_ps(_mm256_loadu_ps(dbeta + j), inv_rows);
                const __m256 k2 = _mm256_mul_ps(_mm256_loadu_ps(dgamma + j), inv_rows);
                const __m256 dy = _mm256_mul_ps(_mm256_loadu_ps(g + o), _mm256_loadu_ps(d + o));
                const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(a + o), _mm256_loadu_ps(mean + j)), rs);
                const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(gamma + j), rs),
                                               _mm256_sub_ps(_mm256_sub_ps(dy, k1), _mm256_mul_ps(xh, k2)));
                _mm256_storeu_ps(da + o, v);
            }
        }
        subnormals_restore(csr);
    }
}
