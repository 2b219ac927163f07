"""A/B: the conv stem in channels-last memory (what vitscope does) against the default layout.

    python benchmarks/ab_stem_layout.py [--model vit_fmnist_quick] [--rounds 8] [--steps 8]

Both models live in one process and their timed rounds alternate (benchmarks/_ab.py); the table
gives each round's images/s and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from einops import rearrange

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ab import alternate, ratio_table, training_step  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.models import create_model, get_config  # noqa: E402
from vitscope.vit import PatchEmbed  # noqa: E402


def _default_layout_forward(self: PatchEmbed, x: torch.Tensor) -> torch.Tensor:
    """PatchEmbed.forward without the channels-last input (the layout before this change)."""
    self.check(x)
    if self.stem is not None:
        x = self.stem(x)
    return rearrange(self.proj(x), "b d h w -> b (h w) d")


def make_step(model_name: str, channels_last: bool, batch: int):
    torch.manual_seed(0)
    model = create_model(model_name)
    if not channels_last:  # this model's patch embedding only
        model.patch_embed.to(memory_format=torch.contiguous_format)
        model.patch_embed.forward = _default_layout_forward.__get__(model.patch_embed)
    return training_step(model, batch, get_config(model_name).num_classes)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_fmnist_quick")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and layout")
    args = ap.parse_args(argv)
    steps = {"channels-last": make_step(args.model, True, args.batch),
             "default": make_step(args.model, False, args.batch)}
    rates = alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(machine_header())
    print(f"\n{args.model}, batch {args.batch}, bfloat16 autocast training step, {args.rounds} alternating "
          f"rounds of {args.steps} steps\n")
    print(ratio_table(rates, "channels-last", "default", "stem layout"))


if __name__ == "__main__":
    main()
