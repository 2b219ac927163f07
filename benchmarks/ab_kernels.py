"""A/B: training with vitscope's kernels against the same step without them, one part at a time or all.

    python benchmarks/ab_kernels.py --part mlp --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_kernels.py --part layernorm --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_kernels.py --part all --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_kernels.py --part gelu --model vit_fmnist_quick --batch 128
    python benchmarks/ab_kernels.py --part gelu --inference --model vit_fmnist_quick --batch 128 --steps 16
    python benchmarks/ab_kernels.py --part bn-gelu --model vit_fmnist_quick --batch 128
    python benchmarks/ab_kernels.py --part conv-wgrad --model vit_fmnist_quick --batch 128 --optimizer muon
    python benchmarks/ab_kernels.py --dtype float32 --part conv-wgrad bn-gelu --model vit_fmnist_quick \
        --batch 128 --optimizer muon      # several parts: B runs without all of them
    python benchmarks/ab_kernels.py --part linear --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_kernels.py --part weight-grad --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_kernels.py --part add-norm --inference --model vit_small_patch16_224 --batch 64 --steps 2
    python benchmarks/ab_kernels.py --part add-norm-chain --inference --model vit_tiny_patch4_28 --set mlp_ratio=4.0 \
        --batch 256 --steps 20
    python benchmarks/ab_kernels.py --part all --model vit_small_patch16_224 --batch 32 --steps 2 --rounds 4
    python benchmarks/ab_kernels.py --dtype float32 --part gelu --model vit_tiny_patch4_28 --set mlp_ratio=4.0 \
        --batch 256       # float32 (CPUs without AVX-512: the AVX2 attention, GELU and linear, oneDNN's linear)

Parts (each switched off by making its `fusable`/`usable` say no):
- `attention`: vitscope/kernels/short_attention.py, the attention forward and backward (AMX tiles, or AVX512-BF16), from and
  to the qkv projection (off: the explicit softmax path);
- `mlp`: vitscope/kernels/fused_mlp.py, a C pass writing gelu(a) and gelu'(a), and the multiply by gelu'(a)
  inside fc2's backward matmul (off: fc1, nn.GELU and fc2 as modules, still with fused_linear's
  bias-in-matmul linears); in float32, the same inside native/linear_f32_avx2.c's products;
- `layernorm`: vitscope/kernels/fused_layer_norm.py, LayerNorm writing bfloat16 for the next linear layer and
  reading the bfloat16 gradient (off: nn.LayerNorm in float32 and autocast's casts);
- `residual`: vitscope/kernels/fused_residual.py, the residual add of a bfloat16 branch into the float32
  stream in one pass (off: `x + y`, which first copies y to float32);
- `add-norm`: vitscope/kernels/fused_add_norm.py, a block's first residual add and norm2 in one pass, and its
  second with the next block's norm1 (in a model's loop over unhooked blocks), in inference into the
  first sum in place (off: the residual and LayerNorm kernels apart; switching either of those off
  switches this off too);
- `add-norm-chain`: the part of `add-norm` across blocks alone (off: the model's loop calls each block
  as a module, each block's second residual added on its own);
- `gelu`: vitscope/kernels/fused_gelu.py, the conv stem's GELU from a table, its derivative kept for the
  backward (off: nn.GELU's ops; models without a stem have none; with `bn-gelu` on, only where that
  cannot run); in float32 (AVX2 CPUs) every GELU, the stem's and the MLPs', from native/gelu_f32_avx2.c;
- `bn-gelu`: vitscope/kernels/fused_bn_gelu.py, the stem's BatchNorm and GELU in one kernel each way, in float32
  (AVX2 CPUs) from native/batch_norm_f32_avx2.c (off: the two modules);
- `weight-grad`: native/weight_grad.c (vitscope/kernels/fused_linear.py's `weight_grad`), the linear layers'
  weight gradients where the output is small (off: oneDNN's matmul);
- `conv-wgrad`: vitscope/kernels/fused_conv.py, the conv stem's weight gradients from native/conv_weight_grad.c, in
  float32 (AVX2 CPUs) from native/conv_weight_grad_f32_avx2.c (off: oneDNN's convolution backward);
- `linear`: native/linear.c (vitscope/kernels/linear_kernel.py), the linear layers' products forward and their input
  gradients, with fc1's GELU and the multiply by its derivative in the same passes (off: oneDNN's linear
  and matmul, and the GELU table's own pass);
- `onednn-f32`: vitscope/kernels/fused_linear.py's float32 path, the linear layers' forward and input gradient in
  oneDNN's linear on AMD CPUs without AVX-512 (off: F.linear, MKL);
- `linear-f32`: native/linear_f32_avx2.c (vitscope/kernels/linear_f32.py), the float32 path's three products (forward,
  input gradient, weight and bias gradients) on AMD CPUs without AVX-512 (off: oneDNN's linear forward and for
  the input gradient, torch.mm and a column sum for the weight and bias gradients);
- `all`: the thirteen together (or name several parts).

This times one model's training steps (benchmarks/_ab.py: bfloat16 autocast, or float32 with
`--dtype float32`; forward, cross-entropy, backward, the optimizer), or with `--inference` its inference
forwards (the training MLP's part then does not run), with and without, in alternating rounds in one
process, and prints each round's images/s and the median of the per-round ratios, kernels first.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from ab_fused_linear import inference_step  # noqa: E402
from vitscope.kernels import (  # noqa: E402
    allocator,
    fused_add_norm,
    fused_bn_gelu,
    fused_conv,
    fused_gelu,
    fused_layer_norm,
    fused_linear,
    fused_mlp,
    fused_residual,
    linear_f32,
    linear_kernel,
    native,
    short_attention,
)
from vitscope.models import create_model  # noqa: E402
from vitscope.vit import VisionTransformer  # noqa: E402

SWITCHES = {"attention": (short_attention, "usable"), "mlp": (fused_mlp, "fusable"),
            "layernorm": (fused_layer_norm, "fusable"), "residual": (fused_residual, "fusable"),
            "gelu": (fused_gelu, "fusable"), "bn-gelu": (fused_bn_gelu, "fusable"),
            "weight-grad": (fused_linear, "_native_weight_grad"), "add-norm": (fused_add_norm, "fusable"),
            "add-norm-chain": (VisionTransformer, "_chainable"), "conv-wgrad": (fused_conv, "fusable"),
            "linear": (linear_kernel, "runnable"), "onednn-f32": (fused_linear, "float32_fusable"),
            "linear-f32": (linear_f32, "usable")}


def without(step: Callable[[], None], parts: list[str]) -> Callable[[], None]:
    for part in parts:
        owner, name = SWITCHES[part]
        step = ab.with_attribute(step, owner, name, lambda *a, **k: False)
    return step


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    ap.add_argument("--part", choices=[*SWITCHES, "all"], default=["all"], nargs="+",
                    help="which kernels to switch off in B (several: all of them together)")
    ap.add_argument("--inference", action="store_true", help="time inference forwards instead of training steps")
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                    help="the training step's optimizer (the quick preset trains with muon)")
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)
    if native.library() is None:
        sys.exit(f"vitscope's kernels cannot run here: {native.why_not()}")
    parts = list(SWITCHES) if "all" in args.part else list(dict.fromkeys(args.part))
    torch.manual_seed(0)
    model = create_model(args.model, **overrides)
    if args.inference:
        allocator.keep_freed_memory()  # as `vitscope eval` does (training_step does it too)
        step = inference_step(model.eval(), args.batch, args.dtype)
    else:
        step = ab.training_step(model, args.batch, args.optimizer, dtype=args.dtype)
    steps = {"kernels": step, "without": without(step, parts)}
    rates = ab.alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(machine_header())
    sets = "".join(f" {s}" for s in args.set)
    what = "inference forward" if args.inference else f"training step ({args.optimizer})"
    short = "bf16" if args.dtype == "bfloat16" else "fp32"
    print(f"\n{args.model}{sets}, batch {args.batch}, {ab.step_label(args)} {what}, {args.rounds} "
          f"alternating rounds of {args.steps}; B without: {', '.join(parts)}\n")
    print(ab.ratio_table(rates, "kernels", "without", f"{' + '.join(args.part)} in {short} {what.split()[0]}"))


if __name__ == "__main__":
    main()
