"""A/B: the float32 ops vitscope takes over on CPUs without AVX-512, each alone against PyTorch's.

    python benchmarks/ab_float32_ops.py                       # the plain 28x28 ViT's shapes, M = 12800 rows
    python benchmarks/ab_float32_ops.py --rows 6272 --shapes 384x128 128x128 256x128 128x256   # quick preset

For each linear shape OUTxIN, with x (M, in), W (out, in) and g (M, out):
- forward x Wᵀ + b: oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, what fused_linear.linear_float32
  runs) against F.linear (torch's default: MKL's sgemm);
- input gradient g W: oneDNN's linear reading Wᵀ in place against torch.mm;
- weight gradient gᵀ x: the same two (vitscope keeps torch.mm's: oneDNN was slower here);
then, where it runs, vitscope's own float32 kernel (native/linear_f32_avx2.c) for the three against what the
float32 path runs without it (oneDNN's forward and input gradient, torch.mm's weight gradient and g.sum(0)
for the bias's);
and GELU at (M, 4·in) of the widest layer: native/gelu_f32_avx2.c forward and backward against F.gelu and
aten.gelu_backward. Each pair runs in alternating rounds (benchmarks/_ab.py's `alternate_calls`), median
milliseconds per call, GFLOP/s for the products, and each one's largest error against float64 relative to
the result's largest magnitude.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.kernels import fused_gelu, fused_linear, linear_f32, native  # noqa: E402

SHAPES = ["384x128", "128x128", "512x128", "128x512"]  # the plain ViT's qkv, proj, fc1 and fc2


def _products(onednn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> dict:
    """name: (oneDNN's call, torch's call, the float64 result) for a linear layer's three products."""
    return {
        "forward x Wᵀ + b": (lambda: onednn(x, w, b, "none", [], ""), lambda: F.linear(x, w, b),
                             F.linear(x.double(), w.double(), b.double())),
        "input grad g W": (lambda: onednn(g, w.t(), None, "none", [], ""), lambda: g @ w, g.double() @ w.double()),
        "weight grad gᵀ x": (lambda: onednn(g.t(), x.t(), None, "none", [], ""), lambda: g.t() @ x,
                             g.double().t() @ x.double()),
    }


def _kernel_cases(onednn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> dict:
    """name: (vitscope's call, the call without it, the float64 result) for the three products."""
    return {
        "forward x Wᵀ + b": (lambda: linear_f32.forward(x, w, b), lambda: onednn(x, w, b, "none", [], ""),
                             F.linear(x.double(), w.double(), b.double())),
        "input grad g W": (lambda: linear_f32.input_grad(g, w), lambda: onednn(g, w.t(), None, "none", [], ""),
                           g.double() @ w.double()),
        "weight + bias grad": (lambda: linear_f32.weight_and_bias_grad(g, x, True)[0],
                               lambda: (g.t() @ x, g.sum(0))[0], g.double().t() @ x.double()),
    }


def _table(args, cases_for, first: str, second: str) -> None:
    """One row per product and shape: `cases_for(x, w, b, g)`'s pairs timed in alternating rounds."""
    m = args.rows
    print(f"\n| product | out × in | {first} ms | {second} ms | {second} ÷ {first} | {first} GFLOP/s "
          f"| {second} GFLOP/s | error, {first} | error, {second} |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes:
        out, inp = (int(v) for v in shape.split("x"))
        x, w, b, g = torch.randn(m, inp), torch.randn(out, inp) * inp**-0.5, torch.randn(out), torch.randn(m, out)
        flops = 2 * m * out * inp
        for name, (ours, theirs, exact) in cases_for(x, w, b, g).items():
            a, t, ea, et = ab.alternate_calls(ours, theirs, exact, rounds=args.rounds, reps=args.reps)
            print(f"| {name} | {out} × {inp} | {a:.2f} | {t:.2f} | {t / a:.2f} | {flops / a / 1e6:.0f} "
                  f"| {flops / t / 1e6:.0f} | {ea:.1e} | {et:.1e} |")


def main(argv: list[str] | None = None) -> None:
    ap = ab.products_parser(__doc__, SHAPES, "OUTxIN")
    args = ap.parse_args(argv)
    onednn = fused_linear._KERNEL
    if onednn is None or not torch.backends.mkldnn.is_available():
        sys.exit("this torch build has no oneDNN linear: nothing to compare")
    torch.manual_seed(0)
    m = args.rows
    print(machine_header())
    print(f"\nfloat32, M = {m} rows, median of {args.rounds} alternating rounds of {args.reps} calls; "
          f"fused_linear.float32_available(): {fused_linear.float32_available()}")
    _table(args, lambda x, w, b, g: _products(onednn, x, w, b, g), "oneDNN", "torch")
    if linear_f32.usable():  # vitscope's products against what the float32 path runs without them
        _table(args, lambda x, w, b, g: _kernel_cases(onednn, x, w, b, g), "kernel", "without")
    widest = max(int(v) for shape in args.shapes for v in shape.split("x"))
    a = torch.randn(m, widest) * 3
    if not fused_gelu.fusable(a):
        print(f"\nGELU: vitscope's float32 kernel does not run here ({native.why_not('avx2') or 'an AVX-512 CPU'})")
        return
    g = torch.randn_like(a)
    lib, threads, n = native.library(), torch.get_num_threads(), a.numel()
    h, ga = torch.empty_like(a), torch.empty_like(a)

    def kernel_fwd():
        lib.vs_gelu_f32(a.data_ptr(), h.data_ptr(), n, threads)
        return h

    def kernel_bwd():
        lib.vs_gelu_f32_bwd(a.data_ptr(), g.data_ptr(), ga.data_ptr(), n, threads)
        return ga

    print(f"\n| GELU at {m} × {widest} | kernel ms | torch ms | torch ÷ kernel | error, kernel | error, torch |")
    print("|---|---:|---:|---:|---:|---:|")
    ad = a.double()
    for name, ours, theirs, exact in (
            ("forward", kernel_fwd, lambda: F.gelu(a), F.gelu(ad)),
            ("backward", kernel_bwd, lambda: torch.ops.aten.gelu_backward(g, a),
             torch.ops.aten.gelu_backward(g.double(), ad))):
        k, t, ek, et = ab.alternate_calls(ours, theirs, exact, rounds=args.rounds, reps=args.reps)
        print(f"| {name} | {k:.2f} | {t:.2f} | {t / k:.2f} | {ek:.1e} | {et:.1e} |")


if __name__ == "__main__":
    main()
