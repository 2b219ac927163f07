/* The bfloat16 short-sequence attention kernels' body, shared by the AMX build (short_attention.c) and
   the AVX512-BF16 build (attention_bf16.c): the operand packing, the softmax, the forward and backward
   of one (batch, head), and the OpenMP driver. The file including this defines first the two products
   (`scores`, `times_pairs`), `products_on` / `products_off` around a thread's work, and the names of
   the entry points, ATTENTION_FWD and ATTENTION_BWD.

   Operands follow AMX's tile layouts whichever unit multiplies: an A operand is 16 rows of 32
   bfloat16 (a row stride in bytes), a B operand 16 rows of 16 dwords, each dword a pair of bfloat16
   along the sum. */
#ifndef VS_ATTENTION_BF16_H
#define VS_ATTENTION_BF16_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "touch.h"

#define MAXK 256
#define MAXD 128

/* y (n rows, d cols, row stride sy) as the B operand of x y^T: for 16 rows and 32 cols at a time, the
   16 x 16 transpose of (row, col pair) dwords. dst[(jb * (d / 32) + ds) * 256 + r * 16 + c]; rows
   past n are 0. */
static void pack_transposed(const uint16_t *y, int64_t sy, int n, int d, uint32_t *dst)
{
    const int nb = (n + 15) / 16, nds = d / 32;
    for (int jb = 0; jb < nb; jb++)
        for (int ds = 0; ds < nds; ds++) {
            __m512i r[16];
            for (int c = 0; c < 16; c++) {
                int row = jb * 16 + c;
                r[c] = row < n ? _mm512_loadu_si512(y + (int64_t)row * sy + ds * 32) : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int rr = 0; rr < 16; rr++) _mm512_store_si512(dst + (jb * nds + ds) * 256 + rr * 16, r[rr]);
        }
}

/* y (n rows, d cols) as the B operand of x y, the sum running over y's rows: rows 2r and 2r+1
   interleaved element by element, 16 cols a tile. dst[(js * (d / 16) + db) * 512 + r * 32 + 2c + p];
   rows past n are 0. */
static void pack_pairs(const uint16_t *y, int64_t sy, int n, int d, uint16_t *dst)
{
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const int ns = (n + 31) / 32, ndb = d / 16;
    for (int js = 0; js < ns; js++)
        for (int r = 0; r < 16; r++) {
            int k0 = js * 32 + 2 * r, k1 = k0 + 1;
            for (int e = 0; e < d / 32; e++) {
                __m512i a = k0 < n ? _mm512_loadu_si512(y + (int64_t)k0 * sy + e * 32) : _mm512_setzero_si512();
                __m512i b = k1 < n ? _mm512_loadu_si512(y + (int64_t)k1 * sy + e * 32) : _mm512_setzero_si512();
                _mm512_store_si512(dst + (js * ndb + 2 * e) * 512 + r * 32, _mm512_permutex2var_epi16(a, lo, b));
                _mm512_store_si512(dst + (js * ndb + 2 * e + 1) * 512 + r * 32, _mm512_permutex2var_epi16(a, hi, b));
            }
        }
}

/* x (rows, cols; both multiples of 32; row length lx) -> its transpose (row length ly), bfloat16. */
static void transpose_bf16(const uint16_t *x, int64_t lx, int rows, int cols, uint16_t *y, int64_t ly)
{
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    for (int i0 = 0; i0 < rows; i0 += 32)
        for (int j0 = 0; j0 < cols; j0 += 32) {
            __m512i a[16], b[16];
            for (int r = 0; r < 16; r++) {
                a[r] = _mm512_loadu_si512(x + (int64_t)(i0 + r) * lx + j0);
                b[r] = _mm512_loadu_si512(x + (int64_t)(i0 + 16 + r) * lx + j0);
            }
            transpose16(a);  /* a[m]: (x[c][j0 + 2m], x[c][j0 + 2m + 1]) for c = i0 .. i0 + 15 */
            transpose16(b);
            for (int m = 0; m < 16; m++) {
                _mm512_storeu_si512(y + (int64_t)(j0 + 2 * m) * ly + i0, _mm512_permutex2var_epi16(a[m], even, b[m]));
                _mm512_storeu_si512(y + (int64_t)(j0 + 2 * m + 1) * ly + i0, _mm512_permutex2var_epi16(a[m], odd, b[m]));
            }
        }
}

