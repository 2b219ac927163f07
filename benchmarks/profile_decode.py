"""Where greedy caption decoding spends its time: the encoder against the word-by-word loop, per implementation.

bench_caption.py times whole `generate` calls (encoder included). This script splits one greedy decoding of
N tokens, batch 32, caption_quick's shape (bench_caption.build_impl: random weights, <eos> unable to end a
caption) into the encoder's forward and the rest (the decoding loop), for vitscope with its kernels, vitscope
plain and transformers' sdpa, in one process, one thread, alternating for --rounds rounds; each figure is the
median process CPU time. Then, for vitscope with its kernels:

- its loop by part (the timers wrap the fast decoder's step seams on the model instance): the first step, which
  fills the caches through the plain forward (the cross-attention's keys and values of every block), then per
  later step the cross-attention, the self-attention, the MLP, the rest (the other linear layers, the norms,
  Python), the way into it (the decoder's forward checking that the fast step may take the call), and greedy's
  own bookkeeping between steps. This pass decodes from an encoded memory, apart from the first table's, so its
  parts need not sum to that table's loop;
- its encoder by piece, one block at this shape against the PyTorch op that transformers' sdpa ViT runs for the
  same piece, with GFLOP/s and the share of this CPU's float32 matmul peak (a 2048² torch.mm, measured here):
  where both sides' pieces run at the peak, the encoder cannot be much faster than transformers';
- a torch.profiler table of the loop: its top PyTorch operators by self CPU time and the operator calls per
  generated token (vitscope's own C kernels are not operators, so the table's total is the loop's time less
  theirs and less Python's).

`--png` draws the first table and the loop's parts, with the time vitscope would need for 1.5x `generate`.

    .venv/bin/python benchmarks/profile_decode.py
    .venv/bin/python benchmarks/profile_decode.py --n 32 --rounds 7 --png benchmarks/decode_time_zen3.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine_header  # noqa: E402
from bench_attention import run_peak  # noqa: E402  (the matmul peak every benchmark here measures)
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


def median_ms(fn, rounds: int = 15) -> float:
    """Median process CPU ms of fn() over `rounds` calls, after two untimed ones."""
    fn(), fn()
    return statistics.median(cpu_time(fn) for _ in range(rounds)) * 1e3


def loop_parts(model, memory: torch.Tensor, n: int, rounds: int) -> dict[str, float]:
    """vitscope's greedy loop by part, median ms per decoding: timers wrap the fast decoder's seams on this instance
    (an instance attribute shadows the class's method, and `_step` calls through self), and model.step."""
    dec, spent = model.decoder, Counter()

    def timed(name: str, fn):
        def call(*args, **kwargs):
            t = time.process_time()
            out = fn(*args, **kwargs)
            spent[name] += time.process_time() - t
            return out
        return call

    seams = ("step_cross_attention", "step_self_attention", "step_mlp", "_step")
    for name in seams:
        setattr(dec, name, timed(name, getattr(dec, name)))
    step = model.step

    def first_or_later(state):  # the first step finds every cache empty
        return timed("first" if len(state.caches[0][0]) == 0 else "step", step)(state)

    model.step = first_or_later
    runs = []
    try:
        for _ in range(rounds + 1):
            spent.clear()
            whole = cpu_time(lambda: decode(model, memory=memory, beam=1, max_len=n + 1))
            runs.append({"first step (fills the caches)": spent["first"],
                         "cross-attention": spent["step_cross_attention"],
                         "self-attention": spent["step_self_attention"], "MLP": spent["step_mlp"],
                         "rest of the steps": spent["_step"] - spent["step_cross_attention"]
                         - spent["step_self_attention"] - spent["step_mlp"],
                         "checks before each step": spent["step"] - spent["_step"],
                         "between steps": whole - spent["step"] - spent["first"]})
    finally:
        for name in (*seams, "step"):
            delattr(dec if name != "step" else model, name)
    return {k: statistics.median(r[k] for r in runs[1:]) * 1e3 for k in runs[0]}


def encoder_pieces(model, images: torch.Tensor) -> list[tuple[str, float, float, float]]:
    """(piece, vitscope ms, PyTorch ms, GFLOP) for one encoder block at this shape and the patch embedding; the
    PyTorch side is the op transformers' sdpa ViT runs for it."""
    enc = model.encoder
    blk, x = enc.blocks[0], enc.embed(images)  # x (B, N, D)
    a, m = blk.attn, blk.mlp
    b, n, d = x.shape
    h, dh = a.num_heads, d // a.num_heads
    qkv = a.qkv(x)
    q, k, v = qkv.view(b, n, 3, h, dh).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, Dh)
    from vitscope.kernels import short_attention

    o = short_attention.attend_qkv(qkv, h, a.scale, None)  # (B, N, D)
    hid = m.fc1(x)
    rows = b * n
    return [
        ("patch embedding (whole encoder)", median_ms(lambda: enc.embed(images)), float("nan"), float("nan")),
        ("qkv projection", median_ms(lambda: a.qkv(x)), median_ms(lambda: F.linear(x, a.qkv.weight, a.qkv.bias)),
         2 * rows * d * 3 * d / 1e9),
        ("attention", median_ms(lambda: short_attention.attend_qkv(qkv, h, a.scale, None)),
         median_ms(lambda: F.scaled_dot_product_attention(q, k, v)), 4 * b * h * n * n * dh / 1e9),
        ("output projection", median_ms(lambda: a.proj(o)), median_ms(lambda: F.linear(o, a.proj.weight, a.proj.bias)),
         2 * rows * d * d / 1e9),
        ("fc1", median_ms(lambda: m.fc1(x)), median_ms(lambda: F.linear(x, m.fc1.weight, m.fc1.bias)),
         2 * rows * d * hid.shape[-1] / 1e9),
        ("GELU", median_ms(lambda: m.act(hid)), median_ms(lambda: F.gelu(hid)), float("nan")),
        ("fc2", median_ms(lambda: m.fc2(hid)), median_ms(lambda: F.linear(hid, m.fc2.weight, m.fc2.bias)),
         2 * rows * d * hid.shape[-1] / 1e9),
        ("LayerNorm (one of two)", median_ms(lambda: blk.norm1(x)),
         median_ms(lambda: F.layer_norm(x, (d,), blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)), float("nan")),
    ]


