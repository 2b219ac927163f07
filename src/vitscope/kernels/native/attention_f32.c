/* Short-sequence attention in float32 with AVX-512 (no AMX needed), forward and backward.

   o = softmax(scale q k^T) v, one (batch, head) at a time, for N_k <= 256 keys and head dims that are
   multiples of 16 up to 128. At these sizes PyTorch's flash kernel spends most of its time on
   per-block overhead, and its callers pay re-layout copies around it; here a head's scores stay in
   L1/L2, every product is one register-tiled loop of broadcast-multiply-adds, and q, k, v are read,
   and the output and gradients written, at whatever strides the caller's layout has, so attention
   runs straight from (and back into) the fused qkv projection.

   The conventions are those of short_attention.c, so one Python wrapper serves both: strides in
   elements for the (batch, head, row) dims, the last dim contiguous; lse is each query's
   log2-sum-exp2 of its scores times c = scale log2(e), kept by the forward for the backward. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "touch.h"

#define MAXK 256
#define MAXD 128
#define QBLOCK 32 /* queries whose scores the forward holds at a time */

/* c[r][0 .. 16 NV) = sum over kk < kn of a[r sar + kk sak] b[kk sb + 0 .. 16 NV), for r < R: R x NV
   accumulators in registers, each step one load of b per vector and one broadcast of a per row. R and
   NV are constants wherever this is inlined, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const int R, const int NV, int kn, const float *a, int64_t sar,
                                                      int64_t sak, const float *b, int64_t sb, float *c, int64_t sc)
{
    __m512 acc[12][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int kk = 0; kk < kn; kk++) {
        __m512 bv[4];
        for (int v = 0; v < NV; v++) bv[v] = _mm512_loadu_ps(b + kk * sb + v * 16);
        for (int r = 0; r < R; r++) {
            const __m512 av = _mm512_set1_ps(a[r * sar + kk * sak]);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(c + r * sc + v * 16, acc[r][v]);
}

/* The row counts per tile: as many rows as leave registers for the accumulators and b's vectors. */
static inline int rows_for(int nv) { return nv == 4 ? 6 : nv == 3 ? 8 : 12; }

#define T(R, NV) case (NV) * 16 + (R): tile(R, NV, kn, a, sar, sak, b, sb, c, sc); break;
#define TS4 T(1, 4) T(2, 4) T(3, 4) T(4, 4) T(5, 4) T(6, 4)
#define TS3 T(1, 3) T(2, 3) T(3, 3) T(4, 3) T(5, 3) T(6, 3) T(7, 3) T(8, 3)
#define TS2 T(1, 2) T(2, 2) T(3, 2) T(4, 2) T(5, 2) T(6, 2) T(7, 2) T(8, 2) T(9, 2) T(10, 2) T(11, 2) T(12, 2)
#define TS1 T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(5, 1) T(6, 1) T(7, 1) T(8, 1) T(9, 1) T(10, 1) T(11, 1) T(12, 1)

static void tile_any(int R, int NV, int kn, const float *a, int64_t sar, int64_t sak, const float *b, int64_t sb,
                     float *c, int64_t sc)
{
    switch (NV * 16 + R) { TS4 TS3 TS2 TS1 }
}

/* c (m rows, 16 nvec cols, row stride sc) = A B, A's element (r, kk) at a[r sar + kk sak], B's row kk
   at b + kk sb, the sum over kk < kn. Columns in groups of up to four vectors, each group's rows in
   tiles, so a group of B's columns stays in L1 across the tiles. */
static void gemm(int m, int nvec, int kn, const float *a, int64_t sar, int64_t sak, const float *b, int64_t sb,
                 float *c, int64_t sc)
{
    for (int v0 = 0; v0 < nvec; v0 += 4) {
        const int nv = nvec - v0 < 4 ? nvec - v0 : 4, rmax = rows_for(nv);
        for (int r0 = 0; r0 < m; r0 += rmax) {
            const int r = m - r0 < rmax ? m - r0 : rmax;
            tile_any(r, nv, kn, a + r0 * sar, sar, sak, b + v0 * 16, sb, c + r0 * sc + v0 * 16, sc);
        }
    }
}

/* kt[dd lk + j] = k[j sk + dd] for j < n, 0 for n <= j < lk (lk a multiple of 16): k's transpose with
   its rows padded, 16 x 16 blocks at a time. */
