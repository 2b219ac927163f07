"""Where a training step's time goes: torch.profiler's operators, by their own CPU time.

    python benchmarks/profile_step.py                                   # the quick preset, batch 128
    python benchmarks/profile_step.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/profile_step.py --optimizer muon --rows 30
    perf record -e cpu-clock -D 6000 -o /tmp/perf.data python benchmarks/profile_step.py \
        --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256 --loop 16   # then: perf report -i /tmp/perf.data

The step is the one the ab_*.py scripts time (benchmarks/_ab.py: bfloat16 autocast, forward,
cross-entropy, backward, the optimizer as vitscope.train builds it). After a warm-up it profiles
`--steps` steps and prints the machine, then the operators sorted by self CPU time. With `--loop SECONDS`
it only runs steps for that long, for a sampling profiler outside Python to watch (perf's cpu-clock
event works where the CPU's counters are not exposed, as in this project's VMs; -D skips the start-up).
"""

from __future__ import annotations

import sys
import time
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
    ap.add_argument("--loop", type=float, metavar="SECONDS",
                    help="run steps for SECONDS without torch.profiler (for perf record and the like)")
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)
    torch.manual_seed(0)
    model = create_model(args.model, **overrides)
    step = ab.training_step(model, args.batch, args.optimizer, dtype=args.dtype)
    for _ in range(3):
        step()
    if args.loop is not None:
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.loop:
            step()
            steps += 1
        ms = (time.perf_counter() - t0) / max(steps, 1) * 1e3
        print(f"{steps} steps, {ms:.1f} ms a step ({args.batch * 1e3 / ms:.0f} images/s)")
        return
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
