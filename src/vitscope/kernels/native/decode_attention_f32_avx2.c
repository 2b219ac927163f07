/* The attention of one decoding step in float32 with AVX2 and FMA: each row's few queries (an image's beams'
   newest tokens, or a hypothesis' one token) against the N keys and values its cache holds, every weight
   written out where asked.

   PyTorch runs it as a dozen small ops: two batched products of one query row each (q kᵀ and w v), each 128
   tiny matrix products at caption_quick's shape, which ran at 7-8 GB/s of keys and values read, and the scale,
   masks, softmax and re-layouts between them. Here a whole (row, head) is one pass over its keys and values, in
   place at the cache's strides (nothing packed, so the self-attention's cache, which grows every step, is read
   as it is): for each query the scores in float32, eight keys at a time (each key's head dims multiplied
   8 at a time, the eight sums gathered into one vector by a horizontal-add tree), times the scale, -inf where
   `keep` says no; the softmax in float32 (simd_avx2.h's exp2); the weights written to w (B, H, G, N); then the
   output sum_j w_j v_j, written at out + b·osb + g·osg + h·D, the (B, G, H·D) layout the output projection
   reads. A query with no key to look at gets zero weights and a zero output, as `attend` gives it.
   D is a multiple of 8 up to 128. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd_avx2.h"

/* [sum(a[0]), ..., sum(a[7])]: the eight vectors' lane sums in one vector */
static inline __m256 sums8(const __m256 a[8])
{
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* per 128-bit half: 4 keys' sums */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

void vs_decode_attention_f32_avx2(const float *q, int64_t qsb, int64_t qsh, int64_t qsg, const float *k,
                                  int64_t ksb, int64_t ksh, int64_t ksn, const float *v, int64_t vsb, int64_t vsh,
                                  int64_t vsn, const uint8_t *keep, int64_t B, int64_t H, int64_t G, int64_t N,
                                  int64_t D, float scale, float *w, float *out, int64_t osb, int64_t osg,
                                  float *work, int threads)
{
    const int64_t np = (N + 7) / 8 * 8, dv = D / 8;
    const float log2e = 1.4426950408889634f, minus_inf = -__builtin_inff();
#pragma omp parallel num_threads(threads)
    {
        float *s = work + (int64_t)omp_get_thread_num() * np;  /* one query's scores, then its weights */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            const int64_t b = bh / H, h = bh % H;
            const float *kb = k + b * ksb + h * ksh, *vb = v + b * vsb + h * vsh;
            const uint8_t *kr = keep ? keep + b * N : NULL;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + b * qsb + h * qsh + g * qsg;
                __m256 qv[16];
                for (int64_t d = 0; d < dv; d++) qv[d] = _mm256_loadu_ps(qg + 8 * d);
                float m = minus_inf;
                int64_t j = 0;
                for (; j + 8 <= N; j += 8) {  /* eight keys: each one's products, then their sums side by side */
                    __m256 a[8];
                    for (int c = 0; c < 8; c++) {
                        const float *kj = kb + (j + c) * ksn;
                        __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj));
                        for (int64_t d = 1; d < dv; d++) acc = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kj + 8 * d), acc);
                        a[c] = acc;
                    }
                    _mm256_storeu_ps(s + j, _mm256_mul_ps(sums8(a), _mm256_set1_ps(scale)));
                }
                for (; j < N; j++) {  /* the last few, one at a time */
                    const float *kj = kb + j * ksn;
                    __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj));
                    for (int64_t d = 1; d < dv; d++) acc = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kj + 8 * d), acc);
                    s[j] = hsum8(acc) * scale;
                }
                for (j = 0; j < N; j++) {
                    if (kr && !kr[j]) s[j] = minus_inf;
                    m = s[j] > m ? s[j] : m;
                }
                float *wg = w ? w + (bh * G + g) * N : NULL;
                float *og = out + b * osb + g * osg + h * D;
                if (m == minus_inf) {  /* no key to look at */
                    if (wg) memset(wg, 0, N * sizeof(float));
                    memset(og, 0, D * sizeof(float));
                    continue;
                }
                for (j = N; j < np; j++) s[j] = minus_inf;
                const __m256 shift = _mm256_set1_ps(m * log2e), minus_inf8 = _mm256_set1_ps(minus_inf);
                __m256 total = _mm256_setzero_ps();
                for (j = 0; j < np; j += 8) {
                    const __m256 x = _mm256_loadu_ps(s + j);
                    const __m256 live = _mm256_cmp_ps(x, minus_inf8, _CMP_NEQ_OQ);
                    const __m256 e = _mm256_and_ps(live, exp2_ps8(_mm256_fmsub_ps(x, _mm256_set1_ps(log2e), shift)));
                    _mm256_storeu_ps(s + j, e);
                    total = _mm256_add_ps(total, e);
                }
                const __m256 inv = _mm256_set1_ps(1.0f / hsum8(total));
                for (j = 0; j < np; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
                if (wg) memcpy(wg, s, N * sizeof(float));
                __m256 acc[16];
                for (int64_t d = 0; d < dv; d++) acc[d] = _mm256_setzero_ps();
                for (j = 0; j < N; j++) {
                    const __m256 wj = _mm256_set1_ps(s[j]);
                    const float *vj = vb + j * vsn;
                    for (int64_t d = 0; d < dv; d++) acc[d] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8 * d), acc[d]);
                }
                for (int64_t d = 0; d < dv; d++) _mm256_storeu_ps(og + 8 * d, acc[d]);
            }
        }
    }
}
