/* Vector maths for vitscope's AVX2 kernels (8 floats a vector, FMA): simd.h's functions without AVX-512's
   scalef, getexp, getmant and mask registers. */
#ifndef VS_SIMD_AVX2_H
#define VS_SIMD_AVX2_H

#include <immintrin.h>

/* 2^x for x <= 0, as simd.h's exp2_ps (the same degree-6 polynomial, within 2.4 float32 ulps): 2^n p(f) with
   n = round(x), f = x - n, 2^n built in the exponent bits. Below -125 it returns about 2^-125, never a
   subnormal; callers zero the lanes that must be exactly 0. */
static inline __m256 exp2_ps8(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5353362e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* log2(x) for positive normal x, as simd.h's log2_ps: x = m 2^e with m in [0.75, 1.5), from the exponent and
   mantissa bits, and ln m = 2 atanh((m - 1) / (m + 1)) from its series to z^9. */
static inline __m256 log2_ps8(__m256 x)
{
    const __m256i bits = _mm256_castps_si256(x);
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)),
                                                   _mm256_set1_epi32(0x3f800000)));  /* [1, 2) */
    const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.5f), _CMP_GE_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    e = _mm256_add_ps(e, _mm256_and_ps(big, _mm256_set1_ps(1.0f)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 z = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one)), z2 = _mm256_mul_ps(z, z);
    __m256 p = _mm256_set1_ps(1.0f / 9.0f);
    p = _mm256_fmadd_ps(p, z2, _mm256_set1_ps(1.0f / 7.0f));
    p = _mm256_fmadd_ps(p, z2, _mm256_set1_ps(1.0f / 5.0f));
    p = _mm256_fmadd_ps(p, z2, _mm256_set1_ps(1.0f / 3.0f));
    p = _mm256_fmadd_ps(p, z2, one);
    return _mm256_fmadd_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(2.8853900817779268f /* 2 / ln 2 */), e);
}

static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* All bits set in the lanes i < n of a vector (n may be over 8 or under 0): a mask for blendv and and. */
static inline __m256 lanes8(int n)
{
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota));
}

/* r[i][j] (8 x 8 floats) -> r[j][i] */
static inline void transpose8(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
        r[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
    }
}

#endif
