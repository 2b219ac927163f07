/* A linear layer's products in bfloat16 for AVX512-BF16: y = x Bᵀ (+ bias), where B is either the layer's
   weight W (n, k) (the forward, x Wᵀ) or, for the input gradient g W, the weight read down its columns.

   On a Zen 4 EPYC's 2 cores vdpbf16ps peaks at 445-470 GFLOP/s (docs/performance.md); oneDNN's bfloat16
   linear ran the plain 28x28 ViT's and ViT-S/16's layers at 340-430, this kernel at 400-450, and inside the
   plain ViT's training step its products took 142 ms a step against oneDNN's 162 (docs/performance.md).
   B is packed once per call into pairs of its reduction index interleaved (the dwords vdpbf16ps multiplies
   and adds), k/2 x n dwords: at most a few MB, mostly in L2. Each thread takes chunks of up to MC rows of x;
   a block of 4 rows by 64 columns (6 rows where k > 256) keeps its float32 sums in 16 (24) registers over
   the whole reduction, taking per pair of k one broadcast of x's pair for each row and four vectors of B's;
   then it adds the bias, multiplies by `mul` where given (fc2's backward: GELU's derivative), rounds to
   bfloat16 once (to nearest even) and stores. With `gelu`, the rounded sums are looked up in gelu.c's table
   instead (one gather per 16), and y gets gelu(a) and d gelu'(a) (fc1's output in training), or y alone
   gelu(a) (in inference), without a pass of its own over a. Lines the stores and the multiply will need
   are fetched while the sums are taken: they come from memory, not cache, in a training step. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

extern uint32_t vs_gelu_table[65536];

/* rows a block keeps in registers (MR_LONG where k > 256), its 16-column vectors, rows a thread takes at once */
enum { MR = 4, MR_LONG = 6, NB = 4, MC = 96 };

/* what a block does with its sums (a constant in each copy of the code: a test in the stores measured 10-20%
   slower) */
enum { PLAIN, MUL, GELU, GELU_H };

/* 16 sums, rounded to bfloat16 once (after the multiply by `mul` for MUL), stored to y; for GELU, gelu(a) to y
   and gelu'(a) to d, for GELU_H gelu(a) to y alone. */
static inline __attribute__((always_inline)) void store16(__m512 s, const uint16_t *mul, uint16_t *y, uint16_t *d,
                                                          __mmask16 k, const int mode)
{
    if (mode == MUL) s = _mm512_mul_ps(s, _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(k, mul)));
    const __m256i a = (__m256i)_mm512_cvtneps_pbh(s);
    if (mode == GELU || mode == GELU_H) {
        const __m512i v = _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(a), (const void *)vs_gelu_table, 4);
        _mm256_mask_storeu_epi16(y, k, _mm512_cvtepi32_epi16(v));
        if (mode == GELU) _mm256_mask_storeu_epi16(d, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
    } else {
        _mm256_mask_storeu_epi16(y, k, a);
    }
}

