/* Short-sequence attention for bfloat16 on AVX-512 CPUs without AMX (AMD Zen 4 and later, Intel Cooper
   Lake), forward and backward: attention_bf16.h's kernels with their products in AVX512-BF16's
   vdpbf16ps, which multiplies 16 pairs of bfloat16 into 16 float32 sums, twice float32's
   multiply-adds per instruction.

   The operands keep the AMX kernel's tile layouts, so everything but the two products is shared: a
   product of an A operand (16 rows of 32 bfloat16) and B tiles (16 rows of 16 pair-dwords) runs as,
   for each A dword, one broadcast and a vdpbf16ps against the B row it meets, with the sums of a few
   rows times up to four B tiles held in registers across the whole reduction. */
#include <immintrin.h>
#include <stdint.h>

/* A dword of A, read where bfloat16 data lies (2-byte aligned). */
typedef int32_t __attribute__((may_alias, aligned(2))) dword_t;

/* out[r ors + e oes + 0 .. 16) = sum over pairs i < np of A(r, i) * B_e(i), for rows r < R and tiles
   e < CNT: A(r, i) is the pair of bfloat16 at bytes a + r as + 64 (i / 16) + 4 (i % 16), B_e(i) the 16
   pairs at dwords b + e bes + (i / 16) bts + 16 (i % 16). R and CNT are constants where this is
   inlined, so the R x CNT sums stay in registers. */
static inline __attribute__((always_inline)) void rows_times(const int R, const int CNT, const uint8_t *a, int64_t as,
                                                            const uint32_t *b, int64_t bes, int64_t bts, int np,
                                                            float *out, int64_t ors, int64_t oes)
{
    __m512 acc[8][4];
    for (int r = 0; r < R; r++)
        for (int e = 0; e < CNT; e++) acc[r][e] = _mm512_setzero_ps();
    for (int t = 0; t * 16 < np; t++) {
        const int pn = np - t * 16 < 16 ? np - t * 16 : 16;
        for (int p = 0; p < pn; p++) {
            __m512bh bv[4];
            for (int e = 0; e < CNT; e++) bv[e] = (__m512bh)_mm512_loadu_si512(b + e * bes + t * bts + p * 16);
            for (int r = 0; r < R; r++) {
                const __m512bh av = (__m512bh)_mm512_set1_epi32(*(const dword_t *)(a + r * as + t * 64 + p * 4));
                for (int e = 0; e < CNT; e++) acc[r][e] = _mm512_dpbf16_ps(acc[r][e], av, bv[e]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int e = 0; e < CNT; e++) _mm512_storeu_ps(out + r * ors + e * oes, acc[r][e]);
}

/* n rows (at most a group: 4 against three or four tiles, 8 against one or two) of the A operand times
   CNT (1 to 4) B tiles, as the fewest rows of 2, 4 or 8 that cover them, each case with constant sizes
   so that its sums stay in registers (at most 16). */
static inline __attribute__((always_inline)) void some_rows(int n, int cnt, const uint8_t *a, int64_t as,
                                                            const uint32_t *b, int64_t bes, int64_t bts, int np,
                                                            float *out, int64_t ors, int64_t oes)
{
#define TIMES(R, C) rows_times(R, C, a, as, b, bes, bts, np, out, ors, oes)
    switch (cnt) {
    case 4: if (n > 2) TIMES(4, 4); else TIMES(2, 4); break;
    case 3: if (n > 2) TIMES(4, 3); else TIMES(2, 3); break;
    case 2: if (n > 4) TIMES(8, 2); else if (n > 2) TIMES(4, 2); else TIMES(2, 2); break;
    default: if (n > 4) TIMES(8, 1); else if (n > 2) TIMES(4, 1); else TIMES(2, 1); break;
    }
#undef TIMES
}

/* The first `rows` of the A operand's 16 rows times CNT (1 to 4) B tiles, a group of rows at a time; the
   rows left after the whole groups (a sequence's last block: 2 of 16 at 50 tokens) as the fewest that
   cover them, not a whole group: one head of the plain 28x28 ViT's attention in cache took 3.1-3.2 µs
   forward and 6.5 backward against 3.3 and 6.8-7.0 (a C harness), the same results bit for bit; its
   training step measured 1.00x (docs/performance.md), the attention being 13% of it. */
static void tile_rows(int rows, int cnt, const uint8_t *a, int64_t as, const uint32_t *b, int64_t bes, int64_t bts,
                      int np, float *out, int64_t ors, int64_t oes)
{
    const int group = cnt > 2 ? 4 : 8;
    for (int r0 = 0; r0 < rows; r0 += group)
        some_rows(rows - r0 < group ? rows - r0 : group, cnt, a + r0 * as, as, b, bes, bts, np, out + r0 * ors, ors,
                  oes);
}

/* s[16][ls] (float32, cols < 16 nb) = the A rows xa (stride xs bytes, d / 32 steps along the sum) times
   the transposed-packed y (pack_transposed's layout); rows past `rows` may be left unwritten. */
static void scores(const uint16_t *xa, int64_t xs, int rows, const uint32_t *yt, int nb, int d, float *s, int64_t ls)
{
    const int nds = d / 32;
    for (int jb = 0; jb < nb; jb += 4) {
        const int cnt = nb - jb < 4 ? nb - jb : 4;
        tile_rows(rows, cnt, (const uint8_t *)xa, xs, yt + (int64_t)jb * nds * 256, nds * 256, 256, nds * 16,
                  s + jb * 16, ls, 16);
    }
}

/* ob[cnt][16][16] (float32) = the A rows a (stride as bytes; the sum over its first kn columns, in ns steps
   of 32) times pair-packed y's 16-col blocks db0 .. db0 + cnt - 1 (pack_pairs' layout, zero past kn);
   rows past `rows` may be left unwritten. */
static void times_pairs(const uint16_t *a, int64_t as, int rows, const uint16_t *yp, int ns, int kn, int ndb,
                        int db0, int cnt, float *ob)
{
    (void)ns;
    tile_rows(rows, cnt, (const uint8_t *)a, as, (const uint32_t *)yp + (int64_t)db0 * 256, 256, (int64_t)ndb * 256,
              (kn + 1) / 2, ob, 16, 256);
}

static inline void products_on(void) {}
static inline void products_off(void) {}

#define ATTENTION_FWD vs_attention_bf16_fwd
#define ATTENTION_BWD vs_attention_bf16_bwd
#include "attention_bf16.h"
