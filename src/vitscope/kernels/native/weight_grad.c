/* A linear layer's weight gradient gᵀ x for bfloat16 g (M, O) and x (M, I) with a small output
   (O·I at most 65536: the plain 28x28 ViT's and the quick preset's layers), in AVX512-BF16.

   oneDNN reads both operands across rows for this product and ran the plain ViT's four at 84-89% of
   its own matmul peak at M = 12800 on a Zen 4 EPYC, against 93-96% here (docs/performance.md).
   Each thread takes a contiguous share of the M rows (the sum) and keeps its own float32 (O, I) sums,
   at most 256 KB, in cache; its rows go by in chunks of KC, each chunk's g and x packed into pairs of
   rows interleaved element by element (the dword pairs vdpbf16ps multiplies and adds), so a 4 x 64
   block of sums takes, per pair of rows, four broadcasts of g's pairs and four vectors of x's. The
   threads' sums are added and rounded to bfloat16 at the end. With a bias, g's column sums come from
   the same chunks while they are in cache.

   While a chunk's blocks run, the next chunk's rows of g and x are fetched into L2, a few lines per block:
   packing had waited on them (about 14% of the kernel's samples in a training step's profile). With that, and
   chunks of 128 rows instead of 256 (the packed chunk, the next one's rows and the sums share L2), the
   plain ViT's four shapes went from 382-399 to 396-413 GFLOP/s alone on 2 threads at M = 12800 (Zen 4; the
   CPU's vdpbf16ps peak is 445-469; docs/performance.md), and its training step 1.03x
   (docs/performance.md). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pairs.h"

enum { KC = 128, CB = 4 };

/* pack_pairs for g, then each column's sum over the rows added into sums[0 .. n) (float32): the bias
   gradient, read again from the chunk while it is in cache. */
static void pack_pairs_sum(const uint16_t *y, int64_t ld, int rows, int64_t n, uint32_t *dst, float *sums)
{
    pack_pairs(y, ld, rows, n, dst);
    for (int64_t c = 0; c < n; c += 16) {
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        int r = 0;
        for (; r + 1 < rows; r += 2) {
            s0 = _mm512_add_ps(s0, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(y + r * ld + c))));
            s1 = _mm512_add_ps(s1, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(y + (r + 1) * ld + c))));
        }
        if (r < rows) s0 = _mm512_add_ps(s0, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(y + r * ld + c))));
        _mm512_storeu_ps(sums + c, _mm512_add_ps(_mm512_loadu_ps(sums + c), _mm512_add_ps(s0, s1)));
    }
}

/* dw (o, i) bfloat16 = gᵀ x with g (m, o) and x (m, i) bfloat16 at row strides ldg and ldx; o % 32 == 0,
   i % 64 == 0, o·i <= 65536 (so o <= 1024). work: threads x o x i floats. With db (o bfloat16), also
   g's column sums (a bias gradient), in float32 per chunk and float64 across chunks and threads
   (bwork: threads x o doubles). Returns 0, or -2 when a thread's packing buffers could not be
   allocated. */
int vs_weight_grad_bf16(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx, int64_t m, int64_t o,
                        int64_t i, float *work, uint16_t *dw, double *bwork, uint16_t *db, int threads)
{
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint32_t *gp, *xp;  /* this thread's packed chunks of g and x */
        float *c = work + (int64_t)t * o * i, csum[1024];
        double *bsum = db ? bwork + (int64_t)t * o : NULL;
        memset(c, 0, (size_t)(o * i) * sizeof(float));
        if (bsum) memset(bsum, 0, (size_t)o * sizeof(double));
        if (pair_buffers(KC, o, i, &gp, &xp)) failed = 1;
        else {
            int64_t m0, m1;  /* whole chunks per thread, in order: thread t sums rows [m0, m1) */
            chunk_share(m, KC, t, nt, &m0, &m1);
            for (int64_t k0 = m0; k0 < m1; k0 += KC) {
                const int rows = chunk_rows(k0, KC, m1), np = (rows + 1) / 2;
                if (bsum) {
                    memset(csum, 0, (size_t)o * sizeof(float));
                    pack_pairs_sum(g + k0 * ldg, ldg, rows, o, gp, csum);
                    for (int64_t j = 0; j < o; j++) bsum[j] += (double)csum[j];
                } else {
                    pack_pairs(g + k0 * ldg, ldg, rows, o, gp);
                }
                pack_pairs(x + k0 * ldx, ldx, rows, i, xp);
                const int64_t after = k0 + KC, next = chunk_rows(after, KC, m1);
                fetch_plan f = plan_fetch(g + after * ldg, next, o * 2, ldg * 2, x + after * ldx, next, i * 2, ldx * 2,
                                          (i / (16 * CB)) * (o / RB));
                for (int64_t i0 = 0; i0 < i; i0 += 16 * CB)
                    for (int64_t o0 = 0; o0 < o; o0 += RB) {
                        fetch_some(&f);
                        pairs_block(gp + o0, o, xp + i0, i, np, c + o0 * i + i0, i, CB);
                    }
            }
        }
#pragma omp barrier
        sum_threads_bf16(work, nt, o * i, dw);
        if (db) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < o; j += 16) {
                float f[16];
                for (int l = 0; l < 16; l++) {
                    double v = 0.0;
                    for (int u = 0; u < nt; u++) v += bwork[(int64_t)u * o + j + l];
                    f[l] = (float)v;
                }
                _mm256_storeu_si256((__m256i *)(db + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(f)));
            }
        }
    }
    return failed ? -2 : 0;
}
