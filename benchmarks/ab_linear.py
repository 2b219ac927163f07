"""A/B: a linear layer's bfloat16 products, vitscope's kernel (native/linear.c) against oneDNN's.

    python benchmarks/ab_linear.py [--rows 12800] [--shapes 128x384 128x128 128x512 512x128] [--rounds 5]
    python benchmarks/ab_linear.py --rows 12608 --shapes 384x1152 384x384 384x1536 1536x384
    python benchmarks/ab_linear.py --in-step [--model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256]

For each (in, out) shape, four products as a training step has them, bfloat16, `--rows` rows (the plain
28x28 ViT at batch 256 has 12800: its qkv, proj, fc1 and fc2 by default; ViT-S/16 at batch 64 has 12608):
- forward: x Wᵀ + b, against oneDNN's linear (`mkldnn::_linear_pointwise`, the bias in its epilogue);
- forward + GELU: gelu(a) and gelu'(a) for a = x Wᵀ + b from the kernel's pass, against oneDNN's linear
  and then vitscope's GELU table pass (fused_gelu.gelu_and_derivative: fc1 in bfloat16 training);
- input grad: g W, against torch's matmul;
- input grad × d: (g W) ∘ d rounded once, against oneDNN's matmul with the multiply in its epilogue
  (`_linear_pointwise.binary`: fc2's backward, d = gelu'(a)).
Both sides run in alternating rounds in one process, freed memory kept (vitscope.kernels.allocator). Prints each
one's milliseconds, GFLOP/s, largest error against the float64 product (relative to its largest value)
and the ratio. Products the kernel does not take (vitscope.kernels.linear_kernel.runnable) are marked.

`--in-step` times the products inside whole bfloat16 training steps instead (benchmarks/_ab.py): steps with
the kernel and steps without alternate in one process, and each product's time is summed by its kind
and shape, so the figures include the cache state a step leaves its inputs in.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.kernels import allocator, fused_gelu, fused_linear, fused_mlp, linear_kernel, native  # noqa: E402

ONEDNN = fused_linear._KERNEL



def products(k: int, n: int, rows: int) -> list[tuple[str, bool, Callable, Callable, torch.Tensor]]:
    """(kind, taken, ours, oneDNN's, the float64 product) for the layer (in k, out n)."""
    bf = torch.bfloat16
    x, w, b = torch.randn(rows, k).to(bf), torch.randn(n, k).to(bf), torch.randn(n).to(bf)
    g, d = torch.randn(rows, n).to(bf), torch.randn(rows, k).to(bf)
    fwd = x.double() @ w.double().t() + b.double()
    back = g.double() @ w.double()
    fwd_taken, back_taken = linear_kernel.runnable(x, w, b), linear_kernel.runnable(g, w, forward=False)
    return [
        ("forward", fwd_taken, lambda: linear_kernel.forward(x, w, b), lambda: ONEDNN(x, w, b, "none", [], ""), fwd),
        ("forward + GELU", fwd_taken, lambda: linear_kernel.forward_gelu(x, w, b)[0],
         lambda: fused_gelu.gelu_and_derivative(ONEDNN(x, w, b, "none", [], ""))[0], torch.nn.functional.gelu(fwd)),
        ("input grad", back_taken, lambda: linear_kernel.input_grad(g, w), lambda: g @ w, back),
        ("input grad × d", back_taken, lambda: linear_kernel.input_grad(g, w, mul=d),
         lambda: ONEDNN.binary(g, d, w.t(), None, "mul"), back * d.double()),
    ]


def alone(argv: list[str]) -> None:
    args = ab.products_parser(__doc__, ["128x384", "128x128", "128x512", "512x128"], "INxOUT").parse_args(argv)
    allocator.keep_freed_memory()
    torch.manual_seed(0)
    print(machine_header())
    print(f"\nlinear products, bfloat16, {args.rows} rows, {args.rounds} alternating rounds of {args.reps}\n")
    print("| (in, out) | product | taken | vitscope ms | GFLOP/s | oneDNN ms | GFLOP/s | ratio "
          "| error vitscope / oneDNN |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    total = [0.0, 0.0]
    for shape in args.shapes:
        k, n = (int(v) for v in shape.lower().split("x"))
        flop = 2 * args.rows * k * n / 1e6
        for kind, taken, ours, theirs, exact in products(k, n, args.rows):
            ma, mb, *errs = ab.alternate_calls(ours, theirs, exact, rounds=args.rounds, reps=args.reps)
            if taken:
                total[0] += ma
                total[1] += mb
            print(f"| ({k}, {n}) | {kind} | {'yes' if taken else 'no'} | {ma:.2f} | {flop / ma:.0f} | {mb:.2f} | "
                  f"{flop / mb:.0f} | **{mb / ma:.2f}** | {errs[0]:.2g} / {errs[1]:.2g} |")
    print(f"\nthe products taken: vitscope {total[0]:.2f} ms, oneDNN {total[1]:.2f} ms, **{total[1] / total[0]:.2f}x**")


class _Timer:
    """Sums each product's time by (kind, in, out) under the label of the step running it."""

    def __init__(self) -> None:
        self.label = ""
        self.ms: dict[tuple[str, str], float] = defaultdict(float)

    def timed(self, kind: str, fn: Callable, shape: Callable[..., str]) -> Callable:
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.ms[(f"{kind} {shape(*args)}", self.label)] += (time.perf_counter() - t0) * 1e3
            return out
        return run


def in_step(argv: list[str]) -> None:
    args, overrides, step = ab.plain_step(__doc__, argv, "--in-step", rounds=12)
    timer = _Timer()

    call = linear_kernel._call

    def ours(x, k, w, weight_rows, n, bias, mul, gelu=False, derivative=False):
        kind = ("forward + GELU" if gelu else "forward" if weight_rows else
                "input grad × d" if mul is not None else "input grad")
        return timer.timed(kind, call, lambda *a: f"({k}, {n})" if weight_rows else f"({n}, {k})")(
            x, k, w, weight_rows, n, bias, mul, gelu, derivative)

    class OneDNN:  # fused_linear's and fused_mlp's handle on oneDNN's linear, timed
        def __call__(self, x, w, *rest):
            return timer.timed("forward", ONEDNN, lambda *a: "({}, {})".format(*w.shape[::-1]))(x, w, *rest)

        def binary(self, g, d, wt, *rest):
            shape = "({}, {})".format(*wt.shape)
            return timer.timed("input grad × d", ONEDNN.binary, lambda *a: shape)(g, d, wt, *rest)

    gelu = timer.timed("GELU table pass", fused_gelu.gelu_and_derivative, lambda a: f"({a.shape[-1]} wide)")
    matmul_grad = fused_linear.input_grad

    def input_grad(g, w):
        if linear_kernel.runnable(g, w, forward=False):
            return matmul_grad(g, w)
        return timer.timed("input grad", matmul_grad, lambda *a: "({}, {})".format(*w.shape[::-1]))(g, w)

    def labelled(label: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            timer.label = label
            fn()
        return run

    instrumented = step
    for owner, name, value in [(linear_kernel, "_call", ours), (fused_linear, "_KERNEL", OneDNN()),
                               (fused_mlp, "_KERNEL", OneDNN()), (fused_gelu, "gelu_and_derivative", gelu),
                               (fused_linear, "input_grad", input_grad)]:
        instrumented = ab.with_attribute(instrumented, owner, name, value)
    steps = {"kernel": labelled("kernel", instrumented),
             "oneDNN": labelled("oneDNN", ab.with_attribute(instrumented, linear_kernel, "runnable",
                                                            lambda *a, **k: False))}
    for fn in steps.values():  # warm-up, not counted
        for _ in range(3):
            fn()
    timer.ms.clear()
    rates = ab.alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps, warmup=0)
    print(machine_header())
    sets = "".join(f" {k}={v}" for k, v in overrides.items())
    per_step = args.rounds * args.steps
    print(f"\n{args.model}{sets}, batch {args.batch}, {ab.step_label(args)} training step, {args.rounds} "
          f"alternating rounds of {args.steps}; ms per step, each product summed over the step's layers\n")
    print("| product (in, out) | with the kernel | without |")
    print("|---|---:|---:|")
    for what in sorted({w for w, _ in timer.ms}):
        a, b = timer.ms.get((what, "kernel"), 0.0), timer.ms.get((what, "oneDNN"), 0.0)
        print(f"| {what} | {a / per_step:.2f} | {b / per_step:.2f} |")
    print()
    print(ab.ratio_table(rates, "kernel", "oneDNN", "linear products in the step"))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if native.library() is None:
        sys.exit(f"vitscope's kernels cannot run here: {native.why_not()}")
    if "--in-step" in argv:
        return in_step(argv)
    return alone(argv)


if __name__ == "__main__":
    main()
