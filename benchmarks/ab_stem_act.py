"""A/B: the conv stem with ReLU against GELU (ViTConfig.stem_act), the training step's speed.

    python benchmarks/ab_stem_act.py [--model vit_fmnist_quick] [--rounds 8] [--steps 8]

Both models live in one process and their timed rounds alternate (benchmarks/_ab.py); the table
gives each round's images/s and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ab import alternate, ratio_table, training_step  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.models import create_model, get_config  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_fmnist_quick")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and activation")
    args = ap.parse_args(argv)
    if not get_config(args.model).stem:
        raise SystemExit(f"{args.model} has no conv stem; pick a model with one, e.g. vit_fmnist_quick")
    steps = {}
    for act in ("relu", "gelu"):
        torch.manual_seed(0)
        steps[act] = training_step(create_model(args.model, stem_act=act), args.batch,
                                   get_config(args.model).num_classes)
    rates = alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(machine_header())
    print(f"\n{args.model}, batch {args.batch}, bfloat16 autocast training step, {args.rounds} alternating "
          f"rounds of {args.steps} steps\n")
    print(ratio_table(rates, "relu", "gelu", "stem activation"))


if __name__ == "__main__":
    main()
