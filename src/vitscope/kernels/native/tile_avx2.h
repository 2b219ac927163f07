/* The register tile of vitscope's float32 AVX2 products (attention_f32_avx2.c, linear_f32_avx2.c): up to 6 rows
   x 16 columns (12 accumulators, 2 vectors of b and a broadcast in the 16 registers), or 12 rows x 8. */
#ifndef VS_TILE_AVX2_H
#define VS_TILE_AVX2_H

#include <immintrin.h>
#include <stdint.h>

/* c[r][0 .. 8 NV) = c0[r sc0 + 0 .. 8 NV) + sum over kk < kn of a[r sar + kk sak] b[kk sb + 0 .. 8 NV), for
   r < R, where c0 is NULL for 0 (c0 = c adds to c; sc0 = 0 adds one row to every row, a bias): R x NV
   accumulators in registers, from 0, c0 added once at the end (so a long sum taken in chunks, each added to
   the last, rounds like a sum of the chunks' sums: the weight gradient's 12800 rows had 8x torch's error
   when each tile started from c0). R and NV are constants wherever this is inlined. The accumulators are
   named variables, not an array: GCC kept an array's 12 x 2 vectors in registers but also stored each one to the
   stack after every multiply-add, which made the products 3x slower. */
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
static inline __attribute__((always_inline)) void tile(const int R, const int NV, int kn, const float *a, int64_t sar,
                                                      int64_t sak, const float *b, int64_t sb, float *c, int64_t sc,
                                                      const float *c0, int64_t sc0)
{
#define DECLARE(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
    ROWS(DECLARE)
    for (int kk = 0; kk < kn; kk++) {
        const __m256 b0 = _mm256_loadu_ps(b + kk * sb), b1 = NV > 1 ? _mm256_loadu_ps(b + kk * sb + 8) : b0;
#define STEP(i)                                                                 \
        if (R > i) {                                                            \
            const __m256 av = _mm256_broadcast_ss(a + (i) * sar + kk * sak);    \
            c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);                         \
            if (NV > 1) c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);             \
        }
        ROWS(STEP)
    }
#define STORE(i)                                                                               \
    if (R > i) {                                                                               \
        if (c0) {                                                                              \
            c##i##0 = _mm256_add_ps(_mm256_loadu_ps(c0 + (i) * sc0), c##i##0);                 \
            if (NV > 1) c##i##1 = _mm256_add_ps(_mm256_loadu_ps(c0 + (i) * sc0 + 8), c##i##1); \
        }                                                                                      \
        _mm256_storeu_ps(c + (i) * sc, c##i##0);                                               \
        if (NV > 1) _mm256_storeu_ps(c + (i) * sc + 8, c##i##1);                               \
    }
    ROWS(STORE)
#undef DECLARE
#undef STEP
#undef STORE
}

/* rows a tile of nv vectors takes */
static inline int rows_for(int nv) { return nv == 2 ? 6 : 12; }

#define T(R, NV) case (NV) * 16 + (R): tile(R, NV, kn, a, sar, sak, b, sb, c, sc, c0, sc0); break;
#define TS2 T(1, 2) T(2, 2) T(3, 2) T(4, 2) T(5, 2) T(6, 2)
#define TS1 T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(5, 1) T(6, 1) T(7, 1) T(8, 1) T(9, 1) T(10, 1) T(11, 1) T(12, 1)

/* tile with R and NV known at run time: each pair a copy of its own */
static void tile_any(int R, int NV, int kn, const float *a, int64_t sar, int64_t sak, const float *b, int64_t sb,
                     float *c, int64_t sc, const float *c0, int64_t sc0)
{
    switch (NV * 16 + R) { TS2 TS1 }
}

#endif
