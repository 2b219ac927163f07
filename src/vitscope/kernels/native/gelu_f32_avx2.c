/* Exact (erf) GELU in float32 with AVX2 and FMA, forward and backward, for CPUs without AVX-512.

   gelu(x) = x Phi(x) and gelu'(x) = Phi(x) + x phi(x), with Phi the normal distribution function and phi its
   density. Phi comes from erfc rather than from 1 + erf, so it keeps its relative accuracy for negative x
   (where 1 + erf cancels): with z = |x| / sqrt 2, erfc(z) = t P(t) exp(-z^2), t = 1 / (1 + p z), and P a
   degree-9 polynomial fitted in float64 for relative error over z in [0, 9] (7.8e-9 at most, below float32's
   6e-8); Phi(x) = 1 - erfc(z) / 2 for x >= 0, erfc(z) / 2 below; phi shares the exponential. Past z = 9
   (x < -12.7) Phi is taken as 0. Measured in float32 over [-14, 14] and N(0, 9) samples: largest error
   3.8e-7 for gelu and 3.1e-7 for gelu' against float64, as PyTorch's float32 kernels (3.8e-7, 2.9e-7).

   The backward recomputes gelu'(x) from x, as PyTorch's does, so both read and write what PyTorch's read
   and write. On a 2-core Zen 3 EPYC at 12800 x 512 the forward took 3.8-4.2 ms against PyTorch's 4.2-5.5,
   the backward 4.6-4.9 against 7.8-9.5 (benchmarks/ab_float32_ops.py). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "normal_avx2.h"

#define CHUNK 4096 /* floats a thread takes at a time */

static inline __m256 load_tail(const float *p, int n)
{
    float b[8] = {0};
    memcpy(b, p, sizeof(float) * (size_t)n);
    return _mm256_loadu_ps(b);
}

static inline void store_tail(float *p, __m256 v, int n)
{
    float b[8];
    _mm256_storeu_ps(b, v);
    memcpy(p, b, sizeof(float) * (size_t)n);
}

static inline __m256 gelu8(__m256 x)
{
    __m256 Phi, phi;
    normal(x, &Phi, &phi);
    return _mm256_mul_ps(x, Phi);
}

static inline __m256 gelu_grad8(__m256 x, __m256 g)
{
    __m256 Phi, phi;
    normal(x, &Phi, &phi);
    return _mm256_mul_ps(g, _mm256_fmadd_ps(x, phi, Phi));
}

/* h[i] = gelu(x[i]) for i < n; h may be x (in place). */
void vs_gelu_f32(const float *x, float *h, int64_t n, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t end = c0 + CHUNK < n ? c0 + CHUNK : n;
        int64_t i = c0;
        for (; i + 8 <= end; i += 8) _mm256_storeu_ps(h + i, gelu8(_mm256_loadu_ps(x + i)));
        if (i < end) store_tail(h + i, gelu8(load_tail(x + i, (int)(end - i))), (int)(end - i));
    }
}

/* gx[i] = g[i] gelu'(x[i]) for i < n; gx may be g (in place). */
void vs_gelu_f32_bwd(const float *x, const float *g, float *gx, int64_t n, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        const int64_t end = c0 + CHUNK < n ? c0 + CHUNK : n;
        int64_t i = c0;
        for (; i + 8 <= end; i += 8)
            _mm256_storeu_ps(gx + i, gelu_grad8(_mm256_loadu_ps(x + i), _mm256_loadu_ps(g + i)));
        if (i < end) {
            const int r = (int)(end - i);
            store_tail(gx + i, gelu_grad8(load_tail(x + i, r), load_tail(g + i, r)), r);
        }
    }
}
