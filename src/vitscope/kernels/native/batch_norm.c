/* BatchNorm followed by the exact GELU, for the conv stem's bfloat16 channels-last activations: the
   input is `rows` = B·H·W rows of C contiguous bfloat16 values (C a multiple of 16), one row a pixel.

   PyTorch runs them as three passes each way under bfloat16 autocast: BatchNorm writes its bfloat16
   output, GELU reads it back, and in the backward GELU's gradient is written for BatchNorm's backward
   to read twice. Here, forward: the batch's per-channel statistics (two passes over the input, the
   sums in float32 over 64-row blocks and float64 across them), then one pass that normalises, rounds
   to bfloat16 as BatchNorm's output would be, and looks GELU and its derivative up in gelu.c's table.
   Backward, from GELU's output gradient g and the kept derivative d, with dy = g d and
   xhat = (a - mean) rstd: the sums of dy and dy xhat (BatchNorm's bias and weight gradients) in one
   pass, then da = gamma rstd (dy - mean(dy) - xhat mean(dy xhat)) in another; dy stays in float32
   (PyTorch rounds it to bfloat16 between the two ops). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

extern uint32_t vs_gelu_table[65536];

enum { BLOCK = 64, MAXC = 1024 };

static inline __m512 load_bf16(const uint16_t *p) { return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)p)); }

/* acc[j] += the block's float32 sums, widened to float64 */
static inline void add_wide(double *acc, const float *sums, int64_t c)
{
    for (int64_t j = 0; j < c; j += 16) {
        const __m512 s = _mm512_loadu_ps(sums + j);
        _mm512_storeu_pd(acc + j, _mm512_add_pd(_mm512_loadu_pd(acc + j), _mm512_cvtps_pd(_mm512_castps512_ps256(s))));
        _mm512_storeu_pd(acc + j + 8, _mm512_add_pd(_mm512_loadu_pd(acc + j + 8),
                                                    _mm512_cvtps_pd(_mm512_extractf32x8_ps(s, 1))));
    }
}

/* The statistics and the backward are batch_norm_sums.h's, over vectors of 16 bfloat16 values read as floats. */
typedef uint16_t elem_t;
typedef __m512 vec_t;
enum { VW = 16 };
#define v_load _mm512_loadu_ps
#define v_store _mm512_storeu_ps
#define v_in load_bf16
#define v_out(p, v) _mm256_storeu_si256((__m256i *)(p), (__m256i)_mm512_cvtneps_pbh(v))
#define v_zero _mm512_setzero_ps
#define v_set1 _mm512_set1_ps
#define v_add _mm512_add_ps
#define v_sub _mm512_sub_ps
#define v_mul _mm512_mul_ps
#define v_fmadd _mm512_fmadd_ps
#define BN_STATS vs_bn_stats
#define BN_GELU_BWD vs_bn_gelu_bwd
#include "batch_norm_sums.h"

/* h = gelu(round(a scale + shift)) and d = gelu'(same), each (rows, c) bfloat16; d may be NULL. Blocks of
   rows (MAXC values) are normalised into a buffer first, then looked up in one flat loop: lookups
   straight after each 16-value vector store waited on it (2.9x slower), and a loop per 32-wide row
   cost as much again. */
void vs_bn_gelu_fwd(const uint16_t *a, int64_t rows, int64_t c, const float *scale, const float *shift, uint16_t *h,
                    uint16_t *d, int threads)
{
    const int64_t per = MAXC / c, blocks = (rows + per - 1) / per;
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = subnormals_off();
        uint16_t y[MAXC];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = b * per, n = ((r0 + per < rows ? r0 + per : rows) - r0) * c;
            const uint16_t *ab = a + r0 * c;
            for (int64_t o = 0; o < n; o += c)
                for (int64_t j = 0; j < c; j += 16) {
                    const __m512 v = _mm512_fmadd_ps(load_bf16(ab + o + j), _mm512_loadu_ps(scale + j), _mm512_loadu_ps(shift + j));
                    _mm256_storeu_si256((__m256i *)(y + o + j), (__m256i)_mm512_cvtneps_pbh(v));
                }
            uint16_t *hb = h + r0 * c;
            if (d) {
                uint16_t *db = d + r0 * c;
                for (int64_t i = 0; i < n; i++) {
                    const uint32_t t = vs_gelu_table[y[i]];
                    hb[i] = (uint16_t)t;
                    db[i] = (uint16_t)(t >> 16);
                }
            } else {
                for (int64_t i = 0; i < n; i++) hb[i] = (uint16_t)vs_gelu_table[y[i]];
            }
        }
        subnormals_restore(csr);
    }
}
