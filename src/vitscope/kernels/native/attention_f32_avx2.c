/* Attention in float32 with AVX2 and FMA, forward and backward: attention_f32.c for CPUs without AVX-512 (AMD
   before Zen 4, Intel's desktop and laptop parts), and past its 256 keys.

   The same algorithm and conventions as attention_f32.c (one (batch, head) at a time, a head's scores in
   L1/L2, every product a register-tiled loop of broadcast-multiply-adds, q, k, v read and the outputs
   written at the caller's strides, lse kept in the log2 domain), with 8-float vectors: head dims that are
   multiples of 8 up to 128, tiles of up to 6 rows x 16 columns (12 accumulators, 2 vectors of b and a
   broadcast in the 16 registers), masks as blend vectors. Past MAXK keys (or queries, for the backward)
   the heads run blockwise, as attention_bf16.h's long kernels: the forward's online softmax over key
   blocks, and a backward over key blocks and query chunks that takes delta = rowsum(g o) from the caller. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_avx2.h"
#include "tile_avx2.h"
#include "touch.h"

#define MAXK 256
#define MAXD 128
#define QBLOCK 30  /* queries whose scores the forward holds at a time: 5 tiles of 6 rows (32 left 2-row tiles) */
#define QCHUNK 240 /* queries whose outputs the long forward carries from key block to key block: 8 QBLOCKs */

/* Every product reads its b laid out in panels of 16 columns (gemm_panels), each column group's rows one
   contiguous stream: row-major, rows lk or d floats apart (1 KB or 256 B) put a tile's 64 or 256 rows of b
   into a few of L1's sets, and at a fused qkv's row stride (3 H D floats) into fewer still. Panels took
   the forward 1.05-1.2x and the backward 1.03-1.08x faster at 197-4097 keys (docs/performance.md). */

/* kp = k's n rows transposed (keys padded with zeros to lk, a multiple of 8) in panels of 16 keys, the last one
   8 wide where lk / 8 is odd: panel p, at kp + 16 p d, holds for each dd < d its keys' k[.][dd] (pw floats). */
static void transpose_panels(const float *k, int64_t sk, int n, int d, int lk, float *kp)
{
    for (int j0 = 0; j0 < lk; j0 += 8) {
        const int p0 = j0 / 16 * 16, pw = lk - p0 < 16 ? lk - p0 : 16;
        float *panel = kp + (int64_t)p0 * d + (j0 - p0);
        for (int d0 = 0; d0 < d; d0 += 8) {
            __m256 r[8];
            for (int c = 0; c < 8; c++)
                r[c] = j0 + c < n ? _mm256_loadu_ps(k + (int64_t)(j0 + c) * sk + d0) : _mm256_setzero_ps();
            transpose8(r);
            for (int m = 0; m < 8; m++) _mm256_storeu_ps(panel + (int64_t)(d0 + m) * pw, r[m]);
        }
    }
}

/* dst = n rows of d floats (d a multiple of 8) in panels of 16 columns, the last one 8 wide where d / 8 is odd:
   panel p, at dst + 16 p n, holds each row's columns 16 p .. 16 p + pw contiguously. */
static void pack_panels(const float *src, int64_t ss, int n, int d, float *dst)
{
    for (int j = 0; j < n; j++)
        for (int c0 = 0; c0 < d; c0 += 16) {
            const int pw = d - c0 < 16 ? d - c0 : 16;
            float *out = dst + (int64_t)c0 * n + (int64_t)j * pw;
            const float *in = src + (int64_t)j * ss + c0;
            _mm256_storeu_ps(out, _mm256_loadu_ps(in));
            if (pw == 16) _mm256_storeu_ps(out + 8, _mm256_loadu_ps(in + 8));
        }
}

/* c (m rows, 8 nvec cols, row stride sc) = A B, or c + A B with `add`; A's element (r, kk) at a[r sar + kk sak],
   B (kn rows, 8 nvec columns) in the panels above, the sum over kk < kn. Each panel's rows in tiles. */
