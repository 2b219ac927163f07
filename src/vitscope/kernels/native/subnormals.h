/* The thread's floating-point mode around a kernel's work: subnormals flushed to zero, for every
   instruction set (SSE's MXCSR). */
#ifndef VS_SUBNORMALS_H
#define VS_SUBNORMALS_H

#include <immintrin.h>

/* Flush subnormal results to zero and read subnormal inputs as zero (MXCSR's FTZ and DAZ bits) in this
   thread, returning the old MXCSR for `subnormals_restore`. A subnormal costs a microcode assist of
   over a hundred cycles: GELU's tail for |x| > 9, or a softmax weight of 2^-125 times a small
   gradient, made whole kernels 3-25x slower. Every such value is below bfloat16's smallest normal
   number, 1.2e-38, far under anything a bfloat16 result keeps. */
static inline unsigned subnormals_off(void)
{
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);
    return csr;
}

static inline void subnormals_restore(unsigned csr) { _mm_setcsr(csr); }

#endif