/* Rows [i0, i0 + 16) of x (n rows, d cols, stride sx) as an A operand: the rows themselves, or, for the
   last partial block, a copy in pad (16 x MAXD) whose rows past n hold whatever they held (zeros from the
   scratch's allocation, or rows of an earlier call): the products read them, but nothing computed from
   them is kept. Sets *stride in bytes. */
static const uint16_t *rows16(const uint16_t *x, int64_t sx, int i0, int n, int d, uint16_t *pad, int64_t *stride)
{
    if (n - i0 >= 16) {
        *stride = sx * 2;
        return x + (int64_t)i0 * sx;
    }
    for (int r = 0; r < n - i0; r++) memcpy(pad + r * MAXD, x + (int64_t)(i0 + r) * sx, (size_t)d * 2);
    *stride = MAXD * 2;
    return pad;
}

/* Rows [0, rows) of ob[cnt][16][16] (float32, times scale[r] when given) rounded into out's 16-col blocks
   db0 .. db0 + cnt - 1 (row stride so). */
static void store_rows(const float *ob, int cnt, int rows, const float *scale, uint16_t *out, int64_t so, int db0)
{
    for (int e = 0; e < cnt; e++)
        for (int r = 0; r < rows; r++) {
            __m512 y = _mm512_load_ps(ob + e * 256 + r * 16);
            if (scale) y = _mm512_mul_ps(y, _mm512_set1_ps(scale[r]));
            _mm256_storeu_si256((__m256i *)(out + (int64_t)r * so + (db0 + e) * 16), (__m256i)_mm512_cvtneps_pbh(y));
        }
}

static inline __mmask16 lanes(int n, int jv) { int left = n - jv * 16; return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

/* out (n rows, stride so) = a (bfloat16, row length la) times pair-packed y, 16 rows at a time, each row
   times scale[row] when scale is given. */
static void product_rows(const uint16_t *a, int64_t la, const uint16_t *yp, int ns, int kn, int ndb, int n,
                         const float *scale,
                         uint16_t *out, int64_t so, float *ob)
{
    for (int r0 = 0; r0 < n; r0 += 16) {
        const int rows = n - r0 < 16 ? n - r0 : 16;
        for (int db = 0; db < ndb; db += 4) {
            const int cnt = ndb - db < 4 ? ndb - db : 4;
            times_pairs(a + (int64_t)r0 * la, la * 2, rows, yp, ns, kn, ndb, db, cnt, ob);
            store_rows(ob, cnt, rows, scale ? scale + r0 : NULL, out + (int64_t)r0 * so, so, db);
        }
    }
}

/* acc (n rows of float32, row stride sa) = acc times alpha[row] (when given) + a (bfloat16, row length la)
   times pair-packed y, 16 rows at a time. */
static void accumulate_rows(const uint16_t *a, int64_t la, const uint16_t *yp, int ns, int kn, int ndb, int n,
                            const float *alpha, float *acc, int64_t sa, float *ob)
{
    for (int r0 = 0; r0 < n; r0 += 16) {
        const int rows = n - r0 < 16 ? n - r0 : 16;
        for (int db = 0; db < ndb; db += 4) {
            const int cnt = ndb - db < 4 ? ndb - db : 4;
            times_pairs(a + (int64_t)r0 * la, la * 2, rows, yp, ns, kn, ndb, db, cnt, ob);
            for (int e = 0; e < cnt; e++)
                for (int r = 0; r < rows; r++) {
                    float *x = acc + (int64_t)(r0 + r) * sa + (db + e) * 16;
                    const __m512 y = _mm512_load_ps(ob + e * 256 + r * 16);
                    _mm512_storeu_ps(x, alpha ? _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_set1_ps(alpha[r0 + r]), y)
                                              : _mm512_add_ps(_mm512_loadu_ps(x), y));
                }
        }
    }
}

