"""A/B: the conv stem's weight gradients, vitscope's kernel against oneDNN's.

    python benchmarks/ab_conv_weight_grad.py [--model vit_fmnist_quick] [--batch 128] [--rounds 8]
    python benchmarks/ab_conv_weight_grad.py --dtype float32     # the AVX2 float32 kernel

The kernel is native/conv_weight_grad.c under bfloat16 autocast (the default), and with `--dtype float32`
native/conv_weight_grad_f32_avx2.c in float32 steps. Two tables, both from one process with freed memory
kept (vitscope.kernels.allocator):
- alone: each stem conv's weight gradient as the training step has it (channels-last g and x in the
  step's dtype), the kernel against `convolution_backward` asked for the weight's gradient only, in
  alternating rounds; milliseconds, GFLOP/s and the largest error against float64 (relative to its
  largest value);
- in the step: whole training steps with the kernel and without (vitscope.kernels.fused_conv.fusable saying no),
  alternating (benchmarks/_ab.py), and the time autograd spends in each stem conv's backward node (both
  gradients; the patch projection's too), read from hooks on the nodes themselves (module hooks would
  change the step).
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.kernels import allocator, fused_conv, fused_linear, native  # noqa: E402
from vitscope.models import create_model  # noqa: E402

BF, CL = torch.bfloat16, torch.channels_last



def _stem_inputs(model: nn.Module, batch: int, dt: torch.dtype) -> list[tuple[nn.Conv2d, torch.Tensor, torch.Tensor]]:
    """Each stem conv with its input and an output gradient of the training step's shapes, dtype and layout."""
    found, x = [], torch.randn(batch, model.patch_embed.in_chans, *model.patch_embed.img_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF, enabled=dt == BF):
        x = x.contiguous(memory_format=CL)
        for mod in model.patch_embed.stem:
            if isinstance(mod, nn.Conv2d):
                y = mod(x)
                found.append((mod, x.to(dt).contiguous(memory_format=CL),
                              torch.randn(y.shape).to(dt).contiguous(memory_format=CL)))
            x = mod(x)
    return found


def alone(model: nn.Module, batch: int, rounds: int, reps: int, dt: torch.dtype = BF) -> None:
    print("| conv (in → out, kernel, stride) | vitscope ms | GFLOP/s | oneDNN ms | GFLOP/s | ratio "
          "| error vitscope / oneDNN |")
    print("|---|---:|---:|---:|---:|---:|---|")
    totals = [0.0, 0.0]
    kernel = fused_conv.weight_grad if dt == BF else fused_conv.weight_grad_f32
    for conv, x, g in _stem_inputs(model, batch, dt):
        with torch.autocast("cpu", dtype=BF, enabled=dt == BF):
            if not fused_conv.fusable(x, conv):
                continue
        w, s, p = conv.weight.to(dt).contiguous(memory_format=CL), conv.stride[0], conv.padding[0]

        def theirs(dtype=dt, g=g, x=x, w=w, s=s, p=p):
            return torch.ops.aten.convolution_backward(g.to(dtype), x.to(dtype), w.to(dtype), None, [s, s], [p, p],
                                                       [1, 1], False, [0, 0], 1, [False, True, False])[1]

        def ours(g=g, x=x, w=w, s=s, p=p):
            return kernel(g, x, w.shape, s, p)

        ref = theirs(torch.float64)
        ma, mb, *errs = ab.alternate_calls(ours, theirs, ref, rounds=rounds, reps=reps)
        totals[0], totals[1] = totals[0] + ma, totals[1] + mb
        flop = 2 * g.numel() * conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1] / 1e6
        k = conv.kernel_size[0]
        print(f"| {conv.in_channels} → {conv.out_channels}, {k}×{k} s{s} | {ma:.2f} | {flop / ma:.0f} | {mb:.2f} | "
              f"{flop / mb:.0f} | **{mb / ma:.2f}** | {errs[0]:.2g} / {errs[1]:.2g} |")
    print(f"\nall: vitscope {totals[0]:.2f} ms, oneDNN {totals[1]:.2f} ms, **{totals[1] / totals[0]:.2f}x**")


