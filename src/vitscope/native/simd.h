/* Vector maths shared by vitscope's kernels (AVX-512). */
#ifndef VS_SIMD_H
#define VS_SIMD_H

#include <immintrin.h>

/* 2^x for x <= 0, within 2.4 float32 ulps (measured over [-125, 0]). Below -125 it returns about
   2^-125, not 0, so that no result is ever subnormal: a subnormal result costs a microcode assist,
   which once made the attention kernel 3x slower. Callers zero the lanes that must be exactly 0. */
static inline __m512 exp2_ps(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Flush subnormal results to zero and read subnormal inputs as zero (MXCSR's FTZ and DAZ bits) in this
   thread, returning the old MXCSR for `subnormals_restore`. A subnormal costs a microcode assist of
   over a hundred cycles: GELU's tail for |x| > 9, or a softmax weight of 2^-125 times a small
   gradient, made whole kernels 3-25x slower. Every such value is below bfloat16's smallest normal
   number, 1.2e-38, far under anything a bfloat16 result keeps. */
static inline unsigned subnormals_off(void)
{
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);
    return csr;
}

static inline void subnormals_restore(unsigned csr) { _mm_setcsr(csr); }

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