/* out (n rows, stride so, bfloat16) = acc (float32, row stride sa) times scale[row] when given. */
static void store_acc(const float *acc, int64_t sa, int n, int ndb, const float *scale, uint16_t *out, int64_t so)
{
    for (int r = 0; r < n; r++) {
        const __m512 f = _mm512_set1_ps(scale ? scale[r] : 1.0f);
        for (int db = 0; db < ndb; db++)
            _mm256_storeu_si256((__m256i *)(out + (int64_t)r * so + db * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)r * sa + db * 16), f)));
    }
}

/* Per-thread scratch, sized for MAXK keys, MAXK queries and MAXD dims. */
typedef struct {
    uint32_t kt[MAXK / 16 * MAXD / 32 * 256], vt[MAXK / 16 * MAXD / 32 * 256];
    uint16_t kp[MAXK / 32 * MAXD / 16 * 512], qp[MAXK / 32 * MAXD / 16 * 512], dop[MAXK / 32 * MAXD / 16 * 512];
    uint16_t p[MAXK * MAXK], dsm[MAXK * MAXK], pt[MAXK * MAXK], dst[MAXK * MAXK];
    float s[16 * MAXK], dp[16 * MAXK], ob[4 * 16 * 16], inv[MAXK];
    uint16_t qpad[16 * MAXD], dopad[16 * MAXD];
    float acc[MAXK * MAXD], acc2[MAXK * MAXD];  /* the long passes' float32 sums: output, or dk and dv */
    float mx[MAXK], sum[MAXK], alpha[MAXK];      /* the long forward's running maximum, sum, rescaling */
} scratch_t;

/* The largest of a row's nk scores sr times c (float32; c may be negative, or 0). The scores are not
   scaled in place: the weights take c inside their exponent's multiply-add. */
static inline float row_max(const float *sr, int nk, float c)
{
    const int full = nk / 16;
    const __mmask16 tail = lanes(nk, full);
    __m512 hi = _mm512_set1_ps(-INFINITY), lo = _mm512_set1_ps(INFINITY);
    if (c >= 0.0f) {
        for (int jv = 0; jv < full; jv++) hi = _mm512_max_ps(hi, _mm512_load_ps(sr + jv * 16));
        if (nk % 16) hi = _mm512_mask_max_ps(hi, tail, hi, _mm512_load_ps(sr + full * 16));
        return c * _mm512_reduce_max_ps(hi);
    }
    for (int jv = 0; jv < full; jv++) lo = _mm512_min_ps(lo, _mm512_load_ps(sr + jv * 16));
    if (nk % 16) lo = _mm512_mask_min_ps(lo, tail, lo, _mm512_load_ps(sr + full * 16));
    return c * _mm512_reduce_min_ps(lo);
}

/* The row's unnormalised weights exp2(c sr - mx), rounded to bfloat16 into pr (0 past nk, to an even
   number of 16-blocks); returns their float32 sum. */
