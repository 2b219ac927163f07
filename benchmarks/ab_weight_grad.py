"""A/B: a linear layer's weight gradient gᵀ x, vitscope's kernel (native/weight_grad.c) against oneDNN's matmul.

    python benchmarks/ab_weight_grad.py [--rows 12800] [--shapes 384x128 128x128 512x128 128x512] [--rounds 5]
    python benchmarks/ab_weight_grad.py --bias-in-step [--model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256]

For each (out, in) shape, bfloat16 g (rows, out) and x (rows, in) as a training step has them (the
plain 28x28 ViT at batch 256 has 12800 rows: its qkv, proj, fc1 and fc2 by default); both products
are timed in alternating rounds in one process, freed memory kept (vitscope.kernels.allocator). Prints each
one's milliseconds, GFLOP/s and largest error against the float64 product (relative to its largest
value), and the ratio. Shapes the kernel does not take (vitscope.kernels.fused_linear._native_weight_grad)
are marked and time oneDNN's product on both sides.

`--bias-in-step` times whole bfloat16 training steps instead (benchmarks/_ab.py, alternating rounds):
the bias gradients summed inside the kernel from the chunks it packs, against the kernel's weight
gradient and a separate `g.sum(0)`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.kernels import allocator, fused_linear, native  # noqa: E402


def bias_in_step(argv: list[str]) -> None:
    args, overrides, step = ab.plain_step(__doc__, argv, "--bias-in-step", rounds=10)
    kernel = fused_linear.weight_and_bias_grad

    def separate(g: torch.Tensor, x: torch.Tensor, bias: bool, weight: bool = True):
        return kernel(g, x, False, weight)[0], (g.sum(0) if bias else None)

    steps = {"bias in kernel": step,
             "g.sum(0)": ab.with_attribute(step, fused_linear, "weight_and_bias_grad", separate)}
    rates = ab.alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(machine_header())
    sets = "".join(f" {k}={v}" for k, v in overrides.items())
    print(f"\n{args.model}{sets}, batch {args.batch}, {ab.step_label(args)} training step, {args.rounds} "
          f"alternating rounds of {args.steps}\n")
    print(ab.ratio_table(rates, "bias in kernel", "g.sum(0)", "bias gradients"))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--bias-in-step" in argv:
        return bias_in_step(argv)
    args = ab.products_parser(__doc__, ["384x128", "128x128", "512x128", "128x512"], "OUTxIN").parse_args(argv)
    if native.library() is None:
        sys.exit(f"vitscope's kernels cannot run here: {native.why_not()}")
    allocator.keep_freed_memory()
    torch.manual_seed(0)
    print(machine_header())
    print(f"\nweight gradient gᵀx, bfloat16, {args.rows} rows, {args.rounds} alternating rounds of {args.reps}\n")
    print("| (out, in) | kernel | vitscope ms | GFLOP/s | oneDNN ms | GFLOP/s | ratio | error vitscope / oneDNN |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    total = [0.0, 0.0]
    for shape in args.shapes:
        out, inp = (int(v) for v in shape.lower().split("x"))
        g = torch.randn(args.rows, out).to(torch.bfloat16)
        x = torch.randn(args.rows, inp).to(torch.bfloat16)
        ours, theirs = (lambda g=g, x=x: fused_linear.weight_grad(g, x)), (lambda g=g, x=x: g.t() @ x)
        ref = g.double().t() @ x.double()
        ma, mb, *errs = ab.alternate_calls(ours, theirs, ref, rounds=args.rounds, reps=args.reps)
        total[0] += ma
        total[1] += mb
        flop = 2 * args.rows * out * inp / 1e6
        taken = "vitscope's" if fused_linear._native_weight_grad(g, x) else "oneDNN's (not taken)"
        print(f"| ({out}, {inp}) | {taken} | {ma:.2f} | {flop / ma:.0f} | {mb:.2f} | {flop / mb:.0f} | "
              f"**{mb / ma:.2f}** | {errs[0]:.2g} / {errs[1]:.2g} |")
    print(f"\nall shapes: vitscope {total[0]:.2f} ms, oneDNN {total[1]:.2f} ms, **{total[1] / total[0]:.2f}x**")


if __name__ == "__main__":
    main()
