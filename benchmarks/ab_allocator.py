"""A/B: the training step with freed memory kept in the process (vitscope.kernels.allocator) against glibc's defaults.

    python benchmarks/ab_allocator.py                                       # the quick preset, batch 128
    python benchmarks/ab_allocator.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256

The allocator setting is process-wide and cannot be undone, so each round runs each variant in a
fresh process (alternating, so a drift of the host's speed falls on both): build the model, warm up,
time `--steps` steps of benchmarks/_ab.py's bfloat16-autocast training step. Besides images/s it
prints each variant's page faults and kernel (system) time per step and its peak resident memory,
medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.kernels import allocator  # noqa: E402
from vitscope.models import create_model  # noqa: E402

VARIANTS = ("kept", "default")


def child(model: str, overrides: dict, batch: int, steps: int, keep: bool) -> dict:
    """One variant in this (fresh) process: its images/s, faults and system time per step, peak memory."""
    torch.manual_seed(0)
    step = ab.training_step(create_model(model, **overrides), batch, keep_freed_memory=keep)
    if keep and allocator.applied() is None:
        raise SystemExit("this process's allocator is not glibc's malloc: nothing to compare")
    for _ in range(3):
        step()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        step()
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"images_per_s": batch * steps / dt, "faults": (r1.ru_minflt - r0.ru_minflt) / steps,
            "sys_ms": 1e3 * (r1.ru_stime - r0.ru_stime) / steps, "peak_mib": r1.ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)  # a variant's own process
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)
    if args.child:
        print(json.dumps(child(args.model, overrides, args.batch, args.steps, args.child == "kept")))
        return
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch),
                   "--steps", str(args.steps), "--child", v, *[f"--set={s}" for s in args.set]]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"the {v} process failed:\n{out.stderr[-2000:]}")
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(machine_header())
    name = " ".join([args.model, *args.set])
    print(f"\n{name}, batch {args.batch}, bfloat16 autocast training step, {args.rounds} alternating rounds "
          f"of {args.steps} steps, each in a fresh process\n")
    rates = {v: [r["images_per_s"] for r in runs[v]] for v in VARIANTS}
    print(ab.ratio_table(rates, "kept", "default", "freed memory"))
    print("\n| freed memory | page faults per step | system time per step | peak resident memory |")
    print("|---|---:|---:|---:|")
    for v in VARIANTS:
        med = {k: statistics.median(r[k] for r in runs[v]) for k in ("faults", "sys_ms", "peak_mib")}
        print(f"| {v} | {med['faults']:,.0f} | {med['sys_ms']:.1f} ms | {med['peak_mib']:,.0f} MiB |")


if __name__ == "__main__":
    main()
