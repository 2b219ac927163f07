/* Short-sequence attention forward for bfloat16 on CPUs with AMX (Intel Sapphire Rapids and later).

   o = softmax(scale q k^T) v, one (batch, head) at a time, for N_k <= 256 keys and head dims that are
   multiples of 32 up to 128: every ViT on 224x224 images with patch 16 or larger, and the 28x28
   presets. A (batch, head)'s keys and values are repacked once into AMX's pair-interleaved layout, then
   for each block of 16 queries the scores (16 x N_k, float32) come from tile multiplies, the softmax
   runs on them in AVX-512 (exp2 by a degree-6 polynomial and scalef, within 2 float32 ulps), the
   unnormalised weights are rounded to bfloat16 and multiplied into v in tiles, and each output row is
   divided by its sum and rounded once. PyTorch's flash kernel spends most of its time at these sizes
   on per-block overhead; this one keeps a whole head's scores in L1.

   Built by vitscope/native/__init__.py with the system C compiler and loaded with ctypes; OpenMP
   comes from the libgomp that torch has already loaded, so both share one thread pool. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* Linux gives a process AMX's tile state only when asked (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
   Returns 0 on success. */
int vs_amx_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

static void tiles_on(void)
{
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.colsb[t] = 64; c.rows[t] = 16; }
    _tile_loadconfig(&c);
}

static inline __m512 exp2_ps(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}


/* r[i][j] (16 x 16 dwords) -> r[j][i] */
static inline void transpose16(__m512i r[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        __m512i a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), b = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        __m512i c = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xee), e = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xee);
        r[m] = _mm512_shuffle_i32x4(a, b, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(a, b, 0xdd);
        r[8 + m] = _mm512_shuffle_i32x4(c, e, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(c, e, 0xdd);
    }
}

#define MAXK 256
#define MAXD 128

/* o = softmax(scale q k^T) v for one (batch, head). q (nq, d), k and v (nk, d), o (nq, d);
   rows at the given strides (elements), the last dim contiguous. */
