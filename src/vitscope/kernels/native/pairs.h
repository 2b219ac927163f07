/* The weight-gradient kernels' shared pieces (weight_grad.c, conv_weight_grad.c), for AVX512-BF16: a sum
   over rows of gᵀ x taken as vdpbf16ps over pairs of rows, each pair interleaved element by element
   into the dwords the instruction multiplies and adds. */
#ifndef VS_PAIRS_H
#define VS_PAIRS_H
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

enum { RB = 4 };  /* g's columns (the output's rows) a block keeps in registers */

/* 32 elements of row a and of row b interleaved: *lo = the dwords (a[0], b[0]) .. (a[15], b[15]),
   *hi = (a[16], b[16]) .. (a[31], b[31]). */
static inline __attribute__((always_inline)) void interleave(__m512i a, __m512i b, __m512i *lo, __m512i *hi)
{
    const __m512i l = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    *lo = _mm512_permutex2var_epi16(a, l, b);
    *hi = _mm512_permutex2var_epi16(a, _mm512_add_epi16(l, _mm512_set1_epi16(16)), b);
}

/* rows r0, r0 + 1 of y (row stride ld, n columns, n % 32 == 0) interleaved into dst[r][c] = the dword
   (y[2r][c], y[2r + 1][c]); a missing last odd row reads as zeros. */
static inline void pack_pairs(const uint16_t *y, int64_t ld, int rows, int64_t n, uint32_t *dst)
{
    for (int r = 0; 2 * r < rows; r++) {
        const uint16_t *a = y + (int64_t)(2 * r) * ld, *b = a + ld;
        const int has_b = 2 * r + 1 < rows;
        uint32_t *d = dst + (int64_t)r * n;
        for (int64_t c = 0; c < n; c += 32) {
            __m512i lo, hi;
            interleave(_mm512_loadu_si512(a + c), has_b ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512(), &lo, &hi);
            _mm512_store_si512(d + c, lo);
            _mm512_store_si512(d + c + 16, hi);
        }
    }
}

/* c[RB][cb·16] (row stride ldc) += the np pairs of gp's RB columns (row length o) times xp's cb tiles of
   16 (row length i), the RB x cb sums in registers; cb is a constant at each call (at most 4). */
static inline __attribute__((always_inline)) void pairs_block(const uint32_t *gp, int64_t o, const uint32_t *xp,
                                                              int64_t i, int np, float *c, int64_t ldc, const int cb)
{
    __m512 acc[RB][4];
    for (int r = 0; r < RB; r++)
        for (int e = 0; e < cb; e++) acc[r][e] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++) {
        __m512bh bv[4];
        for (int e = 0; e < cb; e++) bv[e] = (__m512bh)_mm512_load_si512(xp + (int64_t)p * i + e * 16);
        for (int r = 0; r < RB; r++) {
            const __m512bh av = (__m512bh)_mm512_set1_epi32((int)gp[(int64_t)p * o + r]);
            for (int e = 0; e < cb; e++) acc[r][e] = _mm512_dpbf16_ps(acc[r][e], av, bv[e]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int e = 0; e < cb; e++) {
            float *out = c + r * ldc + e * 16;
            _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), acc[r][e]));
        }
}

/* The next chunk's input lines, fetched into L2 a few at a time while this chunk's blocks run: up to two
   runs of rows, each rows[t] rows of lines[t] cache lines, stride[t] bytes apart. */
typedef struct {
    const char *base[2];
    int64_t rows[2], lines[2], stride[2];
    int64_t total, next, per;  /* lines in all, the next to fetch, lines per call of fetch_some */
} fetch_plan;

/* A plan for n rows of `bytes` bytes at base, stride bytes apart, and m rows of xbytes at xbase, xstride apart,
   spread over `calls` calls of fetch_some. */
static inline fetch_plan plan_fetch(const void *base, int64_t n, int64_t bytes, int64_t stride, const void *xbase,
                                    int64_t m, int64_t xbytes, int64_t xstride, int64_t calls)
{
    fetch_plan f = {{(const char *)base, (const char *)xbase}, {n, m}, {(bytes + 63) / 64, (xbytes + 63) / 64},
                    {stride, xstride}, 0, 0, 0};
    f.total = f.rows[0] * f.lines[0] + f.rows[1] * f.lines[1];
    f.per = calls > 0 ? (f.total + calls - 1) / calls : f.total;
    return f;
}

static inline void fetch_some(fetch_plan *f)
{
    const int64_t end = f->next + f->per < f->total ? f->next + f->per : f->total, first = f->rows[0] * f->lines[0];
    for (int64_t l = f->next; l < end; l++) {
        const int t = l >= first;
        const int64_t e = t ? l - first : l;
        const int64_t r = e / f->lines[t], c = e - r * f->lines[t];
        _mm_prefetch(f->base[t] + r * f->stride[t] + c * 64, _MM_HINT_T1);
    }
    f->next = end;
}

/* This thread's packing buffers for kc/2 pairs of rows of o and of i dwords, kept from call to call (grown when
   a call needs more); 0, or -1 where they could not be allocated. Called inside a parallel region. */
static inline int pair_buffers(int kc, int64_t o, int64_t i, uint32_t **gp, uint32_t **xp)
{
    static __thread uint32_t *g, *x;
    static __thread int64_t gcap, xcap;
    const int64_t gn = (int64_t)kc / 2 * o, xn = (int64_t)kc / 2 * i;
    if (gcap < gn) { free(g); g = aligned_alloc(64, (size_t)gn * 4); gcap = g ? gn : 0; }
    if (xcap < xn) { free(x); x = aligned_alloc(64, (size_t)xn * 4); xcap = x ? xn : 0; }
    *gp = g, *xp = x;
    return g && x ? 0 : -1;
}

/* The rows of the chunk of kc that starts at row k0, before row m1 (0 where k0 >= m1). */
static inline int chunk_rows(int64_t k0, int kc, int64_t m1) { return k0 < m1 ? (int)(m1 - k0 < kc ? m1 - k0 : kc) : 0; }

/* Thread t's share of m rows, whole chunks of kc in order: [*m0, *m1). */
static inline void chunk_share(int64_t m, int kc, int t, int nt, int64_t *m0, int64_t *m1)
{
    const int64_t chunks = (m + kc - 1) / kc, per = (chunks + nt - 1) / nt;
    *m0 = t * per * kc < m ? t * per * kc : m;
    *m1 = (t + 1) * per * kc < m ? (t + 1) * per * kc : m;
}

/* out[0 .. n) = the nt threads' float32 sums (work: nt x n) added and rounded to bfloat16; n % 16 == 0. The
   threads share the elements: call it from inside the parallel region, after a barrier. */
static inline void sum_threads_bf16(const float *work, int nt, int64_t n, uint16_t *out)
{
#pragma omp for schedule(static)
    for (int64_t e = 0; e < n; e += 16) {
        __m512 v = _mm512_loadu_ps(work + e);
        for (int u = 1; u < nt; u++) v = _mm512_add_ps(v, _mm512_loadu_ps(work + (int64_t)u * n + e));
        _mm256_storeu_si256((__m256i *)(out + e), (__m256i)_mm512_cvtneps_pbh(v));
    }
}
#endif