static void gemm_panels(int m, int nvec, int kn, const float *a, int64_t sar, int64_t sak, const float *bp, float *c,
                        int64_t sc, int add)
{
    for (int v0 = 0; v0 < nvec; v0 += 2) {
        const int nv = nvec - v0 < 2 ? nvec - v0 : 2, rmax = rows_for(nv);
        const float *b = bp + (int64_t)v0 * 8 * kn;
        for (int r0 = 0; r0 < m; r0 += rmax) {
            const int r = m - r0 < rmax ? m - r0 : rmax;
            float *cr = c + r0 * sc + v0 * 8;
            tile_any(r, nv, kn, a + r0 * sar, sar, sak, b, nv * 8, cr, sc, add ? cr : NULL, sc);
        }
    }
}

typedef struct {
    float kt[MAXD * MAXK], vt[MAXD * MAXK]; /* k and v transposed in panels, keys padded to 8 (forward: v in panels) */
    float kc[MAXK * MAXD], qc[MAXK * MAXD], gc[MAXK * MAXD]; /* the backward's k, q and g in panels */
    float s[MAXK * MAXK], dp[MAXK * MAXK];  /* scores / weights; their gradients */
    float mx[MAXK], sum[MAXK];              /* the forward's row maxima and sums of weights */
    float acc[MAXK * MAXD];                 /* the long forward's unnormalised outputs */
} scratch_t;

/* One query's row of n scores sr (padded to whole vectors) -> its unnormalised weights exp2(c sr - mx) in place,
   0 past n, with mx the larger of `floor` (the long forward's maximum so far; -INFINITY: none) and the row's
   largest c sr. Returns the weights' sum (16 partial sums) and mx in *mx_out. */
static inline __attribute__((always_inline)) float row_weights(float *sr, int n, __m256 cs, float c, float floor,
                                                               float *mx_out)
{
    const int njv = (n + 7) / 8;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 m = ninf;
    for (int jv = 0; jv < njv; jv++)
        m = _mm256_max_ps(m, _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr + jv * 8), lanes8(n - jv * 8)));
    const float block = c * hmax8(m), mx = floor > block ? floor : block;
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int jv = 0; jv < njv; jv++) {
        const __m256 e = _mm256_and_ps(lanes8(n - jv * 8),
                                       exp2_ps8(_mm256_fmsub_ps(_mm256_loadu_ps(sr + jv * 8), cs, mxv)));
        _mm256_storeu_ps(sr + jv * 8, e);
        sum[jv & 1] = _mm256_add_ps(sum[jv & 1], e);
    }
    *mx_out = mx;
    return hsum8(_mm256_add_ps(sum[0], sum[1]));
}

/* o = softmax(scale q k^T) v for one (batch, head); with lse, each query's log2-sum-exp2 (c = scale log2 e). */
static void head_forward_short(const float *q, int64_t sq, const float *k, int64_t sk, const float *v, int64_t sv,
                         float *o, int64_t so, float *lse, int nq, int nk, int d, float c, scratch_t *w,
                         float *floats)
{
    (void)floats;  /* at most MAXK keys: the scratch holds everything */
    const int njv = (nk + 7) / 8, lk = njv * 8;
    const __m256 cs = _mm256_set1_ps(c);
    transpose_panels(k, sk, nk, d, lk, w->kt);
    pack_panels(v, sv, nk, d, w->vt);
    touch_t *const tp = touch_plan(nq);  /* the next head's rows, a few lines with each query's softmax (touch.h) */
    for (int i0 = 0; i0 < nq; i0 += QBLOCK) {
        const int rows = nq - i0 < QBLOCK ? nq - i0 : QBLOCK;
        float *s = w->s;
        gemm_panels(rows, njv, d, q + (int64_t)i0 * sq, sq, 1, w->kt, s, lk, 0);  /* scores, rows x lk */
        for (int r = 0; r < rows; r++) {  /* unnormalised weights exp2(c s - c max s); o is scaled after P v */
            touch_step(tp);
            w->sum[r] = row_weights(s + (int64_t)r * lk, nk, cs, c, -INFINITY, &w->mx[r]);
        }
        if (lse)  /* the block's log-sum-exps at once, off the rows' chain of reductions */
            for (int r0 = 0; r0 < rows; r0 += 8) {
                float buf[8];
                const int n = rows - r0 < 8 ? rows - r0 : 8;
                const __m256 keep = lanes8(n), one = _mm256_set1_ps(1.0f);
                memcpy(buf, w->sum + r0, sizeof(float) * (size_t)n);
                const __m256 total = _mm256_blendv_ps(one, _mm256_loadu_ps(buf), keep);
                memcpy(buf, w->mx + r0, sizeof(float) * (size_t)n);
                _mm256_storeu_ps(buf, _mm256_add_ps(_mm256_loadu_ps(buf), log2_ps8(total)));
                memcpy(lse + i0 + r0, buf, sizeof(float) * (size_t)n);
            }
        float *ob = o + (int64_t)i0 * so;
        gemm_panels(rows, d / 8, nk, s, lk, 1, w->vt, ob, so, 0);  /* o = P v, then each row over its sum */
        for (int r = 0; r < rows; r++) {
            const __m256 inv = _mm256_set1_ps(1.0f / w->sum[r]);
            for (int dd = 0; dd < d; dd += 8)
                _mm256_storeu_ps(ob + r * so + dd, _mm256_mul_ps(_mm256_loadu_ps(ob + r * so + dd), inv));
        }
    }
}

