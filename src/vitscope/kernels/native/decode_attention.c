/* The cross-attention of one decoding step in bfloat16: each image's few queries (its beams' newest tokens)
   against the N keys and values cached for that image, every weight written out in float32.

   PyTorch runs it as two batched products of one query row each (q kᵀ and w v), which its bfloat16 kernels
   take at a few GFLOP/s. Here the keys and values are packed once per decoding, so that AVX512-BF16's pair
   dot product takes 16 keys (scores) or 16 head dims (output) per instruction:

       kp (B·H, D/2, Np, 2): key j's head dims 2p and 2p+1 side by side, 16 keys a vector
       vp (B·H, Np/2, D, 2): keys 2t and 2t+1's value at one head dim side by side, 16 dims a vector

   with Np = N rounded up to 16 and zeros past N. For each (image, head) and each query: the scores in float32
   (exact products, float32 sums), times the scale, -inf where `keep` says no or past N; the softmax in
   float32; the weights written to w (B, H, G, N); then the output sum_j w_j v_j with the weights rounded to
   bfloat16 (as `attend` rounds them before its product), float32 sums, rounded once, written at
   out + b·osb + g·osg + h·D, the (B, G, H·D) layout the output projection reads. A query with no key to look
   at gets zero weights and a zero output, as `attend` gives it. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

static inline __m512i pair_at(const uint16_t *p)
{
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return _mm512_set1_epi32(pair);
}

void vs_decode_attention_bf16(const uint16_t *q, int64_t qsb, int64_t qsh, int64_t qsg, const uint16_t *kp,
                              const uint16_t *vp, const uint8_t *keep, int64_t B, int64_t H, int64_t G, int64_t N,
                              int64_t D, float scale, float *w, uint16_t *out, int64_t osb, int64_t osg,
                              float *work, int threads)
{
    const int64_t np = (N + 15) / 16 * 16;
    const __m512 minus_inf = _mm512_set1_ps(-__builtin_inff());
    const float log2e = 1.4426950408889634f;
#pragma omp parallel num_threads(threads)
    {
        float *s = work + (int64_t)omp_get_thread_num() * np * 2;  /* scores, then weights */
        uint16_t *wb = (uint16_t *)(s + np);                                /* weights in bfloat16 */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            const int64_t b = bh / H, h = bh % H;
            const uint16_t *kb = kp + bh * (D / 2) * np * 2, *vb = vp + bh * (np / 2) * D * 2;
            const uint8_t *kr = keep ? keep + b * N : NULL;
            for (int64_t g = 0; g < G; g++) {
                const uint16_t *qg = q + b * qsb + h * qsh + g * qsg;
                __m512 top = minus_inf;
                for (int64_t c = 0; c < np; c += 16) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t p = 0; p < D / 2; p++)
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kb + (p * np + c) * 2),
                                               (__m512bh)pair_at(qg + 2 * p));
                    __mmask16 valid = N - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - c)) - 1u);
                    if (kr)
                        valid = _mm_mask_cmpneq_epi8_mask(valid, _mm_maskz_loadu_epi8(valid, kr + c),
                                                          _mm_setzero_si128());
                    acc = _mm512_mask_blend_ps(valid, minus_inf, _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
                    _mm512_storeu_ps(s + c, acc);
                    top = _mm512_max_ps(top, acc);
                }
                const float m = _mm512_reduce_max_ps(top);
                float *wg = w ? w + (bh * G + g) * N : NULL;
                uint16_t *og = out + b * osb + g * osg + h * D;
                if (m == -__builtin_inff()) {  /* no key to look at */
                    if (wg) memset(wg, 0, N * sizeof(float));
                    memset(og, 0, D * sizeof(uint16_t));
                    continue;
                }
                __m512 total = _mm512_setzero_ps();
                for (int64_t c = 0; c < np; c += 16) {
                    const __m512 x = _mm512_loadu_ps(s + c);
                    const __mmask16 live = _mm512_cmp_ps_mask(x, minus_inf, _CMP_NEQ_OQ);
                    const __m512 e = _mm512_maskz_mov_ps(
                        live, exp2_ps(_mm512_mul_ps(_mm512_sub_ps(x, _mm512_set1_ps(m)), _mm512_set1_ps(log2e))));
                    _mm512_storeu_ps(s + c, e);
                    total = _mm512_add_ps(total, e);
                }
                const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
                for (int64_t c = 0; c < np; c += 32) {
                    const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(s + c), inv);
                    const __m512 hi = c + 16 < np ? _mm512_mul_ps(_mm512_loadu_ps(s + c + 16), inv)
                                                  : _mm512_setzero_ps();
                    if (wg) {
                        const __mmask16 m0 = N - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - c)) - 1u);
                        _mm512_mask_storeu_ps(wg + c, m0, lo);
                        if (N > c + 16) {
                            const __mmask16 m1 = N - c - 16 >= 16 ? (__mmask16)0xffff
                                                                  : (__mmask16)((1u << (N - c - 16)) - 1u);
                            _mm512_mask_storeu_ps(wg + c + 16, m1, hi);
                        }
                    }
                    _mm512_storeu_si512(wb + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
                __m512 acc[8];
                for (int64_t d = 0; d < D / 16; d++) acc[d] = _mm512_setzero_ps();
                for (int64_t t = 0; t < np / 2; t++) {
                    const __m512bh pair = (__m512bh)pair_at(wb + 2 * t);
                    for (int64_t d = 0; d < D / 16; d++)
                        acc[d] = _mm512_dpbf16_ps(acc[d], (__m512bh)_mm512_loadu_si512(vb + (t * D + d * 16) * 2),
                                                  pair);
                }
                for (int64_t d = 0; d < D / 16; d++)
                    _mm256_storeu_si256((__m256i *)(og + d * 16), (__m256i)_mm512_cvtneps_pbh(acc[d]));
            }
        }
    }
}
