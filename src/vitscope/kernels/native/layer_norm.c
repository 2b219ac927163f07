/* LayerNorm over the last dim for bfloat16-autocast training and inference: float32 or bfloat16 in,
   bfloat16 out.

   Under autocast, PyTorch runs LayerNorm in float32 and writes a float32 output, which the next linear
   layer then reads again to cast to bfloat16; its backward likewise casts the bfloat16 gradient up
   first. These kernels compute in float32 as PyTorch does and round the output once to bfloat16 in
   the same pass, and the backward reads the bfloat16 gradient directly. Rows are contiguous, C wide.

   Forward: y = (x - mean) * rstd * gamma + beta, with rstd = 1 / sqrt(var + eps) (biased variance);
   mean and rstd are kept for the backward. Backward, with xhat = (x - mean) * rstd and dxhat = dy gamma:
   dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)); dgamma = sum over rows of dy xhat, dbeta =
   sum of dy, each thread summing its rows into its own slice of `partial` (threads x 2 x C).

   A bfloat16 stream (a model whose residual stream autocast leaves in bfloat16) takes the _bf16
   entry points: the same arithmetic in float32, x read as bfloat16 and dx written as bfloat16, where
   PyTorch's bfloat16 LayerNorm computes in float32 and rounds its results too. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

static inline __mmask16 tail(int64_t c, int64_t j) { return c - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (c - j)) - 1u); }

static inline __m512 load_bf16(const uint16_t *p, __mmask16 m)
{
    return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, p));
}

/* x[i .. i + 16) under mask k, x float32 or (bf) bfloat16 */
static inline __attribute__((always_inline)) __m512 load_x(const void *x, int bf, int64_t i, __mmask16 k)
{
    return bf ? load_bf16((const uint16_t *)x + i, k) : _mm512_maskz_loadu_ps(k, (const float *)x + i);
}

static inline __attribute__((always_inline)) void store_x(void *x, int bf, int64_t i, __mmask16 k, __m512 v)
{
    if (bf)
        _mm256_mask_storeu_epi16((uint16_t *)x + i, k, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float *)x + i, k, v);
}

/* With `branch` (bfloat16), the row is first x + branch, written to `sum` (float32) and normalised from
   there while it is in cache; mean and rstd may be NULL (inference). */
static inline __attribute__((always_inline)) void ln_fwd(const void *x, int bf, const uint16_t *branch, float *sum,
                                                        const float *gamma, const float *beta,
                                                        uint16_t *y, float *mean, float *rstd, int64_t rows, int64_t c,
                                                        float eps, int threads)
{
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = subnormals_off();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t xr = r * c;
            const void *src = x;  /* the row LayerNorm reads: x, or the sum just written */
            int sbf = bf;
            __m512 s = _mm512_setzero_ps();
            if (branch) {
                for (int64_t j = 0; j < c; j += 16) {
                    const __mmask16 k = tail(c, j);
                    const __m512 v = _mm512_add_ps(load_x(x, bf, xr + j, k), load_bf16(branch + xr + j, k));
                    _mm512_mask_storeu_ps(sum + xr + j, k, v);
                    s = _mm512_add_ps(s, v);
                }
                src = sum, sbf = 0;
            } else
                for (int64_t j = 0; j < c; j += 16) s = _mm512_add_ps(s, load_x(x, bf, xr + j, tail(c, j)));
            const float mu = _mm512_reduce_add_ps(s) / (float)c;
            const __m512 m = _mm512_set1_ps(mu);
            __m512 v = _mm512_setzero_ps();
            for (int64_t j = 0; j < c; j += 16) {
                __mmask16 k = tail(c, j);
                __m512 dlt = _mm512_maskz_sub_ps(k, load_x(src, sbf, xr + j, k), m);
                v = _mm512_fmadd_ps(dlt, dlt, v);
            }
            const float rs = 1.0f / sqrtf(_mm512_reduce_add_ps(v) / (float)c + eps);
            if (mean) mean[r] = mu, rstd[r] = rs;
            const __m512 rv = _mm512_set1_ps(rs);
            for (int64_t j = 0; j < c; j += 16) {
                __mmask16 k = tail(c, j);
                __m512 xh = _mm512_mul_ps(_mm512_sub_ps(load_x(src, sbf, xr + j, k), m), rv);
                __m512 out = _mm512_fmadd_ps(xh, _mm512_maskz_loadu_ps(k, gamma + j), _mm512_maskz_loadu_ps(k, beta + j));
                _mm256_mask_storeu_epi16(y + r * c + j, k, (__m256i)_mm512_cvtneps_pbh(out));
            }
        }
        subnormals_restore(csr);
    }
}

/* With `dsum` (float32, x float32), dx is that gradient plus LayerNorm's: the backward of ln_fwd with a
   branch, whose sum also reached the rest of the model. With `dx_bf16`, dx is also written there rounded
   to bfloat16 (the branch's gradient), from the same registers. */