static inline float weights_row(const float *sr, int njb, int nk, __m512 cs, float mx, uint16_t *pr)
{
    const int full = nk / 16;
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int jv = 0; jv < full; jv++) {
        const __m512 e = exp2_quick_ps(_mm512_fmsub_ps(_mm512_load_ps(sr + jv * 16), cs, m));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(pr + jv * 16), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (nk % 16) {
        const __m512 e = _mm512_maskz_mov_ps(lanes(nk, full), exp2_quick_ps(_mm512_fmsub_ps(_mm512_load_ps(sr + full * 16), cs, m)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(pr + full * 16), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (njb & 1) _mm256_storeu_si256((__m256i *)(pr + njb * 16), _mm256_setzero_si256());
    return _mm512_reduce_add_ps(sum);
}

/* o = softmax(scale q k^T) v for one (batch, head). q (nq, d), k and v (nk, d), o (nq, d); rows at the
   given strides (elements), the last dim contiguous. With lse, also each query's log2-sum-exp2 of
   its scores times c = scale log2(e), for the backward. */
static void head_forward_short(const uint16_t *q, int64_t sq, const uint16_t *k, int64_t sk, const uint16_t *v,
                               int64_t sv, uint16_t *o, int64_t so, float *lse, int nq, int nk, int d, float c,
                               scratch_t *w)
{
    const int njb = (nk + 15) / 16, njs = (nk + 31) / 32, ndb = d / 16, lk = njs * 32;
    float *s = w->s;
    const __m512 cs = _mm512_set1_ps(c);
    pack_transposed(k, sk, nk, d, w->kt);
    pack_pairs(v, sv, nk, d, w->kp);
    touch_t *const tp = touch_plan(nq);  /* the next head's rows, a few lines with each query's softmax (touch.h) */
    /* Up to MAXK queries at a time: first their weights (unnormalised, bfloat16, rows of lk), then the
       product with v in its own pass, so each pass's packed operand stays in L1. */
    for (int c0 = 0; c0 < nq; c0 += MAXK) {
        const int cn = nq - c0 < MAXK ? nq - c0 : MAXK;
        const uint16_t *qc = q + (int64_t)c0 * sq;
        for (int i0 = 0; i0 < cn; i0 += 16) {
            const int rows = cn - i0 < 16 ? cn - i0 : 16;
            int64_t qs;
            const uint16_t *qa = rows16(qc, sq, i0, cn, d, w->qpad, &qs);
            scores(qa, qs, rows, w->kt, njb, d, s, MAXK);
            /* Rows past nq are skipped: whatever their weights hold only reaches their own output rows,
               which are never stored. Columns past nk get weight 0 (and v's padding rows are 0). */
            for (int r = 0; r < rows; r++) {
                float *sr = s + r * MAXK;
                const float mx = row_max(sr, nk, c);
                touch_step(tp);
                w->mx[r] = mx;
                w->sum[r] = weights_row(sr, njb, nk, cs, mx, w->p + (int64_t)(i0 + r) * lk);
            }
            /* The block's 16 reciprocals and log-sum-exps at once, off the rows' chain of reductions. */
            const __mmask16 m = lanes(rows, 0);
            const __m512 total = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), m, w->sum);
            _mm512_storeu_ps(w->inv + i0, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
            if (lse)
                _mm512_mask_storeu_ps(lse + c0 + i0, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, w->mx), log2_ps(total)));
        }
        product_rows(w->p, lk, w->kp, njs, nk, ndb, cn, w->inv, o + (int64_t)c0 * so, so, w->ob);
    }
}

/* head_forward_short for more than MAXK keys (inference, and the forward of nothing the backward takes):
   flash attention's online softmax over blocks of MAXK keys. For each chunk of up to MAXK queries, the
   running maximum and sum of each query's weights and its unnormalised output (float32, in scratch)
   are carried from key block to key block; a block's weights are taken against the maximum so far,
   and what was accumulated before is rescaled by exp2(old max - new max) when the maximum grows. The
   keys and values of a block are packed once per query chunk. */
static void head_forward_long(const uint16_t *q, int64_t sq, const uint16_t *k, int64_t sk, const uint16_t *v,
                              int64_t sv, uint16_t *o, int64_t so, float *lse, int nq, int nk, int d, float c,
                              scratch_t *w)
{
    const int ndb = d / 16;
    float *s = w->s;
    const __m512 cs = _mm512_set1_ps(c);
    touch_t *const tp = touch_plan((int64_t)nq * ((nk + MAXK - 1) / MAXK));
    for (int c0 = 0; c0 < nq; c0 += MAXK) {
        const int cn = nq - c0 < MAXK ? nq - c0 : MAXK;
        const uint16_t *qc = q + (int64_t)c0 * sq;
        for (int r = 0; r < cn; r++) {
            w->mx[r] = -INFINITY;
            w->sum[r] = 0.0f;
        }
        memset(w->acc, 0, (size_t)cn * MAXD * sizeof(float));
        for (int j0 = 0; j0 < nk; j0 += MAXK) {
            const int kn = nk - j0 < MAXK ? nk - j0 : MAXK;
            const int njb = (kn + 15) / 16, njs = (kn + 31) / 32, lk = njs * 32;
            pack_transposed(k + (int64_t)j0 * sk, sk, kn, d, w->kt);
            pack_pairs(v + (int64_t)j0 * sv, sv, kn, d, w->kp);
            for (int i0 = 0; i0 < cn; i0 += 16) {
                const int rows = cn - i0 < 16 ? cn - i0 : 16;
                int64_t qs;
                const uint16_t *qa = rows16(qc, sq, i0, cn, d, w->qpad, &qs);
                scores(qa, qs, rows, w->kt, njb, d, s, MAXK);
                for (int r = 0; r < rows; r++) {
                    float *sr = s + r * MAXK;
                    uint16_t *pr = w->p + (int64_t)(i0 + r) * lk;
                    const float old = w->mx[i0 + r], block = row_max(sr, kn, c);
                    touch_step(tp);
                    const float mx = old > block ? old : block;
                    const float total = weights_row(sr, njb, kn, cs, mx, pr);
                    const float alpha = old == -INFINITY ? 0.0f : exp2f(old - mx);
                    w->alpha[i0 + r] = alpha;
                    w->sum[i0 + r] = w->sum[i0 + r] * alpha + total;
                    w->mx[i0 + r] = mx;
                }
            }
            accumulate_rows(w->p, lk, w->kp, njs, kn, ndb, cn, w->alpha, w->acc, MAXD, w->ob);  /* acc = acc alpha + P v */
        }
        for (int r = 0; r < cn; r++) {
            w->alpha[r] = 1.0f / w->sum[r];
            if (lse) lse[c0 + r] = w->mx[r] + log2f(w->sum[r]);
        }
        store_acc(w->acc, MAXD, cn, ndb, w->alpha, o + (int64_t)c0 * so, so);
    }
}

