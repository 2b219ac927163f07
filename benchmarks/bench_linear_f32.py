"""float32 linear layers: MKL's products (what `F.linear` and `@` run) against oneDNN's (`fused_linear`'s float32
path), the three products of a layer, at the shapes of caption_quick's encoder (32 scenes of 196 tokens, width
128, MLP ratio 2) and decoder step (32 rows), and the plain 28 x 28 ViT's (M = 12800, width 256, MLP 512).

    .venv/bin/python benchmarks/bench_linear_f32.py
    .venv/bin/python benchmarks/bench_linear_f32.py --rounds 5

Each figure is the best of --rounds medians of process CPU time per call (--calls a round; bench_decode_attention's
timing), one torch thread by default, printed as GFLOP/s; the ratio is oneDNN's speed over MKL's. What
`fused_linear.float32_available()` decides from it: docs/performance.md, "Linear layers in float32 on AMD CPUs".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_header  # noqa: E402
from bench_decode_attention import per_call_us  # noqa: E402
from vitscope.kernels import fused_linear  # noqa: E402

# (what, M, in, out)
SHAPES = [("caption encoder qkv", 6272, 128, 384), ("caption encoder proj", 6272, 128, 128),
          ("caption encoder fc1", 6272, 128, 256), ("caption encoder fc2", 6272, 256, 128),
          ("decoder step qkv", 32, 128, 384), ("decoder step fc2", 32, 256, 128),
          ("plain ViT qkv", 12800, 256, 768), ("plain ViT fc2", 12800, 512, 256)]


def products(kernel, x, w, b, dy) -> list[tuple]:
    """(MKL's, oneDNN's) callables for a layer's forward, input gradient and weight gradient."""
    return [(lambda: torch.nn.functional.linear(x, w, b), lambda: kernel(x, w, b, "none", [], "")),
            (lambda: dy @ w, lambda: kernel(dy, w.t(), None, "none", [], "")),
            (lambda: dy.t() @ x, lambda: fused_linear._float32_weight_grad(dy, x))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20, help="timed calls per round")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = fused_linear._KERNEL
    if kernel is None:
        raise SystemExit("this torch has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
    print(machine_header({"torch_threads": args.threads}))
    print(f"\nfused_linear.float32_available() here: {fused_linear.float32_available()}\n")
    print("| layer | M x in -> out | x Wᵀ + b: MKL | oneDNN | ratio | g W: MKL | oneDNN | ratio "
          "| gᵀ x: MKL | oneDNN | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for what, m, inp, out in SHAPES:
        x, w, b = torch.randn(m, inp, generator=g), torch.randn(out, inp, generator=g), torch.randn(out, generator=g)
        dy = torch.randn(m, out, generator=g)
        pairs = products(kernel, x, w, b, dy)
        flop = 2 * m * inp * out / 1e3  # per microsecond: GFLOP/s
        cells = []
        with torch.inference_mode():
            for mkl, onednn in pairs:
                a, o = per_call_us(mkl, args.calls, args.rounds), per_call_us(onednn, args.calls, args.rounds)
                cells += [f"{flop / a:.0f}", f"{flop / o:.0f}", f"{a / o:.2f}x"]
        print(f"| {what} | {m} x {inp} -> {out} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
