"""A/B: a model's eager training step against torch.compile's, with vitscope's custom ops in the graph and without.

    python benchmarks/ab_compile.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256 --rounds 6 --steps 6

Three copies of one model (same weights) in one process: eager; compiled with vitscope's kernels as
the custom ops the graph keeps (`vitscope::qkv_attention`, `vitscope::mlp_bf16` or `vitscope::mlp_f32`); and
compiled while `native.has` answers no (through every step: Dynamo guards on it and would trace again), so
the trace takes the explicit attention and nn.GELU's MLP and Inductor lowers them. Each compiled copy is
traced (its first step, untimed) before the rounds start; then the three alternate round by round
(benchmarks/_ab.py). Prints each round's images/s, the medians, and the per-round ratios of eager and of the
kernels' graph over the graph without them.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from vitscope.kernels import native  # noqa: E402
from vitscope.models import create_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)

    def model():
        torch.manual_seed(0)
        return create_model(args.model, **overrides)

    eager = ab.training_step(model(), args.batch, dtype=args.dtype)
    kernels = ab.training_step(torch.compile(model()), args.batch, dtype=args.dtype)
    kernels()  # traced with the kernels' availability as it is
    # traced, and run, as if the kernels were absent: Dynamo guards on `native.has` itself, so a step run
    # with the real one would trace the graph again, kernels and all
    without = ab.with_attribute(ab.training_step(torch.compile(model()), args.batch, dtype=args.dtype), native,
                                "has", lambda isa: False)
    without()
    steps = {"eager": eager, "compiled, vitscope's ops": kernels, "compiled, none": without}
    rates = ab.alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(ab.machine_header())
    print(f"\n{' '.join([args.model, *args.set])}, batch {args.batch}, {ab.step_label(args)} training step, "
          f"{args.rounds} alternating rounds of {args.steps}; the compiled copies traced before the rounds\n")
    print(ab.ratio_table(rates, "eager", "compiled, none", "step"))
    ratios = [a / b for a, b in zip(rates["compiled, vitscope's ops"], rates["compiled, none"])]
    print(f"compiled, vitscope's ops ÷ compiled, none, per round: {' '.join(f'{v:.2f}' for v in ratios)}; "
          f"median **{statistics.median(ratios):.2f}**")


if __name__ == "__main__":
    main()
