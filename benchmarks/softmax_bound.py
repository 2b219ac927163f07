"""An upper bound on attention's forward rate from its softmax alone: the exps, timed with torch.exp.

    python benchmarks/softmax_bound.py [--sizes 2048 4096]

A softmax attention forward over N keys evaluates exp N² times per head, next to 4·N²·D
multiply-add FLOPs (q kᵀ and the mix with v). However fast the matmuls run, a forward cannot take
less time than those exps, so its rate is at most 4·D FLOPs per exp times the machine's exp rate.
This measures that exp rate (`torch.exp` on 4097² elements, float32 and bfloat16, the best of five
calls after a warm-up) and prints the bound for bench_attention.py's head width (D = 64) as a share
of this machine's torch.mm peak in each dtype (measured as bench_attention.py does): the highest share
any kernel that computes exact exps at torch's rate could reach.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402
from bench_attention import run_peak  # noqa: E402

HEAD_DIM = 64  # bench_attention.py's ViT-S heads
ELEMENTS = 4097 * 4097


def exp_rate(dtype: torch.dtype, repeats: int = 5) -> float:
    """Elements per second of torch.exp on ELEMENTS values of `dtype` (the best of `repeats` calls)."""
    x = torch.randn(ELEMENTS, dtype=dtype) - 4  # softmax arguments are <= 0 after the max is taken
    out = torch.empty_like(x)
    torch.exp(x, out=out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.exp(x, out=out)
        best = min(best, time.perf_counter() - t0)
    return ELEMENTS / best


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096],
                    help="square torch.mm sizes for the peak (default 2048 4096; emulated bfloat16 takes 128-512)")
    args = ap.parse_args(argv)
    print(machine_header())
    print("\n| dtype | exp rate, G elements/s | bound: GFLOP/s at D = 64 | torch.mm peak, GFLOP/s "
          "| bound as % of peak |")
    print("|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        rate = exp_rate(dtype)
        bound = 4 * HEAD_DIM * rate / 1e9
        name = str(dtype).removeprefix('torch.')
        spec = {"threads": torch.get_num_threads(), "dtype": name, "sizes": args.sizes, "repeats": 6}
        peak = run_peak(spec)["gflops"]
        print(f"| {name} | {rate / 1e9:.2f} | {bound:,.0f} | {peak:,.0f} | "
              f"{100 * bound / peak:.0f} |")


if __name__ == "__main__":
    main()