/* o = softmax(scale q k^T) v for one (batch, head), any number of keys. */
static void head_forward(const uint16_t *q, int64_t sq, const uint16_t *k, int64_t sk, const uint16_t *v, int64_t sv,
                         uint16_t *o, int64_t so, float *lse, int nq, int nk, int d, float c, scratch_t *w,
                         float *floats)
{
    (void)floats;  /* the job asks for none */
    (nk > MAXK ? head_forward_long : head_forward_short)(q, sq, k, sk, v, sv, o, so, lse, nq, nk, d, c, w);
}

/* For the 16 queries from i0 of a chunk of n: with `zero`, clear their rows of P and dS past the chunk
   (they enter the sums over queries), and compute the scores q k^T (into w->s) and dP = g v^T (w->dp)
   of those that are queries, from the packed kt and vt. Returns how many of the 16 are queries. */
static int block_scores(const uint16_t *q, int64_t sq, const uint16_t *g, int64_t sg, int i0, int n, int njb, int d,
                        int lk, int zero, scratch_t *w)
{
    const int rows = n - i0 < 0 ? 0 : (n - i0 < 16 ? n - i0 : 16);
    if (zero && rows < 16) {
        memset(w->p + (int64_t)(i0 + rows) * lk, 0, (size_t)(16 - rows) * lk * 2);
        memset(w->dsm + (int64_t)(i0 + rows) * lk, 0, (size_t)(16 - rows) * lk * 2);
    }
    if (rows) {
        int64_t qs, gs;
        const uint16_t *qa = rows16(q, sq, i0, n, d, w->qpad, &qs), *ga = rows16(g, sg, i0, n, d, w->dopad, &gs);
        scores(qa, qs, rows, w->kt, njb, d, w->s, MAXK);
        scores(ga, gs, rows, w->vt, njb, d, w->dp, MAXK);
    }
    return rows;
}

/* The gradients of one (batch, head) from its output's gradient g (nq, d): with P = exp2(c s - lse)
   recomputed from q and k, dv = P^T g, dP = g v^T, dS = scale P (dP - delta) with delta = rowsum(P dP),
   dq = dS k, dk = dS^T q. */
