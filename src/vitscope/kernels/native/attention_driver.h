/* The per-(batch, head) driver shared by vitscope's attention kernels (attention_f32.c, and
   attention_bf16.h for the AMX and AVX512-BF16 builds): each call's operands, each thread's scratch,
   the shape check and the OpenMP loop over heads.

   The file including this defines first: ELEM (the element type), DIM_MULTIPLE (the head dims it
   takes are multiples of this, up to MAXD), scratch_t, head_forward and head_backward (one (batch,
   head) each, at row strides in elements, and a thread's buffer of the job's `floats`; the backward also
   gets the head's rows of the job's delta; each NULL when there is none), and products_on / products_off
   around a thread's work. */
#ifndef VS_ATTENTION_DRIVER_H
#define VS_ATTENTION_DRIVER_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "subnormals.h"
#include "touch.h"

/* Each thread's scratch, allocated and zeroed on its first call and kept (about 1 MB a thread). */
static scratch_t *scratch(void)
{
    static __thread scratch_t *w;
    if (!w) {
        const size_t size = (sizeof(scratch_t) + 63) / 64 * 64;
        w = aligned_alloc(64, size);
        if (w) memset(w, 0, size);
    }
    return w;
}

static int shape_ok(int64_t b, int64_t h, int64_t nq, int64_t nk, int64_t d, int threads, int64_t max_q, int64_t max_k)
{
    return nk >= 1 && nk <= max_k && nq >= 1 && nq <= max_q && d % DIM_MULTIPLE == 0 && d >= DIM_MULTIPLE &&
           d <= MAXD && b >= 1 && h >= 1 && threads >= 1;
}

/* One call's operands: up to seven (B, H, N, D) tensors at strides st[3t .. 3t + 2]. */
typedef struct {
    const ELEM *in[4]; /* q, k, v, and for the backward g */
    ELEM *out[3];      /* o, or dq, dk, dv */
    float *lse;
    const float *delta; /* for the backward: each query's rowsum(g o), or NULL */
    const int64_t *st;
    int64_t h, nq, nk, d;
    float c, scale;
    int64_t floats;    /* float32 scratch per thread beyond scratch_t (0: none) */
} job_t;

/* This thread's buffer of at least n floats, kept and grown from call to call; NULL when out of memory. */
static float *thread_floats(int64_t n)
{
    static __thread float *buf;
    static __thread int64_t cap;
    if (n > cap) {
        free(buf);
        buf = aligned_alloc(64, ((size_t)n * sizeof(float) + 63) / 64 * 64);
        cap = buf ? n : 0;
    }
    return buf;
}

/* The (batch, head)'s rows of the tensor at stride slot t. */
#define AT(x, t) ((x) + bi * j->st[3 * (t)] + hi * j->st[3 * (t) + 1])
#define ROW(t) (j->st[3 * (t) + 2])

/* Names the (batch, head)'s input rows (q, k, v and for the backward g) as the next to read
   (touch.h): the head computing now fetches them a few lines at a time. */
static void touch_head(const job_t *j, int64_t bh)
{
    const int64_t bi = bh / j->h, hi = bh % j->h;
    const int n = j->in[3] ? 4 : 3, outs = j->in[3] ? 3 : 1;
    const void *base[7];
    int64_t rows[7], stride[7];
    for (int t = 0; t < n + outs; t++) {
        base[t] = t < n ? (const void *)AT(j->in[t], t) : (const void *)AT(j->out[t - n], t);
        const int kv = t < n ? t == 1 || t == 2 : t - n == 1 || t - n == 2;  /* k, v, dk, dv: nk rows */
        rows[t] = kv ? j->nk : j->nq;
        stride[t] = ROW(t) * (int64_t)sizeof(ELEM);
    }
    touch_next(n + outs, n, base, rows, stride, j->d * (int64_t)sizeof(ELEM));
}

static void forward_head(const job_t *j, int64_t bh, scratch_t *w)
{
    const int64_t bi = bh / j->h, hi = bh % j->h;
    head_forward(AT(j->in[0], 0), ROW(0), AT(j->in[1], 1), ROW(1), AT(j->in[2], 2), ROW(2), AT(j->out[0], 3), ROW(3),
                 j->lse ? j->lse + bh * j->nq : NULL, (int)j->nq, (int)j->nk, (int)j->d, j->c, w,
                 j->floats ? thread_floats(j->floats) : NULL);
}

static void backward_head(const job_t *j, int64_t bh, scratch_t *w)
{
    const int64_t bi = bh / j->h, hi = bh % j->h;
    head_backward(AT(j->in[0], 0), ROW(0), AT(j->in[1], 1), ROW(1), AT(j->in[2], 2), ROW(2), AT(j->in[3], 3), ROW(3),
                  j->lse + bh * j->nq, j->delta ? j->delta + bh * j->nq : NULL, AT(j->out[0], 4), ROW(4), AT(j->out[1], 5), ROW(5), AT(j->out[2], 6), ROW(6),
                  (int)j->nq, (int)j->nk, (int)j->d, j->c, j->scale, w, j->floats ? thread_floats(j->floats) : NULL);
}

/* Runs `head` for every (batch, head) on `threads` OpenMP threads, each with its scratch, its product
   unit's state (AMX's tile config) and subnormals off. Returns 0, or -2 when a thread's scratch (or
   its buffer of the job's floats) could not be allocated. */
static int each_head(const job_t *j, int64_t b, int threads, void (*head)(const job_t *, int64_t, scratch_t *))
{
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        scratch_t *w = scratch();
        if (!w || (j->floats && !thread_floats(j->floats))) failed = 1;
        else {
            products_on();
            const unsigned csr = subnormals_off();
            /* Each thread a contiguous run of heads; while one computes, the next one's rows are read. */
            const int64_t n = b * j->h, t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t first = n * t / nt, end = n * (t + 1) / nt;
            if (first < end) touch_head(j, first);
            for (int64_t bh = first; bh < end; bh++) {
                touch_rest();
                if (bh + 1 < end) touch_head(j, bh + 1);
                else touch_none();
                head(j, bh, w);
            }
            products_off();
            subnormals_restore(csr);
        }
    }
    return failed ? -2 : 0;
}

#endif
