/* Times vitscope's AVX512-BF16 attention kernels (src/vitscope/kernels/native/attention_bf16.c) without Python:
   one (batch, head) in cache, phase by phase, and a whole layer of heads from memory.

       gcc -O3 -fopenmp -std=gnu11 -mfma -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 \
           -I src/vitscope/kernels/native benchmarks/attention_heads.c -o /tmp/attention_heads -lm
       /tmp/attention_heads 50 32          # one head, N = 50, D = 32 (the plain 28x28 ViT's)
       /tmp/attention_heads 50 32 256 4 2  # and a layer: B = 256, H = 4 heads, on 2 threads

   q, k and v are strided views of one (B, N, 3, H, D) tensor as in the model; the inputs are
   deterministic bfloat16 values. Prints microseconds per call (one head) and per head and thread (a
   layer). */
#define _GNU_SOURCE
#include <stdio.h>
#include <time.h>

#include "attention_bf16.c"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static void fill(uint16_t *x, size_t n, uint64_t mult)
{
    for (size_t i = 0; i < n; i++) x[i] = bf16((float)((i * mult) % 1000) / 1000.f - 0.5f);
}

#define TIME(name, reps, stmt)                                                    \
    do {                                                                          \
        const double t0 = now();                                                  \
        for (int it = 0; it < (reps); it++) { stmt; }                             \
        printf("%-24s %9.3f us\n", name, (now() - t0) / (reps) * 1e6);            \
    } while (0)

static void one_head(int n, int d)
{
    const int64_t st = 3 * d * 4; /* a row of (N, 3, 4 heads, D) */
    uint16_t *qkv = aligned_alloc(64, (size_t)n * st * 2 + 4096), *dqkv = aligned_alloc(64, (size_t)n * st * 2 + 4096);
    uint16_t *g = aligned_alloc(64, (size_t)n * d * 2 + 4096), *o = aligned_alloc(64, (size_t)n * d * 2 + 4096);
    float *lse = aligned_alloc(64, (size_t)n * 4 + 64);
    fill(qkv, (size_t)n * st, 7919);
    fill(g, (size_t)n * d, 104729);
    const uint16_t *q = qkv, *k = qkv + 4 * d, *v = qkv + 8 * d;
    scratch_t *w = scratch();
    const unsigned csr = subnormals_off();
    const float scale = 1.0f / sqrtf((float)d), c = scale * 1.4426950408889634f;
    const int reps = n <= 64 ? 20000 : 1000;
    head_forward(q, st, k, st, v, st, o, d, lse, n, n, d, c, w);
    printf("one head in cache, N = %d, D = %d, one thread\n", n, d);
    TIME("forward", reps, head_forward(q, st, k, st, v, st, o, d, lse, n, n, d, c, w));
    if (n > MAXK) return;
    TIME("backward", reps, head_backward_short(q, st, k, st, v, st, g, d, lse, dqkv, st, dqkv + 4 * d, st,
                                               dqkv + 8 * d, st, n, n, d, c, scale, w));
    const int njb = (n + 15) / 16, njs = (n + 31) / 32, nis = njs, ndb = d / 16, lk = njs * 32, lq = nis * 32;
    TIME("  five packs", reps, {
        pack_transposed(k, st, n, d, w->kt); pack_transposed(v, st, n, d, w->vt); pack_pairs(k, st, n, d, w->kp);
        pack_pairs(q, st, n, d, w->qp); pack_pairs(g, d, n, d, w->dop);
    });
    TIME("  scores q kT and g vT", reps, for (int i0 = 0; i0 < lq; i0 += 16) block_scores(q, st, g, d, i0, n, njb, d, lk, 1, w));
    TIME("  dq = dS k", reps, product_rows(w->dsm, lk, w->kp, njs, n, ndb, n, NULL, dqkv, st, w->ob));
    TIME("  transposes of P, dS", reps, {
        transpose_bf16(w->p, lk, lq, lk, w->pt, lq); transpose_bf16(w->dsm, lk, lq, lk, w->dst, lq);
    });
    TIME("  dv = PT g", reps, product_rows(w->pt, lq, w->dop, nis, n, ndb, n, NULL, dqkv + 8 * d, st, w->ob));
    TIME("  dk = dST q", reps, product_rows(w->dst, lq, w->qp, nis, n, ndb, n, NULL, dqkv + 4 * d, st, w->ob));
    subnormals_restore(csr);
}

static void layer(int64_t b, int64_t h, int64_t n, int64_t d, int threads)
{
    const int64_t row = 3 * h * d;
    const size_t total = (size_t)b * n * row, per = (size_t)b * n * h * d;
    uint16_t *qkv = aligned_alloc(64, total * 2), *grad = aligned_alloc(64, total * 2);
    uint16_t *g = aligned_alloc(64, per * 2), *o = aligned_alloc(64, per * 2);
    float *lse = aligned_alloc(64, (size_t)b * h * n * 4);
    fill(qkv, total, 7919);
    fill(g, per, 104729);
    memset(grad, 0, total * 2);
    memset(o, 0, per * 2);
    /* (B, H, N, D) strides: q, k, v of qkv; o and g (B, N, H, D); dq, dk, dv of grad */
    const int64_t st[21] = {n * row, d, row, n * row, d, row, n * row, d, row, n * h * d, d, h * d,
                            n * row, d, row, n * row, d, row, n * row, d, row};
    const float scale = 1.0f / sqrtf((float)d);
    const int reps = 20;
    vs_attention_bf16_fwd(qkv, qkv + h * d, qkv + 2 * h * d, o, lse, b, h, n, n, d, st, scale, threads);
    double t0 = now();
    for (int i = 0; i < reps; i++)
        vs_attention_bf16_fwd(qkv, qkv + h * d, qkv + 2 * h * d, o, lse, b, h, n, n, d, st, scale, threads);
    const double tf = (now() - t0) / reps;
    vs_attention_bf16_bwd(qkv, qkv + h * d, qkv + 2 * h * d, g, lse, NULL, grad, grad + h * d, grad + 2 * h * d,
                          b, h, n, n, d, st, scale, threads);
    t0 = now();
    for (int i = 0; i < reps; i++)
        vs_attention_bf16_bwd(qkv, qkv + h * d, qkv + 2 * h * d, g, lse, NULL, grad, grad + h * d, grad + 2 * h * d,
                              b, h, n, n, d, st, scale, threads);
    const double tb = (now() - t0) / reps;
    printf("a layer: B = %ld, H = %ld, N = %ld, D = %ld, %d threads: forward %.3f ms (%.2f us a head and thread), "
           "backward %.3f ms (%.2f)\n", (long)b, (long)h, (long)n, (long)d, threads, tf * 1e3,
           tf * 1e6 * threads / (b * h), tb * 1e3, tb * 1e6 * threads / (b * h));
}

int main(int argc, char **argv)
{
    const int n = argc > 1 ? atoi(argv[1]) : 50, d = argc > 2 ? atoi(argv[2]) : 32;
    one_head(n, d);
    if (argc > 5) layer(atoi(argv[3]), atoi(argv[4]), n, d, atoi(argv[5]));
    return 0;
}