static void head_backward_short(const uint16_t *q, int64_t sq, const uint16_t *k, int64_t sk, const uint16_t *v,
                                int64_t sv, const uint16_t *g, int64_t sg, const float *lse,
                                uint16_t *dq, int64_t sdq, uint16_t *dk, int64_t sdk, uint16_t *dv, int64_t sdv,
                                int nq, int nk, int d, float c, float scale, scratch_t *w)
{
    const int njb = (nk + 15) / 16, njs = (nk + 31) / 32, nis = (nq + 31) / 32, ndb = d / 16;
    const int lk = njs * 32, lq = nis * 32;  /* row lengths of P, dS (lk) and their transposes (lq) */
    float *s = w->s, *dp = w->dp, *ob = w->ob;
    pack_transposed(k, sk, nk, d, w->kt);
    pack_transposed(v, sv, nk, d, w->vt);
    pack_pairs(k, sk, nk, d, w->kp);
    pack_pairs(q, sq, nq, d, w->qp);
    pack_pairs(g, sg, nq, d, w->dop);
    const __m512 cs = _mm512_set1_ps(c), sc = _mm512_set1_ps(scale);
    touch_t *const tp = touch_plan(nq);
    for (int i0 = 0; i0 < lq; i0 += 16) {
        uint16_t *p = w->p + (int64_t)i0 * lk, *dsm = w->dsm + (int64_t)i0 * lk;
        const int rows = block_scores(q, sq, g, sg, i0, nq, njb, d, lk, 1, w);
        if (rows == 0) continue;
        for (int r = 0; r < rows; r++) {
            /* delta = sum_j P dP in float32 from the recomputed weights: closer than rowsum(g o) from the
               rounded output, where dP - delta cancels. */
            float *sr = s + r * MAXK, *dpr = dp + r * MAXK;
            const __m512 l = _mm512_set1_ps(lse[i0 + r]);
            touch_step(tp);
            __m512 acc = _mm512_setzero_ps();
            for (int jv = 0; jv < njb; jv++) {
                __m512 pr = _mm512_maskz_mov_ps(lanes(nk, jv), exp2_quick_ps(_mm512_fmsub_ps(_mm512_load_ps(sr + jv * 16), cs, l)));
                _mm512_store_ps(sr + jv * 16, pr);
                _mm256_store_si256((__m256i *)(p + r * lk + jv * 16), (__m256i)_mm512_cvtneps_pbh(pr));
                acc = _mm512_fmadd_ps(pr, _mm512_load_ps(dpr + jv * 16), acc);
            }
            const __m512 dl = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
            for (int jv = 0; jv < njb; jv++) {
                __m512 pr = _mm512_load_ps(sr + jv * 16);
                __m512 dsr = _mm512_mul_ps(_mm512_mul_ps(pr, _mm512_sub_ps(_mm512_load_ps(dpr + jv * 16), dl)), sc);
                _mm256_store_si256((__m256i *)(dsm + r * lk + jv * 16), (__m256i)_mm512_cvtneps_pbh(dsr));
            }
            if (njb & 1) {
                _mm256_store_si256((__m256i *)(p + r * lk + njb * 16), _mm256_setzero_si256());
                _mm256_store_si256((__m256i *)(dsm + r * lk + njb * 16), _mm256_setzero_si256());
            }
        }
    }
    /* Each product in its own pass, so that its packed B operand (up to 64 KB at 256 keys and 128 dims,
       28 KB for ViT-S/16) stays in L1 across the row blocks instead of alternating with another. */
    product_rows(w->dsm, lk, w->kp, njs, nk, ndb, nq, NULL, dq, sdq, ob);   /* dq = dS k */
    transpose_bf16(w->p, lk, lq, lk, w->pt, lq);
    transpose_bf16(w->dsm, lk, lq, lk, w->dst, lq);
    product_rows(w->pt, lq, w->dop, nis, nq, ndb, nk, NULL, dv, sdv, ob);   /* dv = P^T g */
    product_rows(w->dst, lq, w->qp, nis, nq, ndb, nk, NULL, dk, sdk, ob);   /* dk = dS^T q */
}

/* The backward for more than MAXK queries or keys, flash attention's way: for each block of up to MAXK
   keys and each chunk of up to MAXK queries, the weights are recomputed from lse, and the block's
   share of dq (kept in float32 for all queries, in `dq_acc`: nq x MAXD floats), dk and dv (float32,
   in scratch, for the block) is added. delta = rowsum(P dP) runs over all keys: `given` (nq floats:
   rowsum(g o), from the output), or else a first pass sums it over the key blocks (into `delta`, nq
   floats) before the second uses it. */