static void transpose_pad(const float *k, int64_t sk, int n, int d, int lk, float *kt)
{
    for (int j0 = 0; j0 < lk; j0 += 16)
        for (int d0 = 0; d0 < d; d0 += 16) {
            __m512i r[16];
            for (int c = 0; c < 16; c++)
                r[c] = j0 + c < n ? _mm512_loadu_si512(k + (int64_t)(j0 + c) * sk + d0) : _mm512_setzero_si512();
            transpose16(r);
            for (int m = 0; m < 16; m++) _mm512_storeu_si512(kt + (int64_t)(d0 + m) * lk + j0, r[m]);
        }
}

static inline __mmask16 lanes(int n, int jv) { int left = n - jv * 16; return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

typedef struct {
    float kt[MAXD * MAXK], vt[MAXD * MAXK]; /* k and v transposed, keys padded to 16 */
    float s[MAXK * MAXK], dp[MAXK * MAXK];  /* scores / weights; their gradients */
    float mx[QBLOCK], sum[QBLOCK];          /* the forward's row maxima and sums of weights */
} scratch_t;

/* o = softmax(scale q k^T) v for one (batch, head); with lse, each query's log2-sum-exp2 (c = scale log2 e). */
static void head_forward(const float *q, int64_t sq, const float *k, int64_t sk, const float *v, int64_t sv,
                         float *o, int64_t so, float *lse, int nq, int nk, int d, float c, scratch_t *w,
                         float *floats)
{
    (void)floats;  /* at most MAXK keys: the scratch holds everything */
    const int njv = (nk + 15) / 16, lk = njv * 16;
    const __m512 cs = _mm512_set1_ps(c);
    transpose_pad(k, sk, nk, d, lk, w->kt);
    touch_t *const tp = touch_plan(nq);  /* the next head's rows, a few lines with each query's softmax (touch.h) */
    for (int i0 = 0; i0 < nq; i0 += QBLOCK) {
        const int rows = nq - i0 < QBLOCK ? nq - i0 : QBLOCK;
        float *s = w->s;
        gemm(rows, njv, d, q + (int64_t)i0 * sq, sq, 1, w->kt, lk, s, lk);  /* scores, rows x lk */
        for (int r = 0; r < rows; r++) {
            float *sr = s + (int64_t)r * lk;
            __m512 m = _mm512_set1_ps(-INFINITY);
            touch_step(tp);
            for (int jv = 0; jv < njv; jv++) {
                const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), lanes(nk, jv), _mm512_loadu_ps(sr + jv * 16), cs);
                _mm512_storeu_ps(sr + jv * 16, x);
                m = _mm512_max_ps(m, x);
            }
            w->mx[r] = _mm512_reduce_max_ps(m);
            const __m512 mx = _mm512_set1_ps(w->mx[r]);
            __m512 sum = _mm512_setzero_ps();
            for (int jv = 0; jv < njv; jv++) {
                const __m512 e = _mm512_maskz_mov_ps(lanes(nk, jv), exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + jv * 16), mx)));
                _mm512_storeu_ps(sr + jv * 16, e);
                sum = _mm512_add_ps(sum, e);
            }
            const float total = _mm512_reduce_add_ps(sum);
            const __m512 inv = _mm512_set1_ps(1.0f / total);
            for (int jv = 0; jv < njv; jv++) _mm512_storeu_ps(sr + jv * 16, _mm512_mul_ps(_mm512_loadu_ps(sr + jv * 16), inv));
            w->sum[r] = total;
        }
        if (lse)  /* the block's log-sum-exps at once, off the rows' chain of reductions */
            for (int r0 = 0; r0 < rows; r0 += 16) {
                const __mmask16 lm = lanes(rows - r0, 0);
                const __m512 total = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), lm, w->sum + r0);
                _mm512_mask_storeu_ps(lse + i0 + r0, lm, _mm512_add_ps(_mm512_maskz_loadu_ps(lm, w->mx + r0), log2_ps(total)));
            }
        gemm(rows, d / 16, nk, s, lk, 1, v, sv, o + (int64_t)i0 * so, so);  /* o = P v */
    }
}

/* The gradients of one (batch, head) from its output's gradient g (nq, d): with P = exp2(c s - lse)
   recomputed, dv = P^T g, dP = g v^T, dS = scale P (dP - delta) with delta = rowsum(P dP), dq = dS k,
   dk = dS^T q. */
