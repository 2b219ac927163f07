/* A 2-D convolution's weight gradient for bfloat16 channels-last activations (one group, no dilation), in
   AVX512-BF16: dw[o][ky][kx][c] = the sum over (b, oy, ox) of g[b][oy][ox][o] · x[b][oy·s + ky − p][ox·s + kx − p][c],
   x read as zero outside the image.

   That is gᵀ X for the im2col matrix X (B·OH·OW rows, KH·KW·C columns), the product native/weight_grad.c
   takes for a linear layer (pairs.h), but X is never written out: each chunk of KC rows is packed straight
   from x, a row's KH·KW channel segments side by side, the padding as zeros. oneDNN's weight gradient of
   the quick preset's 3x3 stem convs ran at 90-250 GFLOP/s inside its training step on a Zen 4 EPYC (the
   stride-2 ones slowest); see vitscope/kernels/fused_conv.py for what this kernel makes of them. Fetching the next
   chunk's rows of g and band of x while a chunk's blocks run took the 64 -> 64 conv from 333 to 404 GFLOP/s
   alone, the four 3x3 convs from 15.2 to 14.1 ms, and the quick preset's step 1.01x (docs/performance.md). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pairs.h"

enum { KC = 128, CB = 4 };

typedef struct {
    int64_t h, w, c, oh, ow;  /* x (b, h, w, c); g (b, oh, ow, o) */
    int kh, kw, stride, pad;
} conv_shape;

/* Where X's row m starts reading: the input's first row and column under the filter's top left tap
   (negative in the padding), and the image's first pixel. */
typedef struct {
    int64_t y, x;
    const uint16_t *image;
} patch;

static inline patch locate(const uint16_t *x, const conv_shape *s, int64_t m)
{
    const int64_t per = s->oh * s->ow, b = m / per, oy = (m - b * per) / s->ow, ox = m - b * per - oy * s->ow;
    return (patch){oy * s->stride - s->pad, ox * s->stride - s->pad, x + b * s->h * s->w * s->c};
}

/* The pixel under tap (ky, kx) of patch q, or NULL where that falls in the padding. */
static inline const uint16_t *tap(const conv_shape *s, patch q, int ky, int kx)
{
    const int64_t iy = q.y + ky, ix = q.x + kx;
    return iy < 0 || iy >= s->h || ix < 0 || ix >= s->w ? NULL : q.image + (iy * s->w + ix) * s->c;
}

/* The bytes of x that X's rows m0 .. m0 + rows read (rows > 0): from the first patch's top row to the last's
   bottom row, whole rows of the image (a chunk's patches lie in a band of the image, or run into the next). */
static inline const uint16_t *band(const uint16_t *x, const conv_shape *s, int64_t m0, int64_t rows, int64_t *bytes)
{
    const int64_t row = s->w * s->c;
    const patch a = locate(x, s, m0), b = locate(x, s, m0 + rows - 1);
    const uint16_t *first = a.image + (a.y > 0 ? a.y : 0) * row;
    const int64_t last = b.y + s->kh < s->h ? b.y + s->kh : s->h;  /* one past the last patch's bottom row */
    *bytes = (int64_t)((b.image + last * row) - first) * 2;
    return first;
}

/* X's rows m0 .. m0 + rows in pairs: dst[r][t·c + e] = the dword (X[m0 + 2r][t·c + e], X[m0 + 2r + 1][t·c + e])
   for tap t = ky·kw + kx; a missing last odd row reads as zeros. c % 32 == 0. */
static void pack_patches(const uint16_t *x, const conv_shape *s, int64_t m0, int rows, uint32_t *dst)
{
    const int64_t c = s->c, i = (int64_t)s->kh * s->kw * c;
    for (int r = 0; 2 * r < rows; r++) {
        const int has_b = 2 * r + 1 < rows;
        const patch qa = locate(x, s, m0 + 2 * r), qb = has_b ? locate(x, s, m0 + 2 * r + 1) : qa;
        uint32_t *d = dst + (int64_t)r * i;
        for (int ky = 0; ky < s->kh; ky++)
            for (int kx = 0; kx < s->kw; kx++, d += c) {
                const uint16_t *a = tap(s, qa, ky, kx), *b = has_b ? tap(s, qb, ky, kx) : NULL;
                if (!a && !b) {
                    memset(d, 0, (size_t)c * 4);
                    continue;
                }
                for (int64_t e = 0; e < c; e += 32) {
                    __m512i lo, hi;
                    interleave(a ? _mm512_loadu_si512(a + e) : _mm512_setzero_si512(),
                               b ? _mm512_loadu_si512(b + e) : _mm512_setzero_si512(), &lo, &hi);
                    _mm512_store_si512(d + e, lo);
                    _mm512_store_si512(d + e + 16, hi);
                }
            }
    }
}

/* dw (o, kh, kw, c) bfloat16 for g (n, oh, ow, o) and x (n, h, w, c) bfloat16, both contiguous; c % 32 == 0,
   o % 32 == 0. work: threads x o x (kh·kw·c) floats. Returns 0, or -2 when a thread's packing buffers
   could not be allocated. */
int vs_conv_weight_grad_bf16(const uint16_t *g, const uint16_t *x, int64_t n, int64_t h, int64_t w, int64_t c,
                             int64_t oh, int64_t ow, int64_t o, int kh, int kw, int stride, int pad, float *work,
                             uint16_t *dw, int threads)
{
    const conv_shape s = {h, w, c, oh, ow, kh, kw, stride, pad};
    const int64_t m = n * oh * ow, i = (int64_t)kh * kw * c;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint32_t *gp, *xp;  /* this thread's packed chunks of g and X */
        float *acc = work + (int64_t)t * o * i;
        memset(acc, 0, (size_t)(o * i) * sizeof(float));
        if (pair_buffers(KC, o, i, &gp, &xp)) failed = 1;
        else {
            int64_t m0, m1;
            chunk_share(m, KC, t, nt, &m0, &m1);
            for (int64_t k0 = m0; k0 < m1; k0 += KC) {
                const int rows = chunk_rows(k0, KC, m1), np = (rows + 1) / 2;
                pack_pairs(g + k0 * o, o, rows, o, gp);
                pack_patches(x, &s, k0, rows, xp);
                /* the next chunk's rows of g and band of x, fetched a few lines per block (as weight_grad.c) */
                const int64_t after = k0 + KC, next = chunk_rows(after, KC, m1);
                int64_t xbytes = 0;
                const uint16_t *xnext = next ? band(x, &s, after, next, &xbytes) : x;
                fetch_plan f = plan_fetch(g + after * o, next, o * 2, o * 2, xnext, 1, xbytes, 0,
                                          (i + 16 * CB - 1) / (16 * CB) * (o / RB));
                int64_t i0 = 0;
                for (; i0 + 16 * CB <= i; i0 += 16 * CB)
                    for (int64_t o0 = 0; o0 < o; o0 += RB) {
                        fetch_some(&f);
                        pairs_block(gp + o0, o, xp + i0, i, np, acc + o0 * i + i0, i, CB);
                    }
                for (; i0 < i; i0 += 32)
                    for (int64_t o0 = 0; o0 < o; o0 += RB) {
                        fetch_some(&f);
                        pairs_block(gp + o0, o, xp + i0, i, np, acc + o0 * i + i0, i, 2);
                    }
            }
        }
#pragma omp barrier
        sum_threads_bf16(work, nt, o * i, dw);
    }
    return failed ? -2 : 0;
}
