/* The residual add of a bfloat16 branch into the float32 stream: out = x + y, in one pass.

   Under autocast a block's attention and MLP end in bfloat16, and `x + y` with a float32 x makes
   PyTorch first copy y into a new float32 tensor and then add: three passes over the activation
   where one does. The sum is the same float32 number either way (y widens exactly). */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

void vs_add_bf16(const float *x, const uint16_t *y, float *out, int64_t n, int threads)
{
    const int64_t chunk = 8192, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        for (int64_t i = c * chunk; i < end; i += 16) {
            const __mmask16 m = end - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (end - i)) - 1u);
            const __m512 yv = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, y + i));
            _mm512_mask_storeu_ps(out + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, x + i), yv));
        }
    }
}
