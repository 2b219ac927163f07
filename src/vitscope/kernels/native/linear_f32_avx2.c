/* A linear layer's three float32 products with AVX2 and FMA, for CPUs without AVX-512: the forward x Wᵀ + b,
   the input gradient g W, and the weight and bias gradients gᵀ x and g's column sums.

   On AMD CPUs without AVX-512 MKL's sgemm takes a generic path: on a 2-core Zen 3 EPYC torch.mm ran 94-130
   GFLOP/s and oneDNN's float32 linear 101-141, against an FMA peak of 81 on one core and about 145 on both at
   once (two copies of the register tile in L1, one per core). Every product here is tile_avx2.h's 6 x 16
   register tile (12 x 8 for a last 8 columns).

   Forward and input gradient (vs_linear_f32_avx2): B (the weight, or for g W the weight read down its
   columns) is packed once per call into panels of 16 columns, k x 16 floats each, zero past n. Each thread
   takes chunks of MC rows of x (in L2) and packs each block of KB of the reduction as slivers of 6 rows, kn x 6
   floats each (read in place at x's row stride the tiles ran 5-20% slower); for each panel (in L1 or L2) it
   runs tiles of 6 rows, the first block starting from the bias and the next ones from y. While a panel's
   tiles run, the next panel's lines of y (about to be written) and of the multiplier (about to be read) are
   prefetched a tile's rows at a time: without it fc2's backward product spent 6 ms of its 21 reading GELU's
   derivative at 4 GB/s. fc1's GELU derivative, not read again before the backward, is stored past the cache
   (streaming stores), so its lines are not first read in: that epilogue cost 11 ms of 26 before, 5 after.
   Weight gradient (vs_weight_grad_f32_avx2): each thread sums over its own share of the M rows into its own
   (o, i) sums (the first thread's in dw itself), KC rows at a time. It packs the chunk first, g as blocks of 6
   columns and x as panels of 16 (each rows x 6 or rows x 16 floats, contiguous: read in place at their row
   strides the tiles ran 10-20% slower), taking g's column sums (the bias gradient, float32 per chunk,
   float64 across chunks) from the rows as they pass; then for each panel of x (in L1) every block of g in
   turn, each tile adding to the sums so far. The threads' sums are added at the end. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "normal_avx2.h"
#include "thread_sums_avx2.h"
#include "tile_avx2.h"

/* rows of x a thread's forward takes at once; the forward's reduction block; rows of g and x per weight-gradient
   chunk (each measured best of a few values at the plain ViT's and ViT-S/16's shapes) */
enum { MC = 96, KB = 512, KC = 64 };

/* What follows a panel's sums, on its rows [i0, i1) and 8 nv columns while they are in L1: with d, y = gelu(y)
   and d = gelu'(y) (fc1 in training: its GELU's value and derivative, the pre-activation never written out);
   else y = y mul (fc2's input gradient times GELU's derivative). */
static void epilogue(float *y, int64_t ldy, int64_t i0, int64_t i1, int nv, const float *mul, int64_t ldm, float *d)
{
    for (int64_t i = i0; i < i1; i++)
        for (int v = 0; v < nv; v++) {
            float *yi = y + i * ldy + 8 * v;
            const __m256 a = _mm256_loadu_ps(yi);
            if (d) {
                __m256 h, dh;
                gelu_and_grad8(a, &h, &dh);
                _mm256_storeu_ps(yi, h);
                float *di = d + i * ldy + 8 * v;  /* past the cache where aligned; the sfence below orders them */
                if (((uintptr_t)di & 31) == 0)
                    _mm256_stream_ps(di, dh);
                else
                    _mm256_storeu_ps(di, dh);
            } else {
                _mm256_storeu_ps(yi, _mm256_mul_ps(a, _mm256_loadu_ps(mul + i * ldm + 8 * v)));
            }
        }
}

/* y (m, n) at row stride ldy = x (m, k) B (+ bias, n floats, or NULL), x's rows at stride ldx. B: with
   `weight_rows` 1, w (n, k) at row stride ldw and y = x wᵀ (a linear layer's forward); with 0, w (k, n) and
   y = x w (its input gradient g W). n % 8 == 0. bp: 16 k ceil(n / 16) floats, for the packed panels.
   With d (m, n at row stride ldy, or NULL), y = gelu(x B + bias) and d = gelu'(x B + bias); else with mul (m, n
   at row stride ldm, or NULL), y = (x B + bias) mul. */
