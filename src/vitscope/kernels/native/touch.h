/* Bringing the next (batch, head)'s input rows into cache while this one computes, a few lines at a time.

   The attention kernels' q, k, v (and g) rows lie a row stride apart (the heads of one fused qkv
   projection's output), which the hardware prefetchers do not follow. Reading all of a head's lines in
   one burst before it (as an earlier version did) is held back by the core's outstanding misses: at ViT-S/16's
   197 tokens of 64 dims the forward took 70-75 µs a head and thread from memory against 58-59 in
   cache, and reading the head two ahead measured no better than reading the head itself right before
   computing it. Spread over the softmax's rows, a few lines per row, the fetches overlap the
   arithmetic: forward 62-66 µs, backward 150-152 against 158-177, and the plain 28x28 ViT's
   3.4-3.7 µs forward against 3.7-4.8 (docs/performance.md; a layer on 2 threads, Zen 4).

   Prefetch instructions, not loads: spread over the rows, loads were as fast only where the compiler
   unrolled the loop that issues them; as a loop they made the forward 1.45x slower (93 µs), while a
   loop of prefetches is not (64). Into L2 (T1): T0 and T2 measured the same within the noise.

   The heads' outputs (o, or dq, dk and dv) are fetched the same way, for writing (prefetchw): each row of a
   head's output is a line of its own, and its stores had waited on reading it first. The plain 28x28 ViT's
   attention alone (256 x 4 heads of 50 tokens, one layer on 2 threads) ran its backward 1.03-1.05x and its
   forward 1.00-1.04x; ViT-S/16's (32 x 6 heads of 197) stayed within 1% either way (Zen 4;
   docs/performance.md).

   The driver names the next head (touch_next) and, before starting it, issues whatever was not yet
   fetched (touch_rest); a head function says how many steps it will take (touch_plan, which returns the
   thread's state) and calls touch_step with that state at each. */
#ifndef VS_TOUCH_H
#define VS_TOUCH_H

#include <immintrin.h>
#include <stdint.h>

typedef struct {
    const uint8_t *base[7];
    int64_t rows[7], stride[7];  /* each tensor's rows and their stride in bytes */
    int tensors, lines;          /* how many tensors; cache lines per row */
    int reads;                   /* tensors [0, reads) are read, the rest written */
    int t, e;                    /* the next line: tensor t, row r, line e of the row */
    int64_t r;
    int64_t per_step;
} touch_t;

static __thread touch_t touch_pending;

#ifndef TOUCH_HINT
#define TOUCH_HINT _MM_HINT_T1
#endif

/* Names the rows to fetch next: `tensors` tensors (up to 7), each rows[t] rows of `bytes` bytes at
   base[t], stride[t] bytes apart; the first `reads` are read, the others will be written (fetched for
   writing). */
static void touch_next(int tensors, int reads, const void *const *base, const int64_t *rows, const int64_t *stride,
                       int64_t bytes)
{
    touch_t *p = &touch_pending;
    p->tensors = tensors;
    p->reads = reads;
    p->lines = (int)((bytes + 63) / 64);
    p->t = 0, p->e = 0, p->r = 0;
    p->per_step = 0;
    for (int t = 0; t < tensors; t++) {
        p->base[t] = (const uint8_t *)base[t];
        p->rows[t] = rows[t];
        p->stride[t] = stride[t];
    }
}

static void touch_none(void) { touch_pending.tensors = 0; }

/* Prefetches up to n more of the lines named in p. */
static void touch_lines(touch_t *p, int64_t n)
{
    int t = p->t, e = p->e;
    int64_t r = p->r;
    if (t >= p->tensors) return;
    const uint8_t *row = p->base[t] + r * p->stride[t];
    for (; n > 0; n--) {
        if (t < p->reads) _mm_prefetch((const char *)(row + e * 64), TOUCH_HINT);
        else _mm_prefetch((const char *)(row + e * 64), _MM_HINT_ET0);
        if (++e < p->lines) continue;
        e = 0;
        if (++r == p->rows[t]) {
            r = 0;
            if (++t == p->tensors) break;
        }
        row = p->base[t] + r * p->stride[t];
    }
    p->t = t, p->e = e, p->r = r;
}

static void touch_rest(void) { touch_lines(&touch_pending, INT64_MAX); }

/* The lines left spread over `steps` calls of touch_step, which takes the state returned: a head
   function looks up this thread's state once, here, not at every step (each lookup of a thread-local
   variable in a shared library is a call to __tls_get_addr: at the plain 28x28 ViT's 50-token heads,
   looked up at every step, they took the forward 1.13x and the backward 1.05x the time). */
static touch_t *touch_plan(int64_t steps)
{
    touch_t *p = &touch_pending;
    int64_t left = 0;
    for (int t = p->t; t < p->tensors; t++) left += p->rows[t] * p->lines;
    if (p->t < p->tensors) left -= p->r * p->lines + p->e;
    p->per_step = steps > 0 ? (left + steps - 1) / steps : left;
    return p;
}

static inline void touch_step(touch_t *p)
{
    if (p->t < p->tensors) touch_lines(p, p->per_step);
}

#endif