static inline __attribute__((always_inline)) void ln_bwd(const uint16_t *dy, const void *x, int bf, const float *gamma,
                                                        const float *mean, const float *rstd, const float *dsum, void *dx,
                                                        uint16_t *dx_bf16, float *partial, int64_t rows, int64_t c,
                                                        int threads)
{
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = subnormals_off();
        const int t = omp_get_thread_num();
        float *dg = partial + (int64_t)t * 2 * c, *db = dg + c;
        for (int64_t j = 0; j < c; j++) dg[j] = db[j] = 0.0f;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t xr = r * c;
            const uint16_t *gr = dy + r * c;
            const __m512 m = _mm512_set1_ps(mean[r]), rv = _mm512_set1_ps(rstd[r]);
            __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
            for (int64_t j = 0; j < c; j += 16) {
                __mmask16 k = tail(c, j);
                __m512 g = load_bf16(gr + j, k);
                __m512 xh = _mm512_maskz_mul_ps(k, _mm512_sub_ps(load_x(x, bf, xr + j, k), m), rv);
                __m512 dxh = _mm512_mul_ps(g, _mm512_maskz_loadu_ps(k, gamma + j));
                a = _mm512_add_ps(a, dxh);
                b = _mm512_fmadd_ps(dxh, xh, b);
                _mm512_mask_storeu_ps(dg + j, k, _mm512_fmadd_ps(g, xh, _mm512_maskz_loadu_ps(k, dg + j)));
                _mm512_mask_storeu_ps(db + j, k, _mm512_add_ps(g, _mm512_maskz_loadu_ps(k, db + j)));
            }
            const __m512 ma = _mm512_set1_ps(_mm512_reduce_add_ps(a) / (float)c);
            const __m512 mb = _mm512_set1_ps(_mm512_reduce_add_ps(b) / (float)c);
            for (int64_t j = 0; j < c; j += 16) {
                __mmask16 k = tail(c, j);
                __m512 g = load_bf16(gr + j, k);
                __m512 xh = _mm512_mul_ps(_mm512_sub_ps(load_x(x, bf, xr + j, k), m), rv);
                __m512 dxh = _mm512_mul_ps(g, _mm512_maskz_loadu_ps(k, gamma + j));
                __m512 out = _mm512_mul_ps(rv, _mm512_sub_ps(_mm512_sub_ps(dxh, ma), _mm512_mul_ps(xh, mb)));
                if (dsum) out = _mm512_add_ps(_mm512_maskz_loadu_ps(k, dsum + xr + j), out);
                store_x(dx, bf, xr + j, k, out);
                if (dx_bf16) store_x(dx_bf16, 1, xr + j, k, out);
            }
        }
        subnormals_restore(csr);
    }
}

void vs_layer_norm_fwd(const float *x, const float *gamma, const float *beta, uint16_t *y, float *mean, float *rstd,
                       int64_t rows, int64_t c, float eps, int threads)
{
    ln_fwd(x, 0, NULL, NULL, gamma, beta, y, mean, rstd, rows, c, eps, threads);
}

void vs_layer_norm_bf16_fwd(const uint16_t *x, const float *gamma, const float *beta, uint16_t *y, float *mean,
                            float *rstd, int64_t rows, int64_t c, float eps, int threads)
{
    ln_fwd(x, 1, NULL, NULL, gamma, beta, y, mean, rstd, rows, c, eps, threads);
}

void vs_layer_norm_bwd(const uint16_t *dy, const float *x, const float *gamma, const float *mean, const float *rstd,
                       float *dx, float *partial, int64_t rows, int64_t c, int threads)
{
    ln_bwd(dy, x, 0, gamma, mean, rstd, NULL, dx, NULL, partial, rows, c, threads);
}

void vs_layer_norm_bf16_bwd(const uint16_t *dy, const uint16_t *x, const float *gamma, const float *mean,
                            const float *rstd, uint16_t *dx, float *partial, int64_t rows, int64_t c, int threads)
{
    ln_bwd(dy, x, 1, gamma, mean, rstd, NULL, dx, NULL, partial, rows, c, threads);
}

/* sum = x + branch (float32 + bfloat16, as vs_add_bf16) and y = LayerNorm(sum) in bfloat16, in one pass over
   the rows: the residual add and the LayerNorm after it. mean and rstd: NULL in inference. */
void vs_add_layer_norm_fwd(const float *x, const uint16_t *branch, float *sum, const float *gamma, const float *beta,
                           uint16_t *y, float *mean, float *rstd, int64_t rows, int64_t c, float eps, int threads)
{
    ln_fwd(x, 0, branch, sum, gamma, beta, y, mean, rstd, rows, c, eps, threads);
}

/* Its backward: dx = dsum + LayerNorm's input gradient from dy, and the branch's gradient, the same values
   rounded to bfloat16 (as add's backward casts them), into dx_bf16 in the same pass. */
void vs_add_layer_norm_bwd(const uint16_t *dy, const float *sum, const float *gamma, const float *mean,
                           const float *rstd, const float *dsum, float *dx, uint16_t *dx_bf16, float *partial,
                           int64_t rows, int64_t c, int threads)
{
    ln_bwd(dy, sum, 0, gamma, mean, rstd, dsum, dx, dx_bf16, partial, rows, c, threads);
}