def in_step(model: nn.Module, batch: int, rounds: int, steps_per_round: int, dtype: str = "bfloat16") -> None:
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(out: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
        if out.grad_fn is not None:
            (k, _), st = conv.kernel_size, conv.stride[0]
            key, start = f"{conv.in_channels} → {conv.out_channels}, {k}×{k} s{st}", [0.0]
            out.grad_fn.register_prehook(lambda go: start.__setitem__(0, time.perf_counter()))
            def done(gi, go, key=key, start=start):
                spent[key] += time.perf_counter() - start[0]

            out.grad_fn.register_hook(done)
        return out

    kernel_conv, module_forward = fused_conv.conv2d, nn.Conv2d._conv_forward
    fused_conv.conv2d = lambda x, conv: timed(kernel_conv(x, conv), conv)
    nn.Conv2d._conv_forward = lambda self, x, w, b: timed(module_forward(self, x, w, b), self)
    step = ab.training_step(model, batch, "muon", dtype=dtype)
    steps = {"kernel": step, "oneDNN": ab.with_attribute(step, fused_conv, "fusable", lambda *a: False)}
    for s in steps.values():
        for _ in range(3):
            s()
    ms: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name in steps}
    for _ in range(rounds):
        for name, s in steps.items():
            spent.clear()
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                s()
            ms[name]["step"].append((time.perf_counter() - t0) / steps_per_round * 1e3)
            for key, v in spent.items():
                ms[name][key].append(v / steps_per_round * 1e3)
    fused_conv.conv2d, nn.Conv2d._conv_forward = kernel_conv, module_forward
    keys = [k for k in ms["oneDNN"] if k != "step"]
    print("| median ms per step | " + " | ".join(keys) + " | convs' backward | whole step |")
    print("|---|" + "---:|" * (len(keys) + 2))
    for name, m in ms.items():
        med = {k: statistics.median(v) for k, v in m.items()}
        print(f"| {name} | " + " | ".join(f"{med[k]:.2f}" for k in keys)
              + f" | {sum(med[k] for k in keys):.1f} | {med['step']:.1f} |")
    ratios = [b / a for a, b in zip(ms["kernel"]["step"], ms["oneDNN"]["step"])]
    print(f"\nstep time oneDNN ÷ kernel, per round: {' '.join(f'{r:.2f}' for r in ratios)}; "
          f"median **{statistics.median(ratios):.2f}**")


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ap.add_argument("--reps", type=int, default=10, help="products per round and variant, alone")
    args = ap.parse_args(argv)
    dt = BF if args.dtype == "bfloat16" else torch.float32
    if dt == BF and not native.has("avx512_bf16"):
        sys.exit(f"vitscope's bfloat16 kernels cannot run here: {native.why_not('avx512_bf16')}")
    if dt == torch.float32 and not fused_linear.float32_kernels():
        sys.exit("vitscope's float32 conv kernel runs only on AMD CPUs with AVX2 and FMA and without AVX-512"
                 + (f" ({native.why_not('avx2')})" if native.why_not("avx2") else ""))
    allocator.keep_freed_memory()
    torch.manual_seed(0)
    model = create_model(args.model)
    print(machine_header())
    print(f"\n{args.model}, batch {args.batch}: each stem conv's weight gradient alone, {args.rounds} alternating "
          f"rounds of {args.reps}\n")
    alone(model, args.batch, args.rounds, args.reps, dt)
    print(f"\n{args.model}, batch {args.batch}, {ab.step_label(args)} training step (Muon, as the quick preset), "
          f"{args.rounds} alternating rounds of {args.steps}: each conv's backward node (the stem's and the patch\n"
          f"projection's; in → out, kernel, stride)\n")
    in_step(model, args.batch, args.rounds, args.steps, args.dtype)


if __name__ == "__main__":
    main()
