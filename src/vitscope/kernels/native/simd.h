/* Vector maths shared by vitscope's kernels (AVX-512). */
#ifndef VS_SIMD_H
#define VS_SIMD_H

#include <immintrin.h>

#include "subnormals.h"

/* 2^x for x <= 0 as 2^n p(f), n = round(x), f = x - n in [-0.5, 0.5], p's coefficients c[0 .. k) from the
   highest power down (the last is 1). Below -125 it returns about 2^-125, not 0, so that no result is
   ever subnormal: a subnormal result costs a microcode assist, which once made the attention kernel 3x
   slower. Callers zero the lanes that must be exactly 0. */
static inline __attribute__((always_inline)) __m512 exp2_poly(__m512 x, const float *c, int k)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < k; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

/* 2^x for x <= 0, within 2.4 float32 ulps (measured over [-125, 0]): degree 6. */
static inline __m512 exp2_ps(__m512 x)
{
    static const float c[] = {1.5353362e-4f, 1.3398874e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f,
                              6.9314718e-1f, 1.0f};
    return exp2_poly(x, c, 7);
}

/* exp2_ps with a degree-5 polynomial fitted for relative error (9e-8 at most; 2.0 ulps measured over
   [-125, 0], 8% less time). For the bfloat16 attention, whose weights are rounded to bfloat16 (3.9e-3)
   before they are used: the float32 kernel keeps exp2_ps, whose outputs match timm's float32 ones to
   1e-5 and with this one came out 1.01e-5 off in one element. */
static inline __m512 exp2_quick_ps(__m512 x)
{
    static const float c[] = {1.326473978e-3f, 9.671512783e-3f, 5.550733701e-2f, 2.402224208e-1f,
                              6.931469776e-1f, 1.0f};
    return exp2_poly(x, c, 6);
}

/* log2(x) for positive normal x, within 1.3e-7 max(|log2 x|, 1) (measured over 2^-125 .. 2^125; float32's
   rounding alone is 6e-8 |log2 x|): x = m 2^e with m in [0.75, 1.5), and ln m = 2 atanh(z) with
   z = (m - 1) / (m + 1), |z| <= 0.2, from its series to z^9 (the next term is below 2e-9). */
static inline __m512 log2_ps(__m512 x)
{
    __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src), e = _mm512_getexp_ps(x);
    const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.5f), _CMP_GE_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 z = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one)), z2 = _mm512_mul_ps(z, z);
    __m512 p = _mm512_set1_ps(1.0f / 9.0f);
    p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(1.0f / 7.0f));
    p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(1.0f / 5.0f));
    p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(1.0f / 3.0f));
    p = _mm512_fmadd_ps(p, z2, one);
    return _mm512_fmadd_ps(_mm512_mul_ps(p, z), _mm512_set1_ps(2.8853900817779268f /* 2 / ln 2 */), e);
}

/* r[i][j] (16 x 16 dwords) -> r[j][i] */
static inline void transpose16(__m512i r[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        __m512i a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), b = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        __m512i c = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xee), e = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xee);
        r[m] = _mm512_shuffle_i32x4(a, b, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(a, b, 0xdd);
        r[8 + m] = _mm512_shuffle_i32x4(c, e, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(c, e, 0xdd);
    }
}

#endif
