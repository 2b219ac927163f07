/* The CPU's bfloat16 multiply-add peak through AVX512-BF16: vdpbf16ps on 512-bit registers, 24 independent
   sums per thread (more than the instruction's latency times its rate), nothing read from memory. The ceiling
   for vitscope's bfloat16 kernels on CPUs without AMX (native/linear.c, weight_grad.c), which torch.mm's
   figure in bench_vit.py's header sits a little under.

       gcc -O3 -fopenmp -mavx512f -mavx512bf16 benchmarks/dpbf16_peak.c -o /tmp/dpbf16_peak
       /tmp/dpbf16_peak 2     # GFLOP/s on 2 threads (a vdpbf16ps is 32 multiply-adds: 64 FLOP)

   Prints GFLOP/s for 1 thread and for the given number. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

enum { SUMS = 24 };

static double gflops(int threads, long iters)
{
    float keep[256] = {0};
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
    {
        __m512 acc[SUMS];
        for (int s = 0; s < SUMS; s++) acc[s] = _mm512_set1_ps((float)s);
        __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f003f00);
        for (long it = 0; it < iters; it++) {
#pragma GCC unroll 24
            for (int s = 0; s < SUMS; s++) acc[s] = _mm512_dpbf16_ps(acc[s], a, b);
            __asm__ volatile("" : "+v"(a)); /* a loop-carried input: the compiler keeps every iteration */
        }
        __m512 total = acc[0];
        for (int s = 1; s < SUMS; s++) total = _mm512_add_ps(total, acc[s]);
        keep[omp_get_thread_num() % 256] = _mm512_reduce_add_ps(total);
    }
    const double seconds = omp_get_wtime() - t0;
    if (keep[0] == 1.0f) puts(""); /* the sums are used */
    return (double)threads * iters * SUMS * 64 / seconds / 1e9;
}

int main(int argc, char **argv)
{
    const int threads = argc > 1 ? atoi(argv[1]) : omp_get_max_threads();
    const long iters = 20000000;
    gflops(threads, iters / 10); /* clocks up */
    printf("vdpbf16ps peak: 1 thread %.0f GFLOP/s, %d threads %.0f GFLOP/s\n", gflops(1, iters), threads,
           gflops(threads, iters));
    return 0;
}