/* head_forward_short for more than MAXK keys: flash attention's online softmax over blocks of MAXK keys,
   as attention_bf16.h's head_forward_long. For each chunk of up to QCHUNK queries, each query's running
   maximum and sum of weights and its unnormalised output (w->acc, rows of d floats) are carried from key
   block to key block: a block's weights are taken against the maximum so far, and what was accumulated
   is rescaled by exp2(old max - new max) where the maximum grows. The head's keys (transposed, block by
   block) and values are laid out in panels once, in `laid` (long_floats(nk, d) floats: the keys' blocks,
   then the values'), and read by every chunk (laid out again for each chunk they took 1.05x the time at
   1025-4097 keys); a block's scores are taken QBLOCK queries at a time, as the short forward's. */
static int64_t long_floats(int64_t nk, int64_t d) { return 2 * ((nk + MAXK - 1) / MAXK) * MAXK * d; }

static void head_forward_long(const float *q, int64_t sq, const float *k, int64_t sk, const float *v, int64_t sv,
                              float *o, int64_t so, float *lse, int nq, int nk, int d, float c, scratch_t *w,
                              float *laid)
{
    const __m256 cs = _mm256_set1_ps(c);
    const int blocks = (nk + MAXK - 1) / MAXK;
    const int64_t per_block = (int64_t)MAXK * d;  /* floats of a block's keys, and of its values */
    for (int b = 0; b < blocks; b++) {
        const int j0 = b * MAXK, kn = nk - j0 < MAXK ? nk - j0 : MAXK;
        transpose_panels(k + (int64_t)j0 * sk, sk, kn, d, (kn + 7) / 8 * 8, laid + b * per_block);
        pack_panels(v + (int64_t)j0 * sv, sv, kn, d, laid + (blocks + b) * per_block);
    }
    touch_t *const tp = touch_plan((int64_t)nq * blocks);
    for (int c0 = 0; c0 < nq; c0 += QCHUNK) {
        const int cn = nq - c0 < QCHUNK ? nq - c0 : QCHUNK;
        for (int r = 0; r < cn; r++) {
            w->mx[r] = -INFINITY;
            w->sum[r] = 0.0f;
        }
        for (int j0 = 0; j0 < nk; j0 += MAXK) {
            const int kn = nk - j0 < MAXK ? nk - j0 : MAXK, njv = (kn + 7) / 8, lk = njv * 8;
            const float *kt = laid + (j0 / MAXK) * per_block, *vt = laid + (blocks + j0 / MAXK) * per_block;
            for (int i0 = 0; i0 < cn; i0 += QBLOCK) {
                const int rows = cn - i0 < QBLOCK ? cn - i0 : QBLOCK;
                float *s = w->s, *acc = w->acc + (int64_t)i0 * d;
                gemm_panels(rows, njv, d, q + (int64_t)(c0 + i0) * sq, sq, 1, kt, s, lk, 0);  /* scores */
                for (int r = 0; r < rows; r++) {
                    const float old = w->mx[i0 + r];
                    float mx;
                    touch_step(tp);
                    const float total = row_weights(s + (int64_t)r * lk, kn, cs, c, old, &mx);
                    const float alpha = old == -INFINITY ? 0.0f : exp2f(old - mx);
                    w->sum[i0 + r] = w->sum[i0 + r] * alpha + total;
                    w->mx[i0 + r] = mx;
                    if (j0 && alpha != 1.0f) {
                        const __m256 av = _mm256_set1_ps(alpha);
                        for (int dd = 0; dd < d; dd += 8)
                            _mm256_storeu_ps(acc + r * d + dd, _mm256_mul_ps(_mm256_loadu_ps(acc + r * d + dd), av));
                    }
                }
                gemm_panels(rows, d / 8, kn, s, lk, 1, vt, acc, d, j0 > 0);  /* acc = acc alpha + P v */
            }
        }
        for (int r = 0; r < cn; r++) {
            const __m256 inv = _mm256_set1_ps(1.0f / w->sum[r]);
            float *orow = o + (int64_t)(c0 + r) * so;
            for (int dd = 0; dd < d; dd += 8)
                _mm256_storeu_ps(orow + dd, _mm256_mul_ps(_mm256_loadu_ps(w->acc + (int64_t)r * d + dd), inv));
            if (lse) lse[c0 + r] = w->mx[r] + log2f(w->sum[r]);
        }
    }
}

