"""A/B: bfloat16 training with vitscope's fused MLP (GELU's derivative kept) against the modules.

    python benchmarks/ab_fused_mlp.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_fused_mlp.py --model vit_small_patch16_224 --batch 32 --steps 2 --rounds 4

vitscope/fused_mlp.py runs a training step's MLP as fc1 in oneDNN's linear, a C kernel writing
gelu(a) and gelu'(a) in one pass, fc2; the backward takes a's gradient out of oneDNN's matmul with
the multiply by gelu'(a) in its epilogue. This times one model's training steps (benchmarks/_ab.py:
bfloat16 autocast, forward, cross-entropy, backward, the optimizer) with it and with it switched off
(fc1, nn.GELU and fc2 as modules, with fused_linear's bias-in-matmul linears), in alternating rounds
in one process, and prints each round's images/s and the median of the per-round ratios, fused first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope import fused_mlp, native  # noqa: E402
from vitscope.models import create_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)
    if native.library() is None:
        sys.exit(f"vitscope's kernels cannot run here: {native.why_not()}")
    torch.manual_seed(0)
    model = create_model(args.model, **overrides)
    step = ab.training_step(model, args.batch)
    steps = {"fused MLP": step, "modules": ab.with_attribute(step, fused_mlp, "fusable", lambda *a: False)}
    rates = ab.alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(machine_header())
    sets = "".join(f" {s}" for s in args.set)
    print(f"\n{args.model}{sets}, batch {args.batch}, bfloat16 autocast training step, {args.rounds} "
          f"alternating rounds of {args.steps} steps\n")
    print(ab.ratio_table(rates, "fused MLP", "modules", "MLP in bf16 training"))


if __name__ == "__main__":
    main()