def draw(path: Path, n: int, whole: dict[str, tuple[float, float]], parts: dict[str, float], title: str) -> None:
    """Bars of each implementation's encoder and loop, the line vitscope's whole must reach for 1.5x transformers',
    and vitscope's loop by part."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.2), layout="constrained")
    top, bottom = fig.subplots(2, 1, height_ratios=[3, 2])
    names = list(whole)[::-1]
    for y, impl in enumerate(names):
        e, t = whole[impl]
        top.barh(y, e, color="tab:blue", label="encoder" if y == 0 else None)
        top.barh(y, t - e, left=e, color="tab:orange", label=f"decoding loop ({n} tokens)" if y == 0 else None)
        top.text(t + 3, y, f"{t:.0f} ms", va="center")
    need = whole["hf-sdpa"][1] / 1.5
    top.axvline(need, color="k", ls="--", lw=1)
    top.text(need, -0.55, f"1.5x transformers: {need:.0f} ms ", va="bottom", ha="right",
             bbox=dict(fc="white", ec="none", alpha=0.85, pad=1))
    top.set_yticks(range(len(names)), names)
    top.set_xlabel("CPU ms per greedy decoding of 32 images, one thread")
    top.set_xlim(0, max(t for _, t in whole.values()) * 1.18)
    top.set_ylim(-0.6, len(names) + 0.3)
    top.legend(loc="upper right", ncols=2, frameon=False)
    top.set_title(title, fontsize=10)
    left = 0.0
    for i, (part, ms) in enumerate(parts.items()):
        bottom.barh(0, ms, left=left, color=f"C{i}", label=f"{part}: {ms:.0f}")
        left += ms
    bottom.set_yticks([0], ["vitscope's loop"])
    loop = whole["vitscope"][1] - whole["vitscope"][0]
    bottom.set_xlabel(f"CPU ms per decoding, timed part by part in another pass (from an encoded memory): the parts "
                      f"sum to {left:.0f}; the loop above, timed whole, {loop:.0f}", fontsize=8)
    bottom.set_xlim(0, left * 1.02)
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncols=3, frameon=False, fontsize=8)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20, help="tokens generated (default 20)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--png", type=Path, help="draw the encoder and loop times and the loop's parts here")
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
    with torch.inference_mode():
        parts = loop_parts(model, memory, args.n, args.rounds)
    print(f"\nvitscope's loop by part, median CPU ms per decoding of {args.rounds}:\n")
    print("| part | ms | ms per token |\n|---|---:|---:|")
    for part, ms in parts.items():
        print(f"| {part} | {ms:.1f} | {ms / args.n:.2f} |")

    with torch.inference_mode():
        peak = run_peak(dict(threads=args.threads, dtype="float32", sizes=[2048], repeats=5))["gflops"]
        pieces = encoder_pieces(model, images)
    print(f"\nvitscope's encoder by piece (one block of {len(model.encoder.blocks)}), median CPU ms; float32 matmul "
          f"peak {peak:.0f} GFLOP/s (2048² torch.mm):\n")
    print("| piece | vitscope | PyTorch | vitscope GFLOP/s | % of peak | PyTorch GFLOP/s | % of peak |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for piece, ours, theirs, gflop in pieces:
        rates = "".join(f" {gflop / ms * 1e3:.0f} | {100 * gflop / ms * 1e3 / peak:.0f} |" if gflop == gflop
                        else " | |" for ms in (ours, theirs))
        theirs_text = f"{theirs:.2f}" if theirs == theirs else "-"
        print(f"| {piece} | {ours:.2f} | {theirs_text} |{rates}")

    from torch.profiler import ProfilerActivity, profile  # only here: the timing above runs without it

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(model, memory=memory, beam=1, max_len=args.n + 1)
    events = prof.key_averages()
    total_calls = sum(e.count for e in events)
    print(f"\nvitscope's loop (kernels on) under torch.profiler: {total_calls / args.n:.0f} PyTorch operator calls "
          "a token (its own C kernels are not in the table)\n")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))
    if args.png:
        from _machine import machine_info

        info = machine_info()
        whole = {impl: (statistics.median(enc[impl]) * 1e3, statistics.median(tot[impl]) * 1e3) for impl in IMPLS}
        draw(args.png, args.n, whole, parts, f"greedy, N = {args.n}, batch {args.batch}, float32: {info['cpu']}, "
             f"{info['vitscope_commit']}")
        print(f"\nwrote {args.png}")

if __name__ == "__main__":
    main()