static void head_backward_long(const uint16_t *q, int64_t sq, const uint16_t *k, int64_t sk, const uint16_t *v,
                               int64_t sv, const uint16_t *g, int64_t sg, const float *lse,
                               uint16_t *dq, int64_t sdq, uint16_t *dk, int64_t sdk, uint16_t *dv, int64_t sdv,
                               int nq, int nk, int d, float c, float scale, scratch_t *w, float *dq_acc, float *delta,
                               const float *given)
{
    const int ndb = d / 16;
    float *s = w->s, *dp = w->dp;
    const __m512 cs = _mm512_set1_ps(c), sc = _mm512_set1_ps(scale);
    memset(dq_acc, 0, (size_t)nq * MAXD * sizeof(float));
    if (given)
        memcpy(delta, given, (size_t)nq * sizeof(float));
    else
        memset(delta, 0, (size_t)nq * sizeof(float));
    touch_t *const tp = touch_plan((int64_t)(given ? 1 : 2) * ((nk + MAXK - 1) / MAXK) * nq);
    for (int pass = given ? 1 : 0; pass < 2; pass++)
        for (int j0 = 0; j0 < nk; j0 += MAXK) {
            const int kn = nk - j0 < MAXK ? nk - j0 : MAXK;
            const int njb = (kn + 15) / 16, njs = (kn + 31) / 32, lk = njs * 32;
            const uint16_t *kb = k + (int64_t)j0 * sk;
            pack_transposed(kb, sk, kn, d, w->kt);
            pack_transposed(v + (int64_t)j0 * sv, sv, kn, d, w->vt);
            if (pass) {
                pack_pairs(kb, sk, kn, d, w->kp);
                memset(w->acc, 0, (size_t)kn * MAXD * sizeof(float));
                memset(w->acc2, 0, (size_t)kn * MAXD * sizeof(float));
            }
            for (int c0 = 0; c0 < nq; c0 += MAXK) {
                const int cn = nq - c0 < MAXK ? nq - c0 : MAXK, nis = (cn + 31) / 32, lq = nis * 32;
                const uint16_t *qc = q + (int64_t)c0 * sq, *gc = g + (int64_t)c0 * sg;
                if (pass) {
                    pack_pairs(qc, sq, cn, d, w->qp);
                    pack_pairs(gc, sg, cn, d, w->dop);
                }
                for (int i0 = 0; i0 < lq; i0 += 16) {
                    uint16_t *p = w->p + (int64_t)i0 * lk, *dsm = w->dsm + (int64_t)i0 * lk;
                    const int rows = block_scores(qc, sq, gc, sg, i0, cn, njb, d, lk, pass, w);
                    if (rows == 0) continue;
                    for (int r = 0; r < rows; r++) {
                        const float *sr = s + r * MAXK, *dpr = dp + r * MAXK;
                        const __m512 l = _mm512_set1_ps(lse[c0 + i0 + r]), dl = _mm512_set1_ps(delta[c0 + i0 + r]);
                        touch_step(tp);
                        __m512 acc = _mm512_setzero_ps();
                        for (int jv = 0; jv < njb; jv++) {
                            const __m512 pr = _mm512_maskz_mov_ps(lanes(kn, jv), exp2_quick_ps(_mm512_fmsub_ps(_mm512_load_ps(sr + jv * 16), cs, l)));
                            if (!pass) {
                                acc = _mm512_fmadd_ps(pr, _mm512_load_ps(dpr + jv * 16), acc);
                                continue;
                            }
                            const __m512 dsr = _mm512_mul_ps(_mm512_mul_ps(pr, _mm512_sub_ps(_mm512_load_ps(dpr + jv * 16), dl)), sc);
                            _mm256_store_si256((__m256i *)(p + r * lk + jv * 16), (__m256i)_mm512_cvtneps_pbh(pr));
                            _mm256_store_si256((__m256i *)(dsm + r * lk + jv * 16), (__m256i)_mm512_cvtneps_pbh(dsr));
                        }
                        if (!pass) delta[c0 + i0 + r] += _mm512_reduce_add_ps(acc);
                        else if (njb & 1) {
                            _mm256_store_si256((__m256i *)(p + r * lk + njb * 16), _mm256_setzero_si256());
                            _mm256_store_si256((__m256i *)(dsm + r * lk + njb * 16), _mm256_setzero_si256());
                        }
                    }
                }
                if (!pass) continue;
                accumulate_rows(w->dsm, lk, w->kp, njs, kn, ndb, cn, NULL, dq_acc + (int64_t)c0 * MAXD, MAXD, w->ob);
                transpose_bf16(w->p, lk, lq, lk, w->pt, lq);
                transpose_bf16(w->dsm, lk, lq, lk, w->dst, lq);
                accumulate_rows(w->pt, lq, w->dop, nis, cn, ndb, kn, NULL, w->acc2, MAXD, w->ob);  /* dv += P^T g */
                accumulate_rows(w->dst, lq, w->qp, nis, cn, ndb, kn, NULL, w->acc, MAXD, w->ob);   /* dk += dS^T q */
            }
            if (pass) {
                store_acc(w->acc, MAXD, kn, ndb, NULL, dk + (int64_t)j0 * sdk, sdk);
                store_acc(w->acc2, MAXD, kn, ndb, NULL, dv + (int64_t)j0 * sdv, sdv);
            }
        }
    store_acc(dq_acc, MAXD, nq, ndb, NULL, dq, sdq);
}

