"""Attention with a few queries per row, as decoding one token at a time asks it: PyTorch's fused kernel
(F.scaled_dot_product_attention) against the explicit path (q @ kᵀ · scale, softmax in float32, @ v), what
`EXPLICIT_HALF_MAX_QUERIES` in vitscope.attention encodes.

A decoding step has one query per row (a beam group of an image: G queries against its one memory row),
against the self-attention cache (a few dozen keys) and the image's tokens (about 200). Shapes: the captioner
of caption_quick (batch 32, 4 heads of 32) and ViT-S-sized heads (batch 8, 6 heads of 64); N_q in {1, 2, 5, 8,
16, 32}, N_k in {20, 196}; inference mode, one torch thread by default; each figure the best of --rounds
medians of process CPU time per call (other jobs on a shared machine's cores count less).

    .venv/bin/python benchmarks/bench_decode_attention.py
    .venv/bin/python benchmarks/bench_decode_attention.py --dtypes bfloat16 --rounds 5
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

SHAPES = {"captioner (B 32, H 4, D 32)": (32, 4, 32), "ViT-S heads (B 8, H 6, D 64)": (8, 6, 64)}
QUERIES = (1, 2, 5, 8, 16, 32)
KEYS = (20, 196)


def explicit(q, k, v, scale):
    weights = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1, dtype=torch.float32)  # (B, H, Nq, Nk)
    return weights.to(v.dtype) @ v


def per_call_us(fn, calls: int, rounds: int) -> float:
    for _ in range(max(calls // 10, 3)):
        fn()
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(calls):
            t = time.process_time()
            fn()
            times.append(time.process_time() - t)
        medians.append(statistics.median(times))
    return 1e6 * min(medians)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=60, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_header({"torch_threads": args.threads}))
    print("\nMicroseconds per call (process CPU time), and fused / explicit (above 1: the explicit path is faster)\n")
    print("| dtype | shape | N_k | " + " | ".join(f"N_q {n}" for n in QUERIES) + " |")
    print("|---|---|---:|" + "---:|" * len(QUERIES))
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for shape, (b, h, d) in SHAPES.items():
            for nk in KEYS:
                cells = []
                for nq in QUERIES:
                    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for n in (nq, nk, nk))
                    with torch.inference_mode():
                        fused = per_call_us(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v),
                                            args.calls, args.rounds)
                        expl = per_call_us(lambda q=q, k=k, v=v, s=d**-0.5: explicit(q, k, v, s), args.calls,
                                           args.rounds)
                    cells.append(f"{fused:.0f} / {expl:.0f} = {fused / expl:.2f}")
                print(f"| {name} | {shape} | {nk} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