/* o = softmax(scale q k^T) v for one (batch, head), any number of keys; past MAXK, `floats` holds
   long_floats(nk, d). */
static void head_forward(const float *q, int64_t sq, const float *k, int64_t sk, const float *v, int64_t sv,
                         float *o, int64_t so, float *lse, int nq, int nk, int d, float c, scratch_t *w,
                         float *floats)
{
    (nk > MAXK ? head_forward_long : head_forward_short)(q, sq, k, sk, v, sv, o, so, lse, nq, nk, d, c, w, floats);
}

/* The gradients of one (batch, head) from its output's gradient g (nq, d), as attention_f32.c: with
   P = exp2(c s - lse) recomputed, dv = P^T g, dP = g v^T, dS = scale P (dP - delta), delta = rowsum(P dP),
   dq = dS k, dk = dS^T q. */
static void head_backward_short(const float *q, int64_t sq, const float *k, int64_t sk, const float *v, int64_t sv,
                          const float *g, int64_t sg, const float *lse, const float *delta, float *dq, int64_t sdq,
                          float *dk, int64_t sdk, float *dv, int64_t sdv, int nq, int nk, int d, float c, float scale,
                          scratch_t *w, float *floats)
{
    (void)floats, (void)delta;  /* at most MAXK queries and keys: the scratch holds everything */
    const int njv = (nk + 7) / 8, lk = njv * 8, nd = d / 8;
    float *p = w->s, *dp = w->dp;
    const __m256 cs = _mm256_set1_ps(c), sc = _mm256_set1_ps(scale);
    transpose_panels(k, sk, nk, d, lk, w->kt);
    transpose_panels(v, sv, nk, d, lk, w->vt);
    gemm_panels(nq, njv, d, q, sq, 1, w->kt, p, lk, 0);   /* scores */
    gemm_panels(nq, njv, d, g, sg, 1, w->vt, dp, lk, 0);  /* dP = g v^T */
    touch_t *const tp = touch_plan(nq);
    for (int i = 0; i < nq; i++) {
        float *pr = p + (int64_t)i * lk, *dpr = dp + (int64_t)i * lk;
        touch_step(tp);
        const __m256 l = _mm256_set1_ps(lse[i]);
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  /* 16 partial sums, as attention_f32.c's */
        for (int jv = 0; jv < njv; jv++) {
            const __m256 pv = _mm256_and_ps(lanes8(nk - jv * 8), exp2_ps8(_mm256_fmsub_ps(_mm256_loadu_ps(pr + jv * 8), cs, l)));
            _mm256_storeu_ps(pr + jv * 8, pv);
            acc[jv & 1] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(dpr + jv * 8), acc[jv & 1]);
        }
        const __m256 dl = _mm256_set1_ps(hsum8(_mm256_add_ps(acc[0], acc[1])));
        for (int jv = 0; jv < njv; jv++) {
            const __m256 pv = _mm256_loadu_ps(pr + jv * 8);
            _mm256_storeu_ps(dpr + jv * 8, _mm256_mul_ps(_mm256_mul_ps(pv, _mm256_sub_ps(_mm256_loadu_ps(dpr + jv * 8), dl)), sc));
        }
    }
    pack_panels(k, sk, nk, d, w->kc);
    pack_panels(g, sg, nq, d, w->gc);
    pack_panels(q, sq, nq, d, w->qc);
    gemm_panels(nq, nd, nk, dp, lk, 1, w->kc, dq, sdq, 0);  /* dq = dS k */
    gemm_panels(nk, nd, nq, p, 1, lk, w->gc, dv, sdv, 0);   /* dv = P^T g */
    gemm_panels(nk, nd, nq, dp, 1, lk, w->qc, dk, sdk, 0);  /* dk = dS^T q */
}

