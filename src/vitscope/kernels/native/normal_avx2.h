/* The normal distribution and density in float32 with AVX2 and FMA, for the exact GELU (gelu_f32_avx2.c, whose
   comment says how and how accurately) and the linear kernel's GELU epilogue (linear_f32_avx2.c). */
#ifndef VS_NORMAL_AVX2_H
#define VS_NORMAL_AVX2_H

#include <immintrin.h>

#include "simd_avx2.h"

/* Phi(x) and phi(x), the normal distribution and density at x. */
static inline __attribute__((always_inline)) void normal(__m256 x, __m256 *Phi, __m256 *phi)
{
    static const float c[] = {0.05817912518978119f, -0.32572606205940247f, 0.6487326622009277f,
                              -0.5903366208076477f, 0.5282664895057678f, -0.06588925421237946f,
                              0.2117495834827423f, 0.16428178548812866f, 0.18597348034381866f,
                              0.18476882576942444f};
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(0.70710678118654752f));
    const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(z, _mm256_set1_ps(0.3275911f), one));
    __m256 p = _mm256_set1_ps(c[0]);
    for (int i = 1; i < 10; i++) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(c[i]));
    /* exp(-z^2), zero past z = 9 */
    __m256 e = exp2_ps8(_mm256_mul_ps(_mm256_mul_ps(z, z), _mm256_set1_ps(-1.4426950408889634f)));
    e = _mm256_and_ps(e, _mm256_cmp_ps(z, _mm256_set1_ps(9.0f), _CMP_LE_OQ));
    const __m256 half_erfc = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), t), _mm256_mul_ps(p, e));
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    *Phi = _mm256_blendv_ps(_mm256_sub_ps(one, half_erfc), half_erfc, neg);
    *phi = _mm256_mul_ps(e, _mm256_set1_ps(0.3989422804014327f));  /* exp(-x^2 / 2) / sqrt(2 pi) */
}

/* GELU's value x Phi(x) and derivative Phi(x) + x phi(x) at x. */
static inline __attribute__((always_inline)) void gelu_and_grad8(__m256 x, __m256 *h, __m256 *d)
{
    __m256 Phi, phi;
    normal(x, &Phi, &phi);
    *h = _mm256_mul_ps(x, Phi);
    *d = _mm256_fmadd_ps(x, phi, Phi);
}

#endif