static void one_head(const uint16_t *q, int64_t sq, const uint16_t *k, int64_t sk,
                     const uint16_t *v, int64_t sv, uint16_t *o, int64_t so,
                     int nq, int nk, int d, float c)
{
    _Alignas(64) uint32_t kp[MAXK / 16][MAXD / 32][16][16];
    _Alignas(64) uint16_t vp[MAXK / 32][MAXD / 16][16][32];
    _Alignas(64) uint16_t qpad[16][MAXD];
    _Alignas(64) float s[16][MAXK];
    _Alignas(64) uint16_t p[16][MAXK];
    _Alignas(64) float ob[16][16];
    float inv[16];
    const int njb = (nk + 15) / 16, njs = (nk + 31) / 32, nds = d / 32, ndb = d / 16;

    /* k as the B operand of q k^T: for 16 keys and 32 dims, the 16 x 16 transpose of (key, dim pair). */
    for (int jb = 0; jb < njb; jb++)
        for (int ds = 0; ds < nds; ds++) {
            __m512i r[16];
            for (int cc = 0; cc < 16; cc++) {
                int key = jb * 16 + cc;
                r[cc] = key < nk ? _mm512_loadu_si512(k + (int64_t)key * sk + ds * 32) : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int rr = 0; rr < 16; rr++) _mm512_store_si512(&kp[jb][ds][rr][0], r[rr]);
        }
    /* v as the B operand of p v: rows 2r and 2r+1 interleaved element by element, 16 dims a tile. */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int js = 0; js < njs; js++)
        for (int r = 0; r < 16; r++) {
            int k0 = js * 32 + 2 * r, k1 = k0 + 1;
            for (int e = 0; e < d / 32; e++) {
                __m512i a = k0 < nk ? _mm512_loadu_si512(v + (int64_t)k0 * sv + e * 32) : _mm512_setzero_si512();
                __m512i b = k1 < nk ? _mm512_loadu_si512(v + (int64_t)k1 * sv + e * 32) : _mm512_setzero_si512();
                _mm512_store_si512(&vp[js][2 * e][r][0], _mm512_permutex2var_epi16(a, lo, b));
                _mm512_store_si512(&vp[js][2 * e + 1][r][0], _mm512_permutex2var_epi16(a, hi, b));
            }
        }
    const int nvec = njb;                      /* 16-wide vectors per score row */
    const __mmask16 last = (__mmask16)((1u << (nk - (nvec - 1) * 16)) - 1u);
    for (int i0 = 0; i0 < nq; i0 += 16) {
        const int rows = nq - i0 < 16 ? nq - i0 : 16;
        const uint16_t *qa = q + (int64_t)i0 * sq;
        int64_t qstride = sq * 2;
        if (rows < 16) {
            memset(qpad, 0, sizeof qpad);
            for (int r = 0; r < rows; r++) memcpy(qpad[r], q + (int64_t)(i0 + r) * sq, (size_t)d * 2);
            qa = &qpad[0][0];
            qstride = MAXD * 2;
        }
        for (int jb = 0; jb < njb; jb++) {
            _tile_zero(2);
            for (int ds = 0; ds < nds; ds++) {
                _tile_loadd(0, qa + ds * 32, qstride);
                _tile_loadd(1, &kp[jb][ds][0][0], 64);
                _tile_dpbf16ps(2, 0, 1);
            }
            _tile_stored(2, &s[0][jb * 16], MAXK * 4);
        }
        const __m512 cs = _mm512_set1_ps(c);
        /* Rows past nq are skipped: whatever their weights hold only reaches their own output rows,
           which are never stored. Columns past nk get weight 0 (and v's padding rows are 0). */
        for (int r = 0; r < rows; r++) {
            __m512 m = _mm512_set1_ps(-INFINITY);
            for (int jv = 0; jv < nvec; jv++) {
                __mmask16 mk = jv == nvec - 1 ? last : (__mmask16)0xffff;
                __m512 x = _mm512_maskz_mul_ps(mk, _mm512_load_ps(&s[r][jv * 16]), cs);
                x = _mm512_mask_blend_ps(mk, _mm512_set1_ps(-INFINITY), x);
                _mm512_store_ps(&s[r][jv * 16], x);
                m = _mm512_max_ps(m, x);
            }
            const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
            __m512 sum = _mm512_setzero_ps();
            for (int jv = 0; jv < nvec; jv++) {
                __mmask16 mk = jv == nvec - 1 ? last : (__mmask16)0xffff;
                __m512 e = _mm512_maskz_mov_ps(mk, exp2_ps(_mm512_sub_ps(_mm512_load_ps(&s[r][jv * 16]), mx)));
                sum = _mm512_add_ps(sum, e);
                _mm256_store_si256((__m256i *)&p[r][jv * 16], (__m256i)_mm512_cvtneps_pbh(e));
            }
            if (nvec & 1) _mm256_store_si256((__m256i *)&p[r][nvec * 16], _mm256_setzero_si256());
            inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
        }
        for (int db = 0; db < ndb; db++) {
            _tile_zero(2);
            for (int js = 0; js < njs; js++) {
                _tile_loadd(3, &p[0][js * 32], MAXK * 2);
                _tile_loadd(4, &vp[js][db][0][0], 64);
                _tile_dpbf16ps(2, 3, 4);
            }
            _tile_stored(2, &ob[0][0], 64);
            for (int r = 0; r < rows; r++) {
                __m512 y = _mm512_mul_ps(_mm512_load_ps(ob[r]), _mm512_set1_ps(inv[r]));
                _mm256_storeu_si256((__m256i *)(o + (int64_t)(i0 + r) * so + db * 16), (__m256i)_mm512_cvtneps_pbh(y));
            }
        }
    }
}

/* q, k, v, o: (B, H, N, D) bf16 at strides st[0..2] (q), st[3..5] (k), st[6..8] (v), st[9..11] (o).
   Runs on `threads` OpenMP threads. Returns 0, or -1 when the shape is outside what the kernel handles. */
int vs_attention_fwd(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *o,
                     int64_t b, int64_t h, int64_t nq, int64_t nk, int64_t d, const int64_t *st, float scale,
                     int threads)
{
    if (nk < 1 || nk > MAXK || d % 32 || d > MAXD || nq < 1 || b < 1 || h < 1 || threads < 1) return -1;
    const float c = scale * 1.4426950408889634f; /* scores go to exp2 */
#pragma omp parallel num_threads(threads)
    {
        tiles_on();
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * h; bh++) {
            int64_t bi = bh / h, hi = bh % h;
            one_head(q + bi * st[0] + hi * st[1], st[2], k + bi * st[3] + hi * st[4], st[5],
                     v + bi * st[6] + hi * st[7], st[8], o + bi * st[9] + hi * st[10], st[11],
                     (int)nq, (int)nk, (int)d, c);
        }
        _tile_release();
    }
    return 0;
}
