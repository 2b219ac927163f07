"""Where greedy caption decoding spends its time: the encoder against the word-by-word loop, per implementation.

bench_caption.py times whole `generate` calls (encoder included). This script splits one greedy decoding of
N tokens, batch 32, caption_quick's shape (bench_caption.build_impl: random weights, <eos> unable to end a
caption) into the encoder's forward and the rest (the decoding loop), for vitscope with its kernels, vitscope
plain and transformers' sdpa, in one process, one thread, alternating for --rounds rounds; each figure is the
median process CPU time. Then a torch.profiler table of vitscope's loop (kernels on): its top PyTorch operators
by self CPU time and the operator calls per generated token; vitscope's own C kernels are not operators, so the
table's total is the loop's time less theirs (and less Python's).

    .venv/bin/python benchmarks/profile_decode.py
    .venv/bin/python benchmarks/profile_decode.py --n 32 --rounds 7
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
from bench_caption import BOS, PAD, build_impl, quick_shape  # noqa: E402
from vitscope.sequence.decoding import decode  # noqa: E402

IMPLS = ("vitscope", "vitscope-plain", "hf-sdpa")


def encoder_and_total(impl: str, model, images: torch.Tensor, n: int):
    """(encode, generate) callables of one implementation."""
    if impl.startswith("vitscope"):
        return (lambda: model.encode(images)), (lambda: decode(model, images, beam=1, max_len=n + 1))
    return (lambda: model.encoder(pixel_values=images)), (lambda: model.generate(
        pixel_values=images, max_new_tokens=n, num_beams=1, do_sample=False, eos_token_id=None, pad_token_id=PAD,
        decoder_start_token_id=BOS, use_cache=True))


def cpu_time(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20, help="tokens generated (default 20)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_header())
    shape = quick_shape()
    images = torch.randn(args.batch, shape["in_chans"], shape["img"], shape["img"],
                         generator=torch.Generator().manual_seed(1))
    models = {impl: build_impl(impl, shape).eval() for impl in IMPLS}
    calls = {impl: encoder_and_total(impl, m, images, args.n) for impl, m in models.items()}
    enc: dict[str, list[float]] = {i: [] for i in IMPLS}
    tot: dict[str, list[float]] = {i: [] for i in IMPLS}
    with torch.inference_mode():
        for impl in IMPLS:  # warm-up
            calls[impl][1]()
        for _ in range(args.rounds):
            for impl in IMPLS:
                enc[impl].append(cpu_time(calls[impl][0]))
                tot[impl].append(cpu_time(calls[impl][1]))
    ref = statistics.median(tot["hf-sdpa"]) - statistics.median(enc["hf-sdpa"])
    print(f"\ngreedy, N = {args.n}, batch {args.batch}, {args.threads} thread(s), median CPU ms of {args.rounds}:\n")
    print("| implementation | encoder | decoding loop | whole | loop ms per token | loop ÷ transformers' loop |")
    print("|---|---:|---:|---:|---:|---:|")
    for impl in IMPLS:
        e, t = statistics.median(enc[impl]), statistics.median(tot[impl])
        print(f"| {impl} | {e * 1e3:.1f} | {(t - e) * 1e3:.1f} | {t * 1e3:.1f} | {(t - e) * 1e3 / args.n:.2f} | "
              f"{(t - e) / ref:.2f} |")

    model = models["vitscope"]
    memory = model.encode(images)
    from torch.profiler import ProfilerActivity, profile  # only here: the timing above runs without it

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(model, memory=memory, beam=1, max_len=args.n + 1)
    events = prof.key_averages()
    total_calls = sum(e.count for e in events)
    print(f"\nvitscope's loop (kernels on) under torch.profiler: {total_calls / args.n:.0f} PyTorch operator calls "
          "a token (its own C kernels are not in the table)\n")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