void vs_linear_f32_avx2(const float *x, int64_t ldx, int64_t m, int64_t k, const float *w, int64_t ldw,
                        int weight_rows, int64_t n, const float *bias, const float *mul, int64_t ldm, float *d,
                        float *y, int64_t ldy, float *bp, int threads)
{
    const int64_t panels = (n + 15) / 16;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {  /* bp[p k 16 + kk 16 + j] = B[kk][16 p + j] */
            float *dst = bp + p * k * 16;
            const int64_t cols = n - 16 * p < 16 ? n - 16 * p : 16;
            if (cols < 16) memset(dst, 0, sizeof(float) * (size_t)(k * 16));
            if (weight_rows) {
                for (int64_t j = 0; j < cols; j++)
                    for (int64_t kk = 0; kk < k; kk++) dst[kk * 16 + j] = w[(16 * p + j) * ldw + kk];
            } else {
                for (int64_t kk = 0; kk < k; kk++)
                    memcpy(dst + kk * 16, w + kk * ldw + 16 * p, sizeof(float) * (size_t)cols);
            }
        }
        /* this thread's chunk of x as slivers of 6 rows, kn x 6 floats each, for the 6 x 16 tiles (NULL where
           there are none, n being 8, or where malloc fails: x read in place) */
        float *ap = n >= 16 ? malloc(sizeof(float) * (size_t)((m < MC ? m : MC) * (k < KB ? k : KB))) : NULL;
#pragma omp for schedule(static)
        for (int64_t i0 = 0; i0 < m; i0 += MC) {
            const int64_t i1 = i0 + MC < m ? i0 + MC : m;
            for (int64_t k0 = 0; k0 < k; k0 += KB) {  /* the reduction in blocks of KB, each adding to the last */
                const int kn = (int)(k - k0 < KB ? k - k0 : KB);
                const int64_t slivers = ap ? (i1 - i0) / 6 : 0;
                for (int64_t s = 0; s < slivers; s++)
                    for (int r = 0; r < 6; r++) {
                        const float *xr = x + (i0 + 6 * s + r) * ldx + k0;
                        float *dst = ap + s * 6 * kn + r;
                        for (int kk = 0; kk < kn; kk++) dst[kk * 6] = xr[kk];
                    }
                for (int64_t p = 0; p < panels; p++) {
                    const float *b = bp + p * k * 16 + k0 * 16, *xa = x + k0;
                    float *yp = y + 16 * p;
                    const float *c0 = k0 ? yp : bias ? bias + 16 * p : NULL;
                    const int64_t s0 = k0 ? ldy : 0;
                    const int nv = n - 16 * p >= 16 ? 2 : 1;
                    /* the next panel's lines of y (written first) and mul (read last), a tile's rows at a time */
                    float *py = p + 1 < panels && k0 == 0 ? yp + 16 : NULL;
                    const float *pm = p + 1 < panels && mul && k0 + kn == k ? mul + 16 * (p + 1) : NULL;
                    int64_t i = i0;  /* tiles of 6 rows x 16 columns, or 12 x 8 for a last panel of 8 */
                    if (nv == 2)
                        for (; i + 6 <= i1; i += 6) {
                            for (int r = 0; r < 6; r++) {
                                if (py) __builtin_prefetch(py + (i + r) * ldy, 1, 3);
                                if (pm) __builtin_prefetch(pm + (i + r) * ldm, 0, 3);
                            }
                            if (i - i0 < 6 * slivers)
                                tile(6, 2, kn, ap + (i - i0) * kn, 1, 6, b, 16, yp + i * ldy, ldy, c0 ? c0 + i * s0 : NULL, s0);
                            else
                                tile(6, 2, kn, xa + i * ldx, ldx, 1, b, 16, yp + i * ldy, ldy, c0 ? c0 + i * s0 : NULL, s0);
                        }
                    else
                        for (; i + 12 <= i1; i += 12) tile(12, 1, kn, xa + i * ldx, ldx, 1, b, 16, yp + i * ldy, ldy, c0 ? c0 + i * s0 : NULL, s0);
                    if (i < i1) tile_any((int)(i1 - i), nv, kn, xa + i * ldx, ldx, 1, b, 16, yp + i * ldy, ldy, c0 ? c0 + i * s0 : NULL, s0);
                    if (k0 + kn == k && (d || mul))
                        epilogue(yp, ldy, i0, i1, nv, mul ? mul + 16 * p : NULL, ldm, d ? d + 16 * p : NULL);
                }
            }
        }
        free(ap);
        _mm_sfence();  /* the streaming stores done before the threads join */
    }
}

