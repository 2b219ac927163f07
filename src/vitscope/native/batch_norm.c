/* BatchNorm followed by the exact GELU, for the conv stem's bfloat16 channels-last activations: the
   input is `rows` = B·H·W rows of C contiguous bfloat16 values (C a multiple of 16), one row a pixel.

   PyTorch runs them as three passes each way under bfloat16 autocast: BatchNorm writes its bfloat16
   output, GELU reads it back, and in the backward GELU's gradient is written for BatchNorm's backward
   to read twice. Here, forward: the batch's per-channel statistics (two passes over the input, the
   sums in float32 over 64-row blocks and float64 across them), then one pass that normalises, rounds
   to bfloat16 as BatchNorm's output would be, and looks GELU and its derivative up in gelu.c's table.
   Backward, from GELU's output gradient g and the kept derivative d, with dy = g d and
   xhat = (a - mean) rstd: the sums of dy and dy xhat (BatchNorm's bias and weight gradients) in one
   pass, then da = gamma rstd (dy - mean(dy) - xhat mean(dy xhat)) in another; dy stays in float32
   (PyTorch rounds it to bfloat16 between the two ops). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

extern uint32_t vs_gelu_table[65536];

enum { BLOCK = 64, MAXC = 1024 };

static inline __m512 load_bf16(const uint16_t *p) { return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)p)); }

/* acc[j] += the block's float32 sums, widened to float64 */
static inline void add_wide(double *acc, const float *sums, int64_t c)
{
    for (int64_t j = 0; j < c; j += 16) {
        const __m512 s = _mm512_loadu_ps(sums + j);
        _mm512_storeu_pd(acc + j, _mm512_add_pd(_mm512_loadu_pd(acc + j), _mm512_cvtps_pd(_mm512_castps512_ps256(s))));
        _mm512_storeu_pd(acc + j + 8, _mm512_add_pd(_mm512_loadu_pd(acc + j + 8),
                                                    _mm512_cvtps_pd(_mm512_extractf32x8_ps(s, 1))));
    }
}

/* mean[c] and var[c] (biased) of a's columns. work: threads x c doubles. */
void vs_bn_stats(const uint16_t *a, int64_t rows, int64_t c, double *work, float *mean, float *var, int threads)
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
                for (int64_t j = 0; j < c; j += 16) {
                    const __m512 m = pass ? _mm512_loadu_ps(mean + j) : _mm512_setzero_ps();
                    __m512 s = _mm512_setzero_ps();
                    for (int64_t r = b * BLOCK; r < r1; r++) {
                        const __m512 x = _mm512_sub_ps(load_bf16(a + r * c + j), m);
                        s = pass ? _mm512_fmadd_ps(x, x, s) : _mm512_add_ps(s, x);
                    }
                    _mm512_storeu_ps(sums + j, s);
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

/* h = gelu(round(a scale + shift)) and d = gelu'(same), each (rows, c) bfloat16; d may be NULL. Blocks of
   rows (MAXC values) are normalised into a buffer first, then looked up in one flat loop: lookups
   straight after each 16-value vector store waited on it (2.9x slower), and a loop per 32-wide row
   cost as much again. */
void vs_bn_gelu_fwd(const uint16_t *a, int64_t rows, int64_t c, const float *scale, const float *shift, uint16_t *h,
                    uint16_t *d, int threads)
{
    const int64_t per = MAXC / c, blocks = (rows + per - 1) / per;
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = subnormals_off();
        uint16_t y[MAXC];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = b * per, n = ((r0 + per < rows ? r0 + per : rows) - r0) * c;
            const uint16_t *ab = a + r0 * c;
            for (int64_t o = 0; o < n; o += c)
                for (int64_t j = 0; j < c; j += 16) {
                    const __m512 v = _mm512_fmadd_ps(load_bf16(ab + o + j), _mm512_loadu_ps(scale + j), _mm512_loadu_ps(shift + j));
                    _mm256_storeu_si256((__m256i *)(y + o + j), (__m256i)_mm512_cvtneps_pbh(v));
                }
            uint16_t *hb = h + r0 * c;
            if (d) {
                uint16_t *db = d + r0 * c;
                for (int64_t i = 0; i < n; i++) {
                    const uint32_t t = vs_gelu_table[y[i]];
                    hb[i] = (uint16_t)t;
                    db[i] = (uint16_t)(t >> 16);
                }
            } else {
                for (int64_t i = 0; i < n; i++) hb[i] = (uint16_t)vs_gelu_table[y[i]];
            }
        }
        subnormals_restore(csr);
    }
}

/* BatchNorm's (training mode) input gradient da (rows, c) bfloat16, and its weight and bias gradients
   dgamma = sum dy xhat and dbeta = sum dy (c floats each), from GELU's output gradient g and derivative
   d. work: threads x 2 x c doubles. */
void vs_bn_gelu_bwd(const uint16_t *g, const uint16_t *d, const uint16_t *a, int64_t rows, int64_t c, const float *mean,
                    const float *rstd, const float *gamma, double *work, float *dgamma, float *dbeta, uint16_t *da,
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
            for (int64_t j = 0; j < c; j += 16) {
                const __m512 m = _mm512_loadu_ps(mean + j), rs = _mm512_loadu_ps(rstd + j);
                __m512 sdy = _mm512_setzero_ps(), sdx = _mm512_setzero_ps();
                for (int64_t r = b * BLOCK; r < r1; r++) {
                    const int64_t o = r * c + j;
                    const __m512 dy = _mm512_mul_ps(load_bf16(g + o), load_bf16(d + o));
                    const __m512 xh = _mm512_mul_ps(_mm512_sub_ps(load_bf16(a + o), m), rs);
                    sdy = _mm512_add_ps(sdy, dy);
                    sdx = _mm512_fmadd_ps(dy, xh, sdx);
                }
                _mm512_storeu_ps(sums + j, sdy);
                _mm512_storeu_ps(sums + c + j, sdx);
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
        const __m512 inv_rows = _mm512_set1_ps((float)(1.0 / (double)rows));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t j = 0; j < c; j += 16) {
                const int64_t o = r * c + j;
                const __m512 rs = _mm512_loadu_ps(rstd + j);
                const __m512 k1 = _mm512_mul_ps(_mm512_loadu_ps(dbeta + j), inv_rows);
                const __m512 k2 = _mm512_mul_ps(_mm512_loadu_ps(dgamma + j), inv_rows);
                const __m512 dy = _mm512_mul_ps(load_bf16(g + o), load_bf16(d + o));
                const __m512 xh = _mm512_mul_ps(_mm512_sub_ps(load_bf16(a + o), _mm512_loadu_ps(mean + j)), rs);
                const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(gamma + j), rs),
                                               _mm512_sub_ps(_mm512_sub_ps(dy, k1), _mm512_mul_ps(xh, k2)));
                _mm256_storeu_si256((__m256i *)(da + o), (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
        subnormals_restore(csr);
    }
}