/* The backward for more than MAXK queries or keys, flash attention's way (attention_bf16.h's
   head_backward_long): for each block of up to MAXK keys and each chunk of up to MAXK queries, P is
   recomputed from lse and dS = scale P (dP - delta), with delta = rowsum(g o) from the caller; the
   products are the short backward's on the block and chunk, each summed straight into the outputs (dq
   over key blocks, dk and dv over query chunks). */
static void head_backward_long(const float *q, int64_t sq, const float *k, int64_t sk, const float *v, int64_t sv,
                               const float *g, int64_t sg, const float *lse, const float *delta, float *dq,
                               int64_t sdq, float *dk, int64_t sdk, float *dv, int64_t sdv, int nq, int nk, int d,
                               float c, float scale, scratch_t *w)
{
    const int nd = d / 8;
    float *p = w->s, *dp = w->dp;
    const __m256 cs = _mm256_set1_ps(c), sc = _mm256_set1_ps(scale);
    touch_t *const tp = touch_plan((int64_t)nq * ((nk + MAXK - 1) / MAXK));
    for (int j0 = 0; j0 < nk; j0 += MAXK) {
        const int kn = nk - j0 < MAXK ? nk - j0 : MAXK, njv = (kn + 7) / 8, lk = njv * 8;
        const float *kb = k + (int64_t)j0 * sk;
        transpose_panels(kb, sk, kn, d, lk, w->kt);
        transpose_panels(v + (int64_t)j0 * sv, sv, kn, d, lk, w->vt);
        pack_panels(kb, sk, kn, d, w->kc);
        for (int c0 = 0; c0 < nq; c0 += MAXK) {
            const int cn = nq - c0 < MAXK ? nq - c0 : MAXK;
            const float *qc = q + (int64_t)c0 * sq, *gc = g + (int64_t)c0 * sg;
            gemm_panels(cn, njv, d, qc, sq, 1, w->kt, p, lk, 0);   /* scores */
            gemm_panels(cn, njv, d, gc, sg, 1, w->vt, dp, lk, 0);  /* dP = g v^T */
            for (int i = 0; i < cn; i++) {
                float *pr = p + (int64_t)i * lk, *dpr = dp + (int64_t)i * lk;
                touch_step(tp);
                const __m256 l = _mm256_set1_ps(lse[c0 + i]), dl = _mm256_set1_ps(delta[c0 + i]);
                for (int jv = 0; jv < njv; jv++) {
                    const __m256 pv = _mm256_and_ps(lanes8(kn - jv * 8),
                                                    exp2_ps8(_mm256_fmsub_ps(_mm256_loadu_ps(pr + jv * 8), cs, l)));
                    _mm256_storeu_ps(pr + jv * 8, pv);
                    _mm256_storeu_ps(dpr + jv * 8, _mm256_mul_ps(_mm256_mul_ps(pv, _mm256_sub_ps(_mm256_loadu_ps(dpr + jv * 8), dl)), sc));
                }
            }
            pack_panels(gc, sg, cn, d, w->gc);
            pack_panels(qc, sq, cn, d, w->qc);
            gemm_panels(cn, nd, kn, dp, lk, 1, w->kc, dq + (int64_t)c0 * sdq, sdq, j0 > 0);  /* dq += dS k */
            gemm_panels(kn, nd, cn, p, 1, lk, w->gc, dv + (int64_t)j0 * sdv, sdv, c0 > 0);   /* dv += P^T g */
            gemm_panels(kn, nd, cn, dp, 1, lk, w->qc, dk + (int64_t)j0 * sdk, sdk, c0 > 0);  /* dk += dS^T q */
        }
    }
}

