/* The exact (erf) GELU and its derivative in one pass, bfloat16, for training.

   h = a Phi(a) and d = Phi(a) + a phi(a), where Phi and phi are the standard normal's distribution and
   density. The backward then needs only d: the gradient of a is the gradient of h times d, which
   oneDNN's matmul applies in its epilogue (vitscope/fused_mlp.py), so neither a second pass over the
   hidden activation nor the pre-activation itself is kept. erf comes from Abramowitz and Stegun's
   7.1.26 (absolute error below 1.5e-7), whose exp(-a^2 / 2) is also phi's, so one exp serves both. */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

static inline void gelu16(const uint16_t *a, uint16_t *h, uint16_t *d, __mmask16 m)
{
    const __m512 x = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, a));
    const __m512 ax = _mm512_abs_ps(x);
    /* t = 1 / (1 + p |x| / sqrt 2): a reciprocal estimate and one Newton step */
    const __m512 y = _mm512_fmadd_ps(ax, _mm512_set1_ps(0.3275911f * 0.70710678118654752f), _mm512_set1_ps(1.0f));
    __m512 t = _mm512_rcp14_ps(y);
    t = _mm512_mul_ps(t, _mm512_fnmadd_ps(y, t, _mm512_set1_ps(2.0f)));
    __m512 poly = _mm512_set1_ps(1.061405429f);
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-1.453152027f));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(1.421413741f));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-0.284496736f));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(0.254829592f));
    poly = _mm512_mul_ps(poly, t);
    /* e = exp(-x^2 / 2) */
    const __m512 e = exp2_ps(_mm512_mul_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(-0.72134752044448170f)));
    /* Phi = 1 - q for x >= 0, q for x < 0, with q = (1 - erf(|x| / sqrt 2)) / 2 = poly e / 2 */
    const __m512 q = _mm512_mul_ps(_mm512_mul_ps(poly, e), _mm512_set1_ps(0.5f));
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 phi_cdf = _mm512_mask_mov_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), q), neg, q);
    const __m512 hv = _mm512_mul_ps(x, phi_cdf);
    const __m512 dv = _mm512_fmadd_ps(_mm512_mul_ps(x, e), _mm512_set1_ps(0.39894228040143268f), phi_cdf);
    _mm256_mask_storeu_epi16(h, m, (__m256i)_mm512_cvtneps_pbh(hv));
    _mm256_mask_storeu_epi16(d, m, (__m256i)_mm512_cvtneps_pbh(dv));
}

/* h = gelu(a), d = gelu'(a) for n bfloat16 values, on `threads` OpenMP threads. */
void vs_gelu_fwd(const uint16_t *a, uint16_t *h, uint16_t *d, int64_t n, int threads)
{
    const int64_t chunk = 4096, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = subnormals_off();
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
            int64_t i = c * chunk;
            for (; i + 16 <= end; i += 16) gelu16(a + i, h + i, d + i, (__mmask16)0xffff);
            if (i < end) gelu16(a + i, h + i, d + i, (__mmask16)((1u << (end - i)) - 1u));
        }
        subnormals_restore(csr);
    }
}
