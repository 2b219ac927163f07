"""A/B: vitscope's short-sequence attention kernels against PyTorch's, in a whole model or alone.

    python benchmarks/ab_short_attention.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_short_attention.py --model vit_small_patch16_224 --batch 64 --steps 3
    python benchmarks/ab_short_attention.py --training --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_short_attention.py --attention-only
    python benchmarks/ab_short_attention.py --dtype float32 ...   # the float32 kernel (AVX-512)

vitscope/kernels/short_attention.py runs its own kernels for attention with at most 256 keys: in bfloat16 on
AMX CPUs (vitscope/kernels/native/short_attention.c) or, without AMX, with AVX512-BF16 (native/attention_bf16.c),
in float32 on AVX-512 CPUs (native/attention_f32.c).
This times one model's inference forwards (`torch.inference_mode`, a fixed random batch), or with
`--training` its training steps (benchmarks/_ab.py), under bfloat16 autocast or in float32
(`--dtype`), with the kernels and with them switched off (PyTorch's flash kernel, or in bfloat16
training the explicit softmax path), in alternating rounds in one process, and prints each round's
images/s and the median of the per-round ratios, kernels first. `--attention-only` times the
attention call alone at the two benchmark shapes instead, in inference, with q, k and v strided
views of one qkv tensor as in the model, and checks the outputs against float64.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from ab_fused_linear import inference_step  # noqa: E402
from vitscope.kernels import allocator, short_attention  # noqa: E402
from vitscope.models import create_model  # noqa: E402

SHAPES = [(256, 4, 50, 32), (64, 6, 197, 64)]  # (B, H, N, D): the plain Fashion-MNIST ViT and ViT-S/16


def _time_ms(fn, args: tuple, reps: int) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def attention_only(reps: int, dtype: torch.dtype) -> str:
    rows = ["| B, H, N, D | kernel ms | flash ms | flash ÷ kernel | kernel GFLOP/s | max error, kernel "
            "| max error, flash |", "|---|---:|---:|---:|---:|---:|---:|"]
    for b, h, n, d in SHAPES:
        gen = torch.Generator().manual_seed(0)
        qkv = torch.randn(b, n, 3, h, d, generator=gen).to(dtype)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D) each, as the model's split
        with torch.inference_mode():
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
            ours, theirs = short_attention.attend(q, k, v), F.scaled_dot_product_attention(q, k, v)
            t_ours = _time_ms(short_attention.attend, (q, k, v), reps)
            t_flash = _time_ms(F.scaled_dot_product_attention, (q, k, v), reps)
        flops = 4 * b * h * n * n * d
        rows.append(f"| {b}, {h}, {n}, {d} | {t_ours:.2f} | {t_flash:.2f} | {t_flash / t_ours:.2f} | "
                    f"{flops / t_ours / 1e6:.0f} | {(ours.double() - ref).abs().max().item():.1e} | "
                    f"{(theirs.double() - ref).abs().max().item():.1e} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    ap.add_argument("--attention-only", action="store_true", help="time the attention call alone at two shapes")
    ap.add_argument("--training", action="store_true", help="time training steps instead of inference forwards")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    kernel = short_attention.kernel_for(dtype)
    if kernel is None:
        sys.exit(f"vitscope's {args.dtype} attention kernel cannot run here: {short_attention.why_not(dtype)}")
    allocator.keep_freed_memory()  # as `vitscope eval` does
    if args.attention_only:
        print(machine_header())
        print(f"\nattention alone, {args.dtype} inference, median of {args.rounds * args.steps} calls\n")
        print(attention_only(args.rounds * args.steps, dtype))
        return
    overrides = ab.model_overrides(ap, args)
    torch.manual_seed(0)
    model = create_model(args.model, **overrides)
    if args.training:
        step = ab.training_step(model, args.batch, dtype=args.dtype)
    else:
        step = inference_step(model.eval(), args.batch, args.dtype)
    other = "explicit" if args.training and args.dtype == "bfloat16" else "flash"
    steps = {"kernel": step, other: ab.with_attribute(step, short_attention, "usable", lambda *a: False)}
    rates = ab.alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(machine_header())
    sets = "".join(f" {s}" for s in args.set)
    what = ("training step", "steps") if args.training else ("inference forward", "forwards")
    print(f"\n{args.model}{sets}, batch {args.batch}, {ab.step_label(args)} {what[0]}, {args.rounds} "
          f"alternating rounds of {args.steps} {what[1]}\n")
    print(ab.ratio_table(rates, "kernel", other, f"attention in {args.dtype} {what[0].split()[0]}"))


if __name__ == "__main__":
    main()