/* dw (o, i) = gᵀ x for g (m, o) and x (m, i) at row strides ldg and ldx; i % 8 == 0. work: (threads - 1) x o
   x i floats, the other threads' sums. With db (o floats), also g's column sums (bwork: threads x o doubles).
   Returns 0, or -2 when a thread's packing buffer could not be allocated. */
int vs_weight_grad_f32_avx2(const float *g, int64_t ldg, const float *x, int64_t ldx, int64_t m, int64_t o,
                            int64_t i, float *work, float *dw, double *bwork, float *db, int threads)
{
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t m0 = m * t / nt, blocks = (o + 5) / 6, panels = (i + 15) / 16;
        int64_t m1 = m * (t + 1) / nt;
        float *c = t == 0 ? dw : work + (int64_t)(t - 1) * o * i;
        double *bs = db ? bwork + (int64_t)t * o : NULL;
        /* this thread's chunk of g packed as blocks of 6 columns (rows x 6 each), of x as panels of 16 (rows x 16),
           and g's column sums over the chunk */
        float *gp = aligned_alloc(64, sizeof(float) * (size_t)(KC * 6 * blocks + KC * 16 * panels + (o + 15) / 16 * 16));
        float *xp = gp + KC * 6 * blocks, *csum = xp + KC * 16 * panels;
        if (!gp) {
            failed = 1;
            m1 = m0;
        }
        if (bs) memset(bs, 0, sizeof(double) * (size_t)o);
        if (m0 == m1) memset(c, 0, sizeof(float) * (size_t)(o * i));
        for (int64_t r0 = m0; r0 < m1; r0 += KC) {
            const int rows = (int)(m1 - r0 < KC ? m1 - r0 : KC);
            const float *gc = g + r0 * ldg, *xc = x + r0 * ldx;
            if (bs) memset(csum, 0, sizeof(float) * (size_t)o);
            for (int kk = 0; kk < rows; kk++) {
                const float *gr = gc + kk * ldg, *xr = xc + kk * ldx;
                int64_t b = 0;  /* whole blocks as 24-byte copies (scalar stores with a bound check: 2% slower) */
                for (; 6 * b + 6 <= o; b++) memcpy(gp + (b * rows + kk) * 6, gr + 6 * b, sizeof(float) * 6);
                if (b < blocks) {  /* the last block's columns past o are zeros */
                    float *d = gp + (b * rows + kk) * 6;
                    for (int r = 0; r < 6; r++) d[r] = 6 * b + r < o ? gr[6 * b + r] : 0.0f;
                }
                for (int64_t p = 0; p < panels; p++)
                    memcpy(xp + (p * rows + kk) * 16, xr + 16 * p, sizeof(float) * (size_t)(i - 16 * p < 16 ? i - 16 * p : 16));
                if (bs) {
                    int64_t e = 0;
                    for (; e + 8 <= o; e += 8) _mm256_storeu_ps(csum + e, _mm256_add_ps(_mm256_loadu_ps(csum + e), _mm256_loadu_ps(gr + e)));
                    for (; e < o; e++) csum[e] += gr[e];
                }
            }
            if (bs)
                for (int64_t e = 0; e < o; e++) bs[e] += csum[e];
            for (int64_t j = 0; j < i; j += 16) {  /* x's panel in L1, g's blocks in turn from L2 */
                const int nv = i - j >= 16 ? 2 : 1;
                const float *xb = xp + j / 16 * rows * 16;
                for (int64_t a = 0; a < o; a += 6) {
                    float *cc = c + a * i + j;
                    const float *c0 = r0 == m0 ? NULL : cc, *gb = gp + a / 6 * rows * 6;
                    if (nv == 2 && o - a >= 6) tile(6, 2, rows, gb, 1, 6, xb, 16, cc, i, c0, i);
                    else tile_any((int)(o - a < 6 ? o - a : 6), nv, rows, gb, 1, 6, xb, 16, cc, i, c0, i);
                }
            }
        }
        free(gp);
#pragma omp barrier
        add_thread_sums(dw, work, o * i, nt);
        if (db) {
#pragma omp for schedule(static)
            for (int64_t e = 0; e < o; e++) {
                double s = 0.0;
                for (int u = 0; u < nt; u++) s += bwork[(int64_t)u * o + e];
                db[e] = (float)s;
            }
        }
    }
    return failed ? -2 : 0;
}
