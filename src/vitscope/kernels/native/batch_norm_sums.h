/* BatchNorm's sums over `rows` channels-last rows of c values, shared by batch_norm.c (bfloat16, AVX-512) and
   batch_norm_f32_avx2.c (float32, AVX2): the batch statistics of the forward, and the backward's two sums
   with its input gradient. Each thread sums blocks of BLOCK rows in float32 vectors, widens each block's sums
   into its own float64 row of `work`, and the threads' rows are added in float64 at the end.

   The file including this defines first: elem_t (the activations' type), vec_t (VW floats), BLOCK and MAXC
   (the widest c), the vector ops v_load / v_store (floats), v_in (VW elements read as floats), v_out (VW
   floats written as elements), v_zero, v_set1, v_add, v_sub, v_mul, v_fmadd, add_wide (acc[j] += sums[j] in
   float64, j < c), and the two functions' names BN_STATS and BN_GELU_BWD. */
#ifndef VS_BATCH_NORM_SUMS_H
#define VS_BATCH_NORM_SUMS_H

#include <omp.h>
#include <stdint.h>

#include "subnormals.h"

/* mean[c] and var[c] (biased) of a's columns: the mean's pass, then the squared deviations' from it.
   work: threads x c doubles. */
void BN_STATS(const elem_t *a, int64_t rows, int64_t c, double *work, float *mean, float *var, int threads)
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
                for (int64_t j = 0; j < c; j += VW) {
                    const vec_t m = pass ? v_load(mean + j) : v_zero();
                    vec_t s = v_zero();
                    for (int64_t r = b * BLOCK; r < r1; r++) {
                        const vec_t x = v_sub(v_in(a + r * c + j), m);
                        s = pass ? v_fmadd(x, x, s) : v_add(s, x);
                    }
                    v_store(sums + j, s);
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

/* BatchNorm's (training mode) input gradient da (rows, c), and its weight and bias gradients
   dgamma = sum dy xhat and dbeta = sum dy (c floats each), from GELU's output gradient g and derivative d:
   dy = g d and xhat = (a - mean) rstd, da = gamma rstd (dy - mean(dy) - xhat mean(dy xhat)).
   work: threads x 2 x c doubles. */
void BN_GELU_BWD(const elem_t *g, const elem_t *d, const elem_t *a, int64_t rows, int64_t c, const float *mean,
                 const float *rstd, const float *gamma, double *work, float *dgamma, float *dbeta, elem_t *da,
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
            for (int64_t j = 0; j < c; j += VW) {
                const vec_t m = v_load(mean + j), rs = v_load(rstd + j);
                vec_t sdy = v_zero(), sdx = v_zero();
                for (int64_t r = b * BLOCK; r < r1; r++) {
                    const int64_t o = r * c + j;
                    const vec_t dy = v_mul(v_in(g + o), v_in(d + o));
                    const vec_t xh = v_mul(v_sub(v_in(a + o), m), rs);
                    sdy = v_add(sdy, dy);
                    sdx = v_fmadd(dy, xh, sdx);
                }
                v_store(sums + j, sdy);
                v_store(sums + c + j, sdx);
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
        const vec_t inv_rows = v_set1((float)(1.0 / (double)rows));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t j = 0; j < c; j += VW) {
                const int64_t o = r * c + j;
                const vec_t rs = v_load(rstd + j);
                const vec_t k1 = v_mul(v_load(dbeta + j), inv_rows);
                const vec_t k2 = v_mul(v_load(dgamma + j), inv_rows);
                const vec_t dy = v_mul(v_in(g + o), v_in(d + o));
                const vec_t xh = v_mul(v_sub(v_in(a + o), v_load(mean + j)), rs);
                v_out(da + o, v_mul(v_mul(v_load(gamma + j), rs), v_sub(v_sub(dy, k1), v_mul(xh, k2))));
            }
        }
        subnormals_restore(csr);
    }
}

#endif
