"""The decoder's one-token step: `FastTransformerDecoder` (vitscope/kernels/fast_decoder.py) against the same
kernels-applied captioner with that step switched off, so each decoding step runs the plain decoder's modules, and
with the step on but its attention left to PyTorch (`attend`) instead of vitscope's decode-attention kernels.

caption_quick's captioner as benchmarks/bench_caption.py builds it (random weights, <eos> unable to end a
caption), batch 32, greedy and beam 5 decoding of N = 20 tokens from an encoded memory (the encoder is left
out: it is the same on both sides), float32 and bfloat16 autocast where the CPU runs bfloat16 natively. Both
sides run in this process, alternating for --rounds rounds; each figure is the median of process CPU time per
decoding. Where the same ops run the captions come out the same; where vitscope's decode-attention kernel
runs (bfloat16 with AVX512-BF16) its float32 scores may break a near-tie of these random weights the other way,
so the table gives the share of tokens that agree.

    .venv/bin/python benchmarks/bench_decode_step.py
    .venv/bin/python benchmarks/bench_decode_step.py --rounds 7 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_header  # noqa: E402
from bench_caption import build_impl, quick_shape  # noqa: E402
from vitscope.kernels import bf16 as bf16_support  # noqa: E402
from vitscope.kernels import decode_attention  # noqa: E402
from vitscope.kernels.fast_decoder import FastTransformerDecoder  # noqa: E402
from vitscope.sequence.decoding import decode  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=20, help="tokens generated per caption")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = quick_shape()
    model = build_impl("vitscope", shape).eval()
    if not isinstance(model.decoder, FastTransformerDecoder):
        raise SystemExit("the kernels did not swap FastTransformerDecoder in")
    images = torch.randn(32, shape["in_chans"], shape["img"], shape["img"], generator=torch.Generator().manual_seed(1))
    one_token, usable = FastTransformerDecoder._one_token, decode_attention.usable
    sides = {"fast": (one_token, usable), "no kernel": (one_token, lambda *a: False),
             "plain": (lambda *a: False, usable)}
    print(machine_header({"torch_threads": args.threads}))
    print(f"\ncaption_quick's captioner, batch 32, N = {args.n} tokens from an encoded memory, {args.rounds} rounds; "
          "ms per decoding (median process CPU time):\n")
    print("| decoding | dtype | fast step | its attention in PyTorch | plain modules | speed-up "
          "| tokens that agree |")
    print("|---|---|---:|---:|---:|---:|---:|")
    dtypes = [torch.float32] + ([torch.bfloat16] if bf16_support.native_matmul() else [])
    for dtype in dtypes:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            memory = model.encode(images)
            for beam in (1, 5):
                times, tokens = {side: [] for side in sides}, {}
                for r in range(args.rounds + 1):  # the first round warms up
                    for side, (step, kernel) in sides.items():
                        FastTransformerDecoder._one_token, decode_attention.usable = step, kernel
                        t = time.process_time()
                        tokens[side] = decode(model, memory=memory, beam=beam, max_len=args.n + 1).tokens
                        if r:
                            times[side].append(time.process_time() - t)
                FastTransformerDecoder._one_token, decode_attention.usable = one_token, usable
                fast, no_kernel, plain = (1000 * statistics.median(times[side]) for side in sides)
                same = f"{100 * (tokens['fast'] == tokens['plain']).float().mean():.1f}%"
                name = "greedy" if beam == 1 else f"beam {beam}"
                print(f"| {name} | {str(dtype).removeprefix('torch.')} | {fast:.1f} | {no_kernel:.1f} | {plain:.1f} | "
                      f"{plain / fast:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