/* y's rows [i, i + mr) and vectors [j, j + nb·16) (n columns in all: the last vector may be partial) from
   kp pairs; mr and nb are constants at each call. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, int64_t ldx, const uint32_t *bp, int64_t n,
                                                        int64_t kp, const float *bias, const uint16_t *mul,
                                                        int64_t ldm, uint16_t *y, int64_t ldy, uint16_t *d,
                                                        int64_t i, int64_t j, const int mr, const int nb,
                                                        const int mode)
{
    __m512 acc[MR_LONG][NB];
    __mmask16 km[NB];
    for (int e = 0; e < nb; e++) {
        const int64_t left = n - (j + 16 * e);
        km[e] = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 b0 = bias ? _mm512_maskz_loadu_ps(km[e], bias + j + 16 * e) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++) acc[r][e] = b0;
    }
    const uint16_t *xr = x + i * ldx;
    for (int r = 0; r < mr; r++) /* lines from memory the stores will need, fetched while the sums are taken */
        for (int e = 0; e < nb; e += 2) {
            if (mode == MUL) _mm_prefetch((const char *)(mul + (i + r) * ldm + j + 16 * e), _MM_HINT_T0);
            _mm_prefetch((const char *)(y + (i + r) * ldy + j + 16 * e), _MM_HINT_ET0);
            if (mode == GELU) _mm_prefetch((const char *)(d + (i + r) * ldy + j + 16 * e), _MM_HINT_ET0);
        }
    for (int64_t p = 0; p < kp; p++) {
        __m512bh bv[NB];
        for (int e = 0; e < nb; e++) bv[e] = (__m512bh)_mm512_loadu_si512(bp + p * n + j + 16 * e);
        for (int r = 0; r < mr; r++) {
            int32_t pair; /* x[i + r][2p], x[i + r][2p + 1] */
            memcpy(&pair, xr + r * ldx + 2 * p, sizeof pair);
            const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
            for (int e = 0; e < nb; e++) acc[r][e] = _mm512_dpbf16_ps(acc[r][e], av, bv[e]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int e = 0; e < nb; e++) {
            const int64_t c = j + 16 * e;
            store16(acc[r][e], mode == MUL ? mul + (i + r) * ldm + c : 0, y + (i + r) * ldy + c,
                    mode == GELU ? d + (i + r) * ldy + c : 0, km[e], mode);
        }
}

/* Rows [i0, i1) of y, every column: for each 64 columns, whole blocks of 4 rows, then a shorter one at the end;
   the last columns' blocks are narrower. B's packed panel for 64 columns stays in L1 up to k = 256; for longer
   reductions it comes from L2, and blocks of 6 rows use each of its vectors half as often again (in the plain
   ViT's step, k = 384 and 512 into 128 columns then ran 4-9% faster than oneDNN's, with 4 rows no faster;
   blocks of 8 x 32, whose panel is half as large, were slower). */
static inline __attribute__((always_inline)) void rows(const uint16_t *x, int64_t ldx, int64_t i0, int64_t i1,
                                                       const uint32_t *bp, int64_t n, int64_t kp, const float *bias,
                                                       const uint16_t *mul, int64_t ldm, uint16_t *y, int64_t ldy,
                                                       uint16_t *d, const int mode)
{
    const int64_t vecs = (n + 15) / 16;
#define VS_BLOCK(MRC, NBC) block(x, ldx, bp, n, kp, bias, mul, ldm, y, ldy, d, i, 16 * v, MRC, NBC, mode)
#define VS_ROWS(MRC, NBC)                                                                                     \
    {                                                                                                         \
        int64_t i = i0;                                                                                       \
        for (; i + (MRC) <= i1; i += (MRC)) VS_BLOCK(MRC, NBC);                                               \
        switch (i1 - i) {                                                                                     \
        case 5: if ((MRC) > 5) VS_BLOCK(5, NBC); break; /* a shorter last block: MRC > 5 only */             \
        case 4: if ((MRC) > 4) VS_BLOCK(4, NBC); break;                                                       \
        case 3: VS_BLOCK(3, NBC); break;                                                                      \
        case 2: VS_BLOCK(2, NBC); break;                                                                      \
        case 1: VS_BLOCK(1, NBC); break;                                                                      \
        default: break;                                                                                       \
        }                                                                                                     \
    }
#define VS_COLUMNS(MRC)                                                                                       \
    for (int64_t v = 0; v < vecs; v += NB) {                                                                  \
        switch (vecs - v < NB ? vecs - v : NB) {                                                              \
        case 4: VS_ROWS(MRC, 4) break;                                                                        \
        case 3: VS_ROWS(MRC, 3) break;                                                                        \
        case 2: VS_ROWS(MRC, 2) break;                                                                        \
        default: VS_ROWS(MRC, 1) break;                                                                       \
        }                                                                                                     \
    }
    if (kp > 128) {
        VS_COLUMNS(MR_LONG)
    } else {
        VS_COLUMNS(MR)
    }
#undef VS_COLUMNS
#undef VS_ROWS
#undef VS_BLOCK
}

/* y (m, n) bfloat16 = x (m, k) times B, each product summed in float32 and rounded once.
   B: with `weight_rows` 1, w (n, k) at row stride ldw, y = x wᵀ (a linear layer's forward); with 0, w (k, n)
   at row stride ldw, y = x w (its input gradient g W). k must be even; x's rows at stride ldx, unit
   stride within. bias: n float32 values added to every row, or NULL. mul: a bfloat16 (m, n) tensor at row
   stride ldm that multiplies the sums before rounding, or NULL. gelu 1: y gets gelu(a) for a the rounded sums
   (gelu.c's table), and d, unless NULL, gelu'(a) ((m, n) at row stride ldy). bp: k/2 x n + 16 dwords, for packed B;
   with w NULL it already holds B packed (bp[p n + j] = B's (2p, j) and (2p + 1, j) as one dword), so a weight
   that many calls read is packed once. */
void vs_linear_bf16(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t ldw,
                    int weight_rows, int64_t n, const float *bias, const uint16_t *mul, int64_t ldm, uint16_t *y,
                    int64_t ldy, int gelu, uint16_t *d, uint32_t *bp, int threads)
{
    const int64_t kp = k / 2;
#pragma omp parallel num_threads(threads)
    {
        if (!w) {
            /* packed by the caller */
        } else if (weight_rows) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < kp; p++)
                for (int64_t j = 0; j < n; j++)
                    bp[p * n + j] = (uint32_t)w[j * ldw + 2 * p] | (uint32_t)w[j * ldw + 2 * p + 1] << 16;
        } else {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < kp; p++)
                for (int64_t j = 0; j < n; j++)
                    bp[p * n + j] = (uint32_t)w[2 * p * ldw + j] | (uint32_t)w[(2 * p + 1) * ldw + j] << 16;
        }
        /* MC rows at a time, fewer where that would leave a thread idle (at least two chunks a thread) */
        const int64_t share = (m + 2 * threads - 1) / (2 * threads), mc = share < MC ? (share + MR - 1) / MR * MR : MC;
#pragma omp for schedule(static)
        for (int64_t i0 = 0; i0 < m; i0 += mc) {
            const int64_t i1 = i0 + mc < m ? i0 + mc : m;
            if (gelu && d) rows(x, ldx, i0, i1, bp, n, kp, bias, mul, ldm, y, ldy, d, GELU);
            else if (gelu) rows(x, ldx, i0, i1, bp, n, kp, bias, mul, ldm, y, ldy, d, GELU_H);
            else if (mul) rows(x, ldx, i0, i1, bp, n, kp, bias, mul, ldm, y, ldy, d, MUL);
            else rows(x, ldx, i0, i1, bp, n, kp, bias, mul, ldm, y, ldy, d, PLAIN);
        }
    }
}
