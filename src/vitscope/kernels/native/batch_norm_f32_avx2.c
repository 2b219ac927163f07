/* BatchNorm followed by the exact GELU, for the conv stem's float32 channels-last activations, with AVX2 and FMA
   (CPUs without AVX-512): the input is `rows` = B·H·W rows of C contiguous floats (C a multiple of 8), one
   row a pixel. As batch_norm.c does for bfloat16, with the GELU from normal_avx2.h (gelu_f32_avx2.c's).

   PyTorch runs them as separate passes each way: BatchNorm writes its output, GELU reads it back (and keeps
   it for the backward, where it computes erfc and exp again), GELU's input gradient is written for
   BatchNorm's backward to read twice. Here, forward: the batch's per-channel statistics (two passes over
   the input, float32 sums over blocks of BLOCK rows and float64 across them), then one pass that
   normalises and writes GELU's value and its derivative. Backward, from GELU's output gradient g and
   the kept derivative d, with dy = g d and xhat = (a - mean) rstd: the sums of dy and dy xhat
   (BatchNorm's bias and weight gradients) in one pass, then da = gamma rstd (dy - mean(dy) - xhat
   mean(dy xhat)) in another. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "normal_avx2.h"
#include "subnormals.h"

enum { BLOCK = 32, MAXC = 1024 };

/* acc[j] += sums[j] widened to float64, for j < c */
static inline void add_wide(double *acc, const float *sums, int64_t c)
{
    for (int64_t j = 0; j < c; j += 8) {
        const __m256 s = _mm256_loadu_ps(sums + j);
        _mm256_storeu_pd(acc + j, _mm256_add_pd(_mm256_loadu_pd(acc + j), _mm256_cvtps_pd(_mm256_castps256_ps128(s))));
        _mm256_storeu_pd(acc + j + 4, _mm256_add_pd(_mm256_loadu_pd(acc + j + 4),
                                                    _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1))));
    }
}

/* The statistics and the backward are batch_norm_sums.h's, over vectors of 8 floats. */
typedef float elem_t;
typedef __m256 vec_t;
enum { VW = 8 };
#define v_load _mm256_loadu_ps
#define v_store _mm256_storeu_ps
#define v_in _mm256_loadu_ps
#define v_out _mm256_storeu_ps
#define v_zero _mm256_setzero_ps
#define v_set1 _mm256_set1_ps
#define v_add _mm256_add_ps
#define v_sub _mm256_sub_ps
#define v_mul _mm256_mul_ps
#define v_fmadd _mm256_fmadd_ps
#define BN_STATS vs_bn_stats_f32
#define BN_GELU_BWD vs_bn_gelu_f32_bwd
#include "batch_norm_sums.h"

/* h = gelu(a scale + shift) and d = gelu'(same), each (rows, c); d may be NULL. */
void vs_bn_gelu_f32_fwd(const float *a, int64_t rows, int64_t c, const float *scale, const float *shift, float *h,
                        float *d, int threads)
{
#pragma omp parallel num_threads(threads)
    {
        const unsigned csr = subnormals_off();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < c; j += 8) {
                const int64_t o = r * c + j;
                const __m256 y = _mm256_fmadd_ps(_mm256_loadu_ps(a + o), _mm256_loadu_ps(scale + j),
                                                 _mm256_loadu_ps(shift + j));
                __m256 hv, dv;
                gelu_and_grad8(y, &hv, &dv);
                _mm256_storeu_ps(h + o, hv);
                if (d) _mm256_storeu_ps(d + o, dv);
            }
        subnormals_restore(csr);
    }
}
