/* Short-sequence attention for bfloat16 on CPUs with AMX (Intel Sapphire Rapids and later), forward and
   backward: attention_bf16.h's kernels with their products in AMX tiles.

   o = softmax(scale q k^T) v, one (batch, head) at a time, for N_k <= 256 keys and head dims that are
   multiples of 32 up to 128: every ViT on 224x224 images with patch 16 or larger, and the 28x28
   presets. A (batch, head)'s keys and values are repacked once into AMX's pair-interleaved layout, then
   for each block of 16 queries the scores (16 x N_k, float32) come from tile multiplies, the softmax
   runs on them in AVX-512 (exp2 by a degree-6 polynomial and scalef, within 2.4 float32 ulps), the
   unnormalised weights are rounded to bfloat16 and multiplied into v in tiles, and each output row is
   divided by its sum and rounded once. PyTorch's flash kernel spends most of its time at these sizes
   on per-block overhead; this one keeps a whole head's scores in L1.

   Built by vitscope/kernels/native/__init__.py with the system C compiler and loaded with ctypes; OpenMP
   comes from the libgomp that torch has already loaded, so both share one thread pool. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>

#include "simd.h"

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* Linux gives a process AMX's tile state only when asked (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
   Returns 0 on success. */
int vs_amx_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

/* GCC's AMX intrinsics are inline asm that do not tell the compiler which memory they read or write
   (ldtilecfg's operand covers only 8 bytes, tile loads and stores none): at -O2 GCC dropped the tile
   config's stores and the kernel faulted. Every tile instruction that touches memory goes through
   these, with a compiler memory barrier on its side. */
#define BARRIER() __asm__ volatile("" ::: "memory")
#define TILE_LOAD(t, p, stride) do { BARRIER(); _tile_loadd(t, p, stride); } while (0)
#define TILE_STORE(t, p, stride) do { _tile_stored(t, p, stride); BARRIER(); } while (0)

static void tiles_on(void)
{
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.colsb[t] = 64; c.rows[t] = 16; }
    BARRIER();
    _tile_loadconfig(&c);
    BARRIER();
}

/* s[16][ls] (float32, cols < 16 * nb) = x rows (A operand, stride xs bytes) times packed y^T. Up to four
   16-col blocks at a time, each in its own accumulator tile, so that one A load serves four multiplies
   and consecutive multiplies do not wait on one another. */
static void scores(const uint16_t *xa, int64_t xs, int rows, const uint32_t *yt, int nb, int d, float *s,
                   int64_t ls)
{
    (void)rows;  /* a tile multiplies all 16 rows */
    const int nds = d / 32;
    for (int jb = 0; jb < nb; jb += 4) {
        const int cnt = nb - jb < 4 ? nb - jb : 4;
        _tile_zero(4);
        if (cnt > 1) _tile_zero(5);
        if (cnt > 2) _tile_zero(6);
        if (cnt > 3) _tile_zero(7);
        for (int ds = 0; ds < nds; ds++) {
            TILE_LOAD(0, xa + ds * 32, xs);
            TILE_LOAD(1, yt + (jb * nds + ds) * 256, 64);
            _tile_dpbf16ps(4, 0, 1);
            if (cnt > 1) { TILE_LOAD(2, yt + ((jb + 1) * nds + ds) * 256, 64); _tile_dpbf16ps(5, 0, 2); }
            if (cnt > 2) { TILE_LOAD(3, yt + ((jb + 2) * nds + ds) * 256, 64); _tile_dpbf16ps(6, 0, 3); }
            if (cnt > 3) { TILE_LOAD(1, yt + ((jb + 3) * nds + ds) * 256, 64); _tile_dpbf16ps(7, 0, 1); }
        }
        TILE_STORE(4, s + jb * 16, ls * 4);
        if (cnt > 1) TILE_STORE(5, s + (jb + 1) * 16, ls * 4);
        if (cnt > 2) TILE_STORE(6, s + (jb + 2) * 16, ls * 4);
        if (cnt > 3) TILE_STORE(7, s + (jb + 3) * 16, ls * 4);
    }
}

/* ob[cnt][16][16] (float32) = rows of a (bfloat16, stride as bytes, ns steps of 32 along the sum) times
   pair-packed y's 16-col blocks db0 .. db0 + cnt - 1 (cnt <= 4), each in its own accumulator tile. */
static void times_pairs(const uint16_t *a, int64_t as, int rows, const uint16_t *yp, int ns, int kn, int ndb,
                        int db0, int cnt, float *ob)
{
    (void)rows, (void)kn;  /* a tile multiplies all 16 rows and 32 terms of the sum */
    _tile_zero(4);
    if (cnt > 1) _tile_zero(5);
    if (cnt > 2) _tile_zero(6);
    if (cnt > 3) _tile_zero(7);
    for (int js = 0; js < ns; js++) {
        const uint16_t *b = yp + (js * ndb + db0) * 512;
        TILE_LOAD(0, a + js * 32, as);
        TILE_LOAD(1, b, 64);
        _tile_dpbf16ps(4, 0, 1);
        if (cnt > 1) { TILE_LOAD(2, b + 512, 64); _tile_dpbf16ps(5, 0, 2); }
        if (cnt > 2) { TILE_LOAD(3, b + 1024, 64); _tile_dpbf16ps(6, 0, 3); }
        if (cnt > 3) { TILE_LOAD(1, b + 1536, 64); _tile_dpbf16ps(7, 0, 1); }
    }
    TILE_STORE(4, ob, 64);
    if (cnt > 1) TILE_STORE(5, ob + 256, 64);
    if (cnt > 2) TILE_STORE(6, ob + 512, 64);
    if (cnt > 3) TILE_STORE(7, ob + 768, 64);
}

static inline void products_on(void) { tiles_on(); }
static inline void products_off(void) { _tile_release(); }

#define ATTENTION_FWD vs_attention_fwd
#define ATTENTION_BWD vs_attention_bwd
#include "attention_bf16.h"
