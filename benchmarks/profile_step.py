"""Where a training step's time goes: torch.profiler's operators, by their own CPU time.

    python benchmarks/profile_step.py                                   # the quick preset, batch 128
    python benchmarks/profile_step.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/profile_step.py --optimizer muon --rows 30

The step is the one the ab_*.py scripts time (benchmarks/_ab.py: bfloat16 autocast, forward,
cross-entropy, backward, the optimizer as vitscope.train builds it). After a warm-up it profiles
`--steps` steps and prints the machine, then the operators sorted by self CPU time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.models import create_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    ap.add_argument("--rows", type=int, default=20, help="operators to list")
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)
    torch.manual_seed(0)
    model = create_model(args.model, **overrides)
    step = ab.training_step(model, args.batch, args.optimizer, dtype=args.dtype)
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    print(machine_header())
    name = " ".join([args.model, *args.set])
    print(f"\n{name}, batch {args.batch}, {args.optimizer}, {ab.step_label(args)} training step, "
          f"{args.steps} steps profiled\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