/* The gradients of one (batch, head), any number of queries and keys; past MAXK of either the caller
   gives delta (each query's rowsum(g o)), which the short backward takes from the recomputed weights. */
static void head_backward(const float *q, int64_t sq, const float *k, int64_t sk, const float *v, int64_t sv,
                          const float *g, int64_t sg, const float *lse, const float *delta, float *dq, int64_t sdq,
                          float *dk, int64_t sdk, float *dv, int64_t sdv, int nq, int nk, int d, float c, float scale,
                          scratch_t *w, float *floats)
{
    if (nq > MAXK || nk > MAXK)
        head_backward_long(q, sq, k, sk, v, sv, g, sg, lse, delta, dq, sdq, dk, sdk, dv, sdv, nq, nk, d, c, scale, w);
    else
        head_backward_short(q, sq, k, sk, v, sv, g, sg, lse, delta, dq, sdq, dk, sdk, dv, sdv, nq, nk, d, c, scale, w,
                            floats);
}

static inline void products_on(void) {}
static inline void products_off(void) {}

#define ELEM float
#define DIM_MULTIPLE 8
#include "attention_driver.h"

/* As vs_attention_f32_fwd, with AVX2: head dims multiples of 8 up to 128, any number of queries and keys
   (past 256 keys, the online softmax over key blocks). Returns 0, -1 for a shape outside these, -2 when out
   of memory. */
int vs_attention_f32_avx2_fwd(const float *q, const float *k, const float *v, float *o, float *lse, int64_t b,
                              int64_t h, int64_t nq, int64_t nk, int64_t d, const int64_t *st, float scale, int threads)
{
    if (!shape_ok(b, h, nq, nk, d, threads, INT32_MAX, INT32_MAX)) return -1;
    const job_t j = {{q, k, v, NULL}, {o, NULL, NULL}, lse, NULL, st, h, nq, nk, d, scale * 1.4426950408889634f,
                     scale, nk > MAXK ? long_floats(nk, d) : 0};
    return each_head(&j, b, threads, forward_head);
}

/* As vs_attention_f32_bwd, with AVX2, any Nq and Nk; delta: NULL, or (B, H, Nq) float32, contiguous, each
   query's rowsum(g o), which past 256 queries or keys the blockwise backward needs (shorter sequences
   compute it from the recomputed weights, more closely, and ignore it). */
int vs_attention_f32_avx2_bwd(const float *q, const float *k, const float *v, const float *g, const float *lse,
                              const float *delta, float *dq, float *dk, float *dv, int64_t b, int64_t h, int64_t nq,
                              int64_t nk, int64_t d, const int64_t *st, float scale, int threads)
{
    if (!shape_ok(b, h, nq, nk, d, threads, INT32_MAX, INT32_MAX) || ((nq > MAXK || nk > MAXK) && !delta)) return -1;
    const job_t j = {{q, k, v, g}, {dq, dk, dv}, (float *)lse, delta, st, h, nq, nk, d, scale * 1.4426950408889634f,
                     scale, 0};
    return each_head(&j, b, threads, backward_head);
}