static void head_backward(const float *q, int64_t sq, const float *k, int64_t sk, const float *v, int64_t sv,
                          const float *g, int64_t sg, const float *lse, const float *delta, float *dq, int64_t sdq,
                          float *dk, int64_t sdk, float *dv, int64_t sdv, int nq, int nk, int d, float c, float scale,
                          scratch_t *w, float *floats)
{
    (void)floats, (void)delta;  /* at most MAXK queries and keys: the scratch holds everything */
    const int njv = (nk + 15) / 16, lk = njv * 16, nd = d / 16;
    float *p = w->s, *dp = w->dp;
    const __m512 cs = _mm512_set1_ps(c), sc = _mm512_set1_ps(scale);
    transpose_pad(k, sk, nk, d, lk, w->kt);
    transpose_pad(v, sv, nk, d, lk, w->vt);
    gemm(nq, njv, d, q, sq, 1, w->kt, lk, p, lk);   /* scores */
    gemm(nq, njv, d, g, sg, 1, w->vt, lk, dp, lk);  /* dP = g v^T */
    touch_t *const tp = touch_plan(nq);
    for (int i = 0; i < nq; i++) {
        float *pr = p + (int64_t)i * lk, *dpr = dp + (int64_t)i * lk;
        touch_step(tp);
        const __m512 l = _mm512_set1_ps(lse[i]);
        __m512 acc = _mm512_setzero_ps();
        for (int jv = 0; jv < njv; jv++) {
            const __m512 pv = _mm512_maskz_mov_ps(lanes(nk, jv), exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(pr + jv * 16), cs, l)));
            _mm512_storeu_ps(pr + jv * 16, pv);
            acc = _mm512_fmadd_ps(pv, _mm512_loadu_ps(dpr + jv * 16), acc);
        }
        const __m512 delta = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
        for (int jv = 0; jv < njv; jv++) {
            const __m512 pv = _mm512_loadu_ps(pr + jv * 16);
            _mm512_storeu_ps(dpr + jv * 16, _mm512_mul_ps(_mm512_mul_ps(pv, _mm512_sub_ps(_mm512_loadu_ps(dpr + jv * 16), delta)), sc));
        }
    }
    gemm(nq, nd, nk, dp, lk, 1, k, sk, dq, sdq);  /* dq = dS k */
    gemm(nk, nd, nq, p, 1, lk, g, sg, dv, sdv);   /* dv = P^T g */
    gemm(nk, nd, nq, dp, 1, lk, q, sq, dk, sdk);  /* dk = dS^T q */
}

static inline void products_on(void) {}
static inline void products_off(void) {}

#define ELEM float
#define DIM_MULTIPLE 16
#include "attention_driver.h"

/* As vs_attention_fwd (short_attention.c), in float32: q, k, v, o (B, H, N, D) at strides st[0..11];
   head dims multiples of 16 up to 128, at most 256 keys, any number of queries. Returns 0, -1 for a
   shape outside these, -2 when out of memory. */
int vs_attention_f32_fwd(const float *q, const float *k, const float *v, float *o, float *lse, int64_t b, int64_t h,
                         int64_t nq, int64_t nk, int64_t d, const int64_t *st, float scale, int threads)
{
    if (!shape_ok(b, h, nq, nk, d, threads, INT32_MAX, MAXK)) return -1;
    const job_t j = {{q, k, v, NULL}, {o, NULL, NULL}, lse, NULL, st, h, nq, nk, d, scale * 1.4426950408889634f,
                     scale, 0};
    return each_head(&j, b, threads, forward_head);
}

/* As vs_attention_bwd, in float32; Nq <= 256, delta unused (pass NULL). */
int vs_attention_f32_bwd(const float *q, const float *k, const float *v, const float *g, const float *lse,
                         const float *delta, float *dq, float *dk, float *dv, int64_t b, int64_t h, int64_t nq,
                         int64_t nk, int64_t d, const int64_t *st, float scale, int threads)
{
    if (!shape_ok(b, h, nq, nk, d, threads, MAXK, MAXK)) return -1;
    const job_t j = {{q, k, v, g}, {dq, dk, dv}, (float *)lse, delta, st, h, nq, nk, d, scale * 1.4426950408889634f,
                     scale, 0};
    return each_head(&j, b, threads, backward_head);
}