/* The floats head_backward_long needs beside the scratch (0 where the short backward runs). */
static int64_t backward_floats(int64_t nq, int64_t nk) { return nq > MAXK || nk > MAXK ? nq * (MAXD + 1) : 0; }

/* The gradients of one (batch, head), any number of queries and keys; `floats` as backward_floats,
   `delta` each query's rowsum(g o) or NULL (the short backward computes its own). */
static void head_backward(const uint16_t *q, int64_t sq, const uint16_t *k, int64_t sk, const uint16_t *v, int64_t sv,
                          const uint16_t *g, int64_t sg, const float *lse, const float *delta, uint16_t *dq,
                          int64_t sdq, uint16_t *dk, int64_t sdk, uint16_t *dv, int64_t sdv, int nq, int nk, int d,
                          float c, float scale, scratch_t *w, float *floats)
{
    if (!floats)
        head_backward_short(q, sq, k, sk, v, sv, g, sg, lse, dq, sdq, dk, sdk, dv, sdv, nq, nk, d, c, scale, w);
    else
        head_backward_long(q, sq, k, sk, v, sv, g, sg, lse, dq, sdq, dk, sdk, dv, sdv, nq, nk, d, c, scale, w, floats,
                           floats + (int64_t)nq * MAXD, delta);
}

#define ELEM uint16_t
#define DIM_MULTIPLE 32
#include "attention_driver.h"

/* q, k, v, o: (B, H, N, D) bf16 at strides st[0..2] (q), st[3..5] (k), st[6..8] (v), st[9..11] (o);
   lse: NULL, or (B, H, Nq) float32, contiguous, for the backward. Runs on `threads` OpenMP threads.
   Returns 0, -1 when the shape is outside what the kernel handles, -2 when out of memory. */
int ATTENTION_FWD(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *o, float *lse,
                     int64_t b, int64_t h, int64_t nq, int64_t nk, int64_t d, const int64_t *st, float scale,
                     int threads)
{
    if (!shape_ok(b, h, nq, nk, d, threads, INT32_MAX, INT32_MAX)) return -1;
    const job_t j = {{q, k, v, NULL}, {o, NULL, NULL}, lse, NULL, st, h, nq, nk, d,
                     scale * 1.4426950408889634f /* scores go to exp2 */, scale, 0};
    return each_head(&j, b, threads, forward_head);
}

/* The backward of ATTENTION_FWD: q, k, v, g (the output's gradient), dq, dk, dv, all (B, H, N, D) bf16
   at strides st[0..2], st[3..5], ..., st[18..20] in that order; lse from the forward; delta: NULL, or
   (B, H, Nq) float32, contiguous, each query's rowsum(g o), which past 256 queries or keys saves a pass
   (shorter sequences compute it from the recomputed weights, more closely). Any Nq and Nk. */
int ATTENTION_BWD(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *g,
                     const float *lse, const float *delta, uint16_t *dq, uint16_t *dk, uint16_t *dv, int64_t b,
                     int64_t h, int64_t nq, int64_t nk, int64_t d, const int64_t *st, float scale, int threads)
{
    if (!shape_ok(b, h, nq, nk, d, threads, INT32_MAX, INT32_MAX)) return -1;
    const job_t j = {{q, k, v, g}, {dq, dk, dv}, (float *)lse, delta, st, h, nq, nk, d, scale * 1.4426950408889634f,
                     scale, backward_floats(nq, nk)};
    return each_head(&j, b, threads, backward_head);
}

#endif
