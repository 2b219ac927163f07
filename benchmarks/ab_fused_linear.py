"""A/B: bfloat16 with oneDNN's fused linear (bias, and in inference GELU, in the matmul) against nn.Linear's path.

    python benchmarks/ab_fused_linear.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_fused_linear.py --model vit_small_patch16_224 --batch 64 --steps 3
    python benchmarks/ab_fused_linear.py --training --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_fused_linear.py --gelu --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256

vitscope's linear layers and patch embedding (vitscope/kernels/fused_linear.py) run oneDNN's linear with the
bias applied to the float32 accumulator wherever the compute dtype is bfloat16; where nothing needs
gradients fc1's GELU is fused too, and in training the backward is addmm's. This times one model's
inference forwards (`torch.inference_mode`, bfloat16 autocast, a fixed random batch), or with
`--training` its training steps (benchmarks/_ab.py), with the fused kernel and with it switched off
(`nn.Linear`'s `addmm`, a separate GELU, the patch conv), in alternating rounds in one process, and
prints each round's images/s and the median of the per-round ratios, fused first.

`--dtype float32` instead compares float32 linear layers through oneDNN's linear (forward and input
gradient; where `fused_linear.float32_available()`, AMD CPUs without AVX-512) against `F.linear` (MKL).

`--gelu` instead compares inference's two ways to fuse fc1's GELU: the matmul, then vitscope's table
pass (what runs where vitscope's C kernels do), against oneDNN's erf GELU in the matmul's epilogue.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.kernels import allocator, fused_linear  # noqa: E402
from vitscope.models import create_model  # noqa: E402


def inference_step(model: torch.nn.Module, batch: int, dtype: str = "bfloat16") -> Callable[[], None]:
    """One inference forward on a fixed random batch, under bfloat16 autocast (`dtype="float32"`: none)."""
    pe = model.patch_embed
    x = torch.randn(batch, pe.in_chans, *pe.img_size)

    def step() -> None:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            model(x)

    return step


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    ap.add_argument("--training", action="store_true", help="time training steps instead of inference forwards")
    ap.add_argument("--gelu", action="store_true",
                    help="inference's GELU: vitscope's table pass after the matmul against oneDNN's epilogue")
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)
    f32 = args.dtype == "float32"
    if f32 and not fused_linear.float32_available():
        sys.exit("float32 linear layers keep F.linear on this CPU (fused_linear.float32_available): nothing to compare")
    if not f32 and not fused_linear.available():
        sys.exit("this torch build or CPU has no oneDNN bfloat16 linear: nothing to compare")
    allocator.keep_freed_memory()  # as `vitscope eval` does
    torch.manual_seed(0)
    model = create_model(args.model, **overrides)
    if args.training:
        step = ab.training_step(model, args.batch, dtype=args.dtype)
    else:
        step = inference_step(model.eval(), args.batch, args.dtype)
    if args.gelu:
        epilogue = lambda x, w, b: fused_linear._KERNEL(x, w, b, "gelu", [], "none")  # noqa: E731
        steps = {"GELU table": step, "GELU epilogue": ab.with_attribute(step, fused_linear, "_linear_gelu", epilogue)}
    else:
        switch = "float32_available" if f32 else "available"
        steps = {"fused": step, "nn.Linear": ab.with_attribute(step, fused_linear, switch, lambda: False)}
    rates = ab.alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(machine_header())
    sets = "".join(f" {s}" for s in args.set)
    what = ("training step", "steps") if args.training else ("inference forward", "forwards")
    print(f"\n{args.model}{sets}, batch {args.batch}, {ab.step_label(args)} {what[0]}, {args.rounds} "
          f"alternating rounds of {args.steps} {what[1]}\n")
    short = "fp32" if f32 else "bf16"
    print(ab.ratio_table(rates, *steps, f"linear layers in {short} {what[0].split()[0]}"))


if __name__ == "__main__":
    main()
