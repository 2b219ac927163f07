"""A/B: vitscope's attention kernel against PyTorch's flash kernel at each length, call by call in one process.

    python benchmarks/ab_long_attention.py [--n 257 577 1025 4097] [--dtype float32] [--rounds 8]

bench_attention.py times each case in a process of its own, minutes apart; on a host whose speed drifts
by 10-20% that decides no close call. Here q, k and v are views of one fused projection's output
(B, N, 3·H·D), as a ViT's layer hands them over (`--contiguous`: separate (B, H, N, D) tensors), and
each round times one call of vitscope's kernel (`short_attention.attend`: the kernel at every length,
where `vitscope.attention.attend` may route a case to PyTorch's) and one of
`F.scaled_dot_product_attention`, forward in inference mode and forward with backward. The table gives
each one's median milliseconds and GFLOP/s, and PyTorch's time over vitscope's per round: its median and
range (above 1: vitscope is faster). B = round(4096 / N) as in bench_attention.py, 6
heads of 64 (ViT-S).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402
from vitscope.kernels import short_attention  # noqa: E402


def operands(n: int, b: int, h: int, d: int, dtype: torch.dtype, contiguous: bool):
    """q, k, v (B, H, N, D): views of one (B, N, 3·H·D) tensor, or contiguous copies."""
    qkv = torch.randn(b, n, 3 * h * d, generator=torch.Generator().manual_seed(n)).to(dtype)
    q, k, v = qkv.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
    return tuple(t.contiguous() for t in (q, k, v)) if contiguous else (q, k, v)


def timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def compare(q, k, v, backward: bool, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each implementation, alternating call by call, `rounds` times."""
    g = torch.randn(q.shape, dtype=q.dtype)
    impls = {"vitscope": short_attention.attend, "pytorch": F.scaled_dot_product_attention}

    def call(fn):
        if backward:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            fn(qq, kk, vv).backward(g)
        else:
            with torch.inference_mode():
                fn(q, k, v)

    for fn in impls.values():  # warm: buffers, the kernel library, PyTorch's dispatch
        call(fn)
    times = {name: [] for name in impls}
    for _ in range(rounds):
        for name, fn in impls.items():
            times[name].append(timed(lambda fn=fn: call(fn)))
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[257, 577, 1025, 4097], help="sequence lengths")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rounds", type=int, default=8, help="alternating calls of each per length and pass")
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--contiguous", action="store_true", help="separate contiguous q, k, v instead of qkv views")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    h, d = args.heads, args.head_dim
    probe = operands(8, 1, h, d, dtype, True)
    if short_attention.kernel_for(dtype) is None or not short_attention.usable(*probe):
        sys.exit(f"vitscope's {args.dtype} attention kernel does not run here: {short_attention.why_not(dtype)}")
    print(machine_header())
    layout = "contiguous (B, H, N, D)" if args.contiguous else "views of a fused (B, N, 3·H·D) qkv"
    print(f"\n{args.dtype} attention, {h} heads of {d}, q/k/v {layout}, {args.rounds} alternating calls each\n")
    print("| N | B | pass | vitscope ms | GFLOP/s | PyTorch ms | GFLOP/s | PyTorch ÷ vitscope, median per call "
          "| range |\n|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for n in args.n:
        b = max(1, round(4096 / n))
        q, k, v = operands(n, b, h, d, dtype, args.contiguous)
        for backward in (False, True):
            times = compare(q, k, v, backward, args.rounds)
            flops = 4 * b * h * n * n * d * (3 if backward else 1)
            ours, theirs = (statistics.median(times[name]) for name in ("vitscope", "pytorch"))
            ratios = [t / o for o, t in zip(times["vitscope"], times["pytorch"])]
            print(f"| {n} | {b} | {'fwd+bwd' if backward else 'fwd'} | {ours * 1e3:.1f} | {flops / ours / 1e9:.0f} "
                  f"| {theirs * 1e3:.1f} | {flops / theirs / 1e9:.0f} | **{statistics.median(ratios):.2f}** "
                  f"| {min(ratios):.2f}-{max(ratios):.2f} |", flush=True)


if __name__ == "__main__":
    main()
