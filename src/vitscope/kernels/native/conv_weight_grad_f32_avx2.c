/* A 2-D convolution's weight gradient for float32 channels-last activations (one group, no dilation), with AVX2
   and FMA, for CPUs without AVX-512: dw[o][ky][kx][c] = the sum over (b, oy, ox) of
   g[b][oy][ox][o] · x[b][oy·s + ky − p][ox·s + kx − p][c], over the taps that fall inside the image.

   That is gᵀ X for the im2col matrix X (B·OH·OW rows, KH·KW·C columns), as vs_weight_grad_f32_avx2 takes
   it for a linear layer, but X is neither written out nor packed: packing it copies each pixel KH·KW times,
   and at the quick preset's widths (o = 64: 128 FLOPs per packed float, against 1,024 for the plain ViT's
   fc1) that copying would cost about as much as the sums. Instead each thread takes chunks of KC rows of g
   (pixels), packs them as blocks of 6 columns (rows x 6 floats), and for each tap lists the pixels whose tap
   falls inside the image: where that pixel's block row is and where its tap's channels start in x. The
   register tile (6 rows of dw x 16 channels, as tile_avx2.h's) then runs down that list, reading each tap's
   16 channels in place (one cache line), so the padding costs nothing and x is read from L1 or L2 once per
   tap and panel of 16 channels, for every block of g in turn. Each tile adds its chunk's sum to the thread's
   sums so far (float32), and the threads' sums are added at the end. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "thread_sums_avx2.h"

enum { KC = 128 };

/* c[r][0 .. 16) += the sum over j < n of a[ia[j] + r] b[ib[j] + 0 .. 16), for r < R (R ≤ 6; a holds 6 rows
   whatever R is). Twelve accumulators in named registers, added to c once at the end. */
static inline __attribute__((always_inline)) void gather_tile(int n, const int32_t *ia, const int64_t *ib,
                                                             const float *a, const float *b, float *c, int64_t sc,
                                                             int R)
{
#define ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define DECLARE(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
    ROWS6(DECLARE)
    for (int j = 0; j < n; j++) {
        const float *bj = b + ib[j], *aj = a + ia[j];
        const __m256 b0 = _mm256_loadu_ps(bj), b1 = _mm256_loadu_ps(bj + 8);
#define STEP(i)                                                  \
        {                                                        \
            const __m256 av = _mm256_broadcast_ss(aj + (i));     \
            c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);          \
            c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);          \
        }
        ROWS6(STEP)
    }
#define STORE(i)                                                                              \
    if (R > i) {                                                                              \
        _mm256_storeu_ps(c + (i) * sc, _mm256_add_ps(_mm256_loadu_ps(c + (i) * sc), c##i##0));         \
        _mm256_storeu_ps(c + (i) * sc + 8, _mm256_add_ps(_mm256_loadu_ps(c + (i) * sc + 8), c##i##1)); \
    }
    ROWS6(STORE)
#undef DECLARE
#undef STEP
#undef STORE
#undef ROWS6
}

/* dw (o, kh, kw, c) float32 for g (n, oh, ow, o) and x (n, h, w, c) float32, both contiguous (channels-last);
   c % 16 == 0. work: (threads - 1) x o x (kh·kw·c) floats, the other threads' sums. Returns 0, or -2 when a
   thread's buffers could not be allocated. */
int vs_conv_weight_grad_f32_avx2(const float *g, const float *x, int64_t n, int64_t h, int64_t w, int64_t c,
                                 int64_t oh, int64_t ow, int64_t o, int kh, int kw, int stride, int pad, float *work,
                                 float *dw, int threads)
{
    const int64_t m = n * oh * ow, i = (int64_t)kh * kw * c, blocks = (o + 5) / 6;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t m0 = m * t / nt;
        int64_t m1 = m * (t + 1) / nt;
        float *acc = t == 0 ? dw : work + (int64_t)(t - 1) * o * i;
        /* g's chunk as blocks of 6 columns; per pixel of the chunk its image's offset and top-left tap; per
           tap the list of pixels inside the image (their rows in a block, their tap's offset in x) */
        float *gp = aligned_alloc(64, sizeof(float) * (size_t)(KC * 6 * blocks));
        int64_t *base = malloc(sizeof(int64_t) * KC * 2), *ib = malloc(sizeof(int64_t) * KC);
        int32_t *y0 = malloc(sizeof(int32_t) * KC * 2), *x0 = y0 + KC, *ia = malloc(sizeof(int32_t) * KC);
        if (!gp || !base || !ib || !y0 || !ia) {
            failed = 1;
            m1 = m0;
        }
        memset(acc, 0, sizeof(float) * (size_t)(o * i));
        for (int64_t r0 = m0; r0 < m1; r0 += KC) {
            const int rows = (int)(m1 - r0 < KC ? m1 - r0 : KC);
            for (int kk = 0; kk < rows; kk++) {
                const float *gr = g + (r0 + kk) * o;
                int64_t b = 0;
                for (; 6 * b + 6 <= o; b++) memcpy(gp + (b * rows + kk) * 6, gr + 6 * b, sizeof(float) * 6);
                if (b < blocks) {  /* the last block's columns past o are zeros */
                    float *d = gp + (b * rows + kk) * 6;
                    for (int r = 0; r < 6; r++) d[r] = 6 * b + r < o ? gr[6 * b + r] : 0.0f;
                }
                const int64_t p = r0 + kk, img = p / (oh * ow), oy = p / ow % oh, ox = p % ow;
                base[kk] = img * h * w * c;
                y0[kk] = (int32_t)(oy * stride - pad);
                x0[kk] = (int32_t)(ox * stride - pad);
            }
            for (int ky = 0; ky < kh; ky++)
                for (int kx = 0; kx < kw; kx++) {
                    int cnt = 0;
                    for (int kk = 0; kk < rows; kk++) {
                        const int64_t iy = y0[kk] + ky, ix = x0[kk] + kx;
                        if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
                        ia[cnt] = kk * 6;
                        ib[cnt++] = base[kk] + (iy * w + ix) * c;
                    }
                    if (!cnt) continue;
                    const int64_t col = ((int64_t)ky * kw + kx) * c;
                    for (int64_t e = 0; e < c; e += 16)  /* the tap's 16 channels in L1, g's blocks in turn */
                        for (int64_t a = 0; a < blocks; a++)
                            gather_tile(cnt, ia, ib, gp + a * rows * 6, x + e, acc + 6 * a * i + col + e, i,
                                        (int)(o - 6 * a < 6 ? o - 6 * a : 6));
                }
        }
        free(gp);
        free(base);
        free(ib);
        free(y0);
        free(ia);
#pragma omp barrier
        add_thread_sums(dw, work, o * i, nt);
    }
    return failed ? -2 : 0;
}
